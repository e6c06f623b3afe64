"""Row-invariant code motion (generator/hoist.py): what moves out of the per-element code,
and that the rewritten code computes the same values."""
from __future__ import annotations

import numpy as np
import pytest
import sympy as sp

from eulergen.generator import ir
from eulergen.generator.derive import derive
from eulergen.generator.hoist import hoist, row_constant_names
from eulergen.generator.printer import print_cuda
from eulergen.generator.ops_path import find_ops
from eulergen.generator.spec import load_spec

ROW_OPS = sorted(n for n, p in find_ops().items() if derive(load_spec(p)).kind == "row")


def _row_op(name: str) -> ir.DerivedOp:
    return derive(load_spec(find_ops()[name]))


def _varying(op: ir.DerivedOp) -> set[str]:
    names = {o.name for o in op.inputs if o.role in ("row", "weight")}
    names |= {f"d{o.name}" for o in op.outputs if o.role == "row"}
    return names | {"i"}


def _element_codes(op: ir.DerivedOp) -> list[list[ir.Code]]:
    """Each per-element step's codes, as render.py hoists them (outputs first where read)."""
    body: ir.RowDerived = op.body
    steps = [[p.body] for p in body.passes] + [[body.elem_outputs], [body.elem_grads]]
    if body.adjoint_pass:
        steps.append([body.elem_outputs, body.adjoint_pass.body])
    return steps


def _evaluate(codes: list[ir.Code], values: dict) -> dict:
    env = dict(values)
    for code in codes:
        for a in code.temps + code.results:
            env[a.name] = float(a.expr.subs({s: env[s.name] for s in a.expr.free_symbols}))
    return env


def test_a_softmax_division_by_the_row_sum_becomes_one_reciprocal_per_row():
    op = _row_op("softmax")
    consts, (code,) = hoist([op.body.elem_outputs], _varying(op), row_constant_names())
    assert print_cuda(consts) == ["const float r0_ = 1.0f/z;"]
    assert print_cuda(code) == ["const float y = r0_*expf(x - m);"]


def test_layernorm_takes_its_rsqrt_once_per_row():
    op = _row_op("layernorm")
    consts, (code,) = hoist([op.body.elem_outputs], _varying(op), row_constant_names())
    assert any("rsqrtf" in line for line in print_cuda(consts))
    assert not any("rsqrtf" in line for line in print_cuda(code)), print_cuda(code)


@pytest.mark.parametrize("name", ROW_OPS)
def test_hoisted_code_computes_what_the_element_code_computed(name):
    """Every per-element step of every row op, at random element and row values: the row
    constants plus the rewritten code give the original results (to float64 rounding)."""
    op = _row_op(name)
    rng = np.random.default_rng(0)
    for codes in _element_codes(op):
        consts, hoisted = hoist(codes, _varying(op), row_constant_names())
        free = set()
        for code in codes:
            for a in code.temps + code.results:
                free |= {s.name for s in a.expr.free_symbols}
        values = {n: float(rng.uniform(0.5, 1.5)) for n in free}
        values["i"] = values["target"] = 3.0     # an index equal to the element's
        want = _evaluate(codes, values)
        got = _evaluate([consts] + hoisted, values)
        for code in codes:
            for a in code.results:
                assert got[a.name] == pytest.approx(want[a.name], rel=1e-12, abs=1e-12), \
                    f"{name}: {a.name}"


def test_an_element_code_with_nothing_row_invariant_is_left_alone():
    x, w = sp.Symbol("x", real=True), sp.Symbol("w", real=True)
    code = ir.Code((), (ir.Assign("y", x * w + x),))
    consts, (same,) = hoist([code], {"x", "w"}, row_constant_names())
    assert consts.results == () and same == code
