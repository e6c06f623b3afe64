"""generator/numpy_cse.py: a subexpression the printed numpy evaluates more than once on the
same values is computed once, and the lines give the same bits."""
from __future__ import annotations

import numpy as np

from eulergen.generator.numpy_cse import shared

GELU_BIAS_BACKWARD = [   # as the printer writes the bias fusion's backward
    "t0 = np.tanh(0.7978845608028654*(_bias_x + x + 0.044715*(_bias_x + x)**2*(_bias_x + x)))",
    "dx = dy*(0.5*t0 + 0.3989422804014327*(1.0 - t0*t0)*(0.134145*(_bias_x + x)**2 + 1.0)"
    "*(_bias_x + x) + 0.5)"]


def _run(lines, **values):
    exec("\n".join(lines), {"np": np}, values)
    return values


def test_a_repeated_sum_and_its_square_are_computed_once_with_the_same_bits():
    got = shared(GELU_BIAS_BACKWARD)
    assert got[:2] == ["_c0 = _bias_x + x", "_c1 = _c0**2"]
    assert all("_bias_x + x" not in line for line in got[2:]), got
    rng = np.random.default_rng(0)
    values = dict(x=rng.standard_normal((64, 32)).astype(np.float32),
                  _bias_x=rng.standard_normal(32).astype(np.float32),
                  dy=rng.standard_normal((64, 32)).astype(np.float32))
    assert _run(got, **values)["dx"].tobytes() == _run(GELU_BIAS_BACKWARD, **values)["dx"].tobytes()


def test_a_name_bound_again_in_between_is_not_shared():
    lines = ["a = np.exp(m - x)", "m = m + 1.0", "b = np.exp(m - x)"]
    assert shared(lines) == lines


def test_a_call_keeps_its_parentheses():
    assert shared(["a = np.sqrt(x + y)*np.sqrt(x + y)"]) == ["_c0 = np.sqrt(x + y)", "a = _c0*_c0"]
