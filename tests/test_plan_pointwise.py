"""The planner's pointwise tiles: arithmetic-light kernels stream in short blocks, one
vector a thread; kernels with special functions keep several vectors in flight."""
from __future__ import annotations

import pytest
import sympy as sp

from eulergen.generator import ir
from eulergen.generator import plan as planner

x, y = sp.symbols("x y")


def _code(expr) -> ir.Code:
    return ir.Code(temps=(), results=(ir.Assign("r", expr),))


@pytest.mark.parametrize("expr, light", [
    (sp.Max(x, 0), True),
    (y * sp.Heaviside(x), True),
    (2 * y * sp.Heaviside(x) * sp.Max(x, 0) ** 2, True),
    (sp.sqrt(2) * x / 2, True),            # a constant's root is a literal
    (sp.Abs(x) * y, True),
    (sp.Piecewise((x, x > 0), (2 * x, True)), True),   # where(): a select
    (sp.Piecewise((sp.exp(x), x > 0), (x, True)), False),
    (x / y, False),                        # a division
    (sp.sqrt(x), False),
    (sp.exp(x), False),
    (x * sp.tanh(x), False),
])
def test_arithmetic_light(expr, light):
    assert planner.arithmetic_light(_code(expr)) is light


def test_a_heavy_temporary_makes_the_code_heavy():
    code = ir.Code(temps=(ir.Assign("t", sp.exp(x)),), results=(ir.Assign("r", y * sp.Symbol("t")),))
    assert not planner.arithmetic_light(code)


def test_tiles():
    """Light code takes the light tile whatever it reads; other fp32 code 128 x 2; other bf16
    code 128 x 8 reading one operand, 256 x 4 reading more."""
    assert planner.pointwise_tile("bf16", 2, light=True) == planner.POINTWISE_LIGHT_TILE
    assert planner.pointwise_tile("f32", 1, light=True) == planner.POINTWISE_LIGHT_TILE
    assert planner.pointwise_tile("f32", 1, light=False) == (128, 2)
    assert planner.pointwise_tile("f32", 3, light=False) == (128, 2)
    assert planner.pointwise_tile("bf16", 1, light=False) == (128, 8)
    assert planner.pointwise_tile("bf16", 2, light=False) == (256, 4)
    assert planner.pointwise_tile("bf16", 3, light=False) == (256, 4)


def test_the_built_swiglu_kernels_take_their_dtype_tile_for_two_and_three_operands():
    """swiglu reads a, b forward and a, b, dy backward: POINTWISE_TILE either way."""
    from eulergen.runtime.engine.ops import OpLibrary
    from eulergen.runtime.engine.backend import get_backend
    lib = OpLibrary(get_backend("numpy"))
    for stage in ("forward", "backward"):        # reads a, b; then a, b, dy
        for dt in ("f32", "bf16"):
            g = lib.op("swiglu").kernels[f"swiglu_{stage}_{dt}"].geometry
            assert (g.threads, g.unroll) == planner.POINTWISE_TILE[dt]


def test_the_built_relu_kernels_take_the_light_tile():
    from eulergen.runtime.engine.ops import OpLibrary
    from eulergen.runtime.engine.backend import get_backend
    lib = OpLibrary(get_backend("numpy"))
    for name in ("relu_forward_f32", "relu_backward_bf16"):
        g = lib.op("relu").kernels[name].geometry
        assert (g.threads, g.unroll) == planner.POINTWISE_LIGHT_TILE
    g = lib.op("silu").kernels["silu_forward_bf16"].geometry
    assert (g.threads, g.unroll) == (128, 8)
