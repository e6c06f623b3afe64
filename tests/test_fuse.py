"""Fused variants (generator/fuse.py) are made for every op of the right shape, a user's own
too, from its derived code: the add fusion of a norm is the op of x + branch, its backward
the op's with the stream's gradient added; the bias fusion of a pointwise op is the op of
x + b. Checked through the generated numpy modules against the op's own functions (float64:
only rounding separates them), and through the plans' kernels and the manifest."""
from __future__ import annotations

import numpy as np
import pytest

from eulergen.errors import EulerError
from eulergen.generator import fuse
from eulergen.generator.build import _fusions
from eulergen.generator.derive import derive
from eulergen.generator.numpy_module import load_module_from_source, render_numpy_module
from eulergen.generator.plan_ops import plan_op
from eulergen.generator.ops_path import find_ops
from eulergen.generator.spec import load_spec

# a user's norm: no weights beside a gain, a reduction over the row, a parameter
SCALENORM = """\
name: scalenorm
kind: row
doc: x scaled to unit RMS, times one learned gain per column
inputs: {x: row, g: weight}
params: {eps: 1.0e-6}
reduce:
  ss: sum(x**2)
outputs:
  y: g*x/sqrt(ss/N + eps)
"""
# a user's activation
SOFTSIGN = """\
name: softsign2
kind: pointwise
doc: x / (1 + |x|), written smooth
inputs: [x]
outputs:
  y: x/(1 + sqrt(x**2 + 1))
"""


def _derived(tmp_path, text):
    path = tmp_path / f"{text.split()[1]}.yaml"
    path.write_text(text)
    return derive(load_spec(path))


def _module(d):
    return load_module_from_source(d.name, render_numpy_module(d))


def test_a_user_norm_gets_the_add_fusion_the_op_of_the_sum_with_the_stream_gradient_added(tmp_path):
    d = _derived(tmp_path, SCALENORM)
    mod = _module(d)
    rng = np.random.default_rng(0)
    x, r, dy, dh = (rng.normal(size=(3, 5, 9)) for _ in range(4))
    g = rng.normal(size=9)
    h, y = mod.forward_add(x, r, g)
    np.testing.assert_allclose(h, x + r, rtol=1e-14)
    np.testing.assert_allclose(y, mod.forward(x + r, g), rtol=1e-13)
    dx, dg = mod.backward_add(h, g, dy, dh)
    want_dx, want_dg = mod.backward(h, g, dy)
    np.testing.assert_allclose(dx, want_dx + dh, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dg, want_dg, rtol=1e-12)
    kinds = {(s.stage, s.part, s.fusion) for s in plan_op(d).signatures}
    assert {("forward", "", "add"), ("backward", "", "add"), ("backward", "rows", "add")} <= kinds
    assert _fusions(d)["add"]["forward"]["inputs"][:2] == [
        {"name": "x", "role": "row", "differentiable": False},
        {"name": "_branch", "role": "row", "differentiable": False}]


def test_a_user_activation_gets_the_bias_fusion_the_op_of_x_plus_b(tmp_path):
    d = _derived(tmp_path, SOFTSIGN)
    mod = _module(d)
    rng = np.random.default_rng(1)
    x, dy = rng.normal(size=(2, 4, 7)), rng.normal(size=(2, 4, 7))
    b = rng.normal(size=7)
    np.testing.assert_allclose(mod.forward_bias(x, b), mod.forward(x + b), rtol=1e-14)
    dx, db = mod.backward_bias(x, b, dy)
    np.testing.assert_allclose(dx, mod.backward(x + b, dy), rtol=1e-14)
    np.testing.assert_allclose(db, dx.reshape(-1, 7).sum(0), rtol=1e-13)
    kernels = {s.name for s in plan_op(d).sigs}
    assert {"softsign2_forward_bias_bf16", "softsign2_backward_bias_unaligned_f32",
            "softsign2_reduce_bias_f32"} <= kernels
    assert [o["name"] for o in _fusions(d)["bias"]["backward"]["inputs"]] == ["x", "_bias_x"]


@pytest.mark.parametrize("name", ["cross_entropy", "rope", "adamw", "causal_attention"])
def test_ops_of_other_shapes_get_no_add_fusion(name):
    d = derive(load_spec(find_ops()[name]))
    assert fuse.add_variants(d) is None and "add" not in _fusions(d)


def test_an_operand_named_like_a_fused_one_is_refused_naming_the_spec(tmp_path):
    d = _derived(tmp_path, SOFTSIGN.replace("softsign2", "clash").replace(
        "inputs: [x]", "inputs: [x, d_bias_x]").replace("x/(1", "d_bias_x*x/(1"))
    with pytest.raises(EulerError, match="d_bias_x") as err:
        fuse.bias_variant(d)
    assert err.value.file.endswith("clash.yaml")
