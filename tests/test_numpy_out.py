"""The generated numpy modules write their results into the arrays `_out=` gives (the training
tape's planned buffers, so nothing is copied after), bit for bit what they return without
it, an input among them where the kernels allow that (a norm's stream, the cross-entropy's
dlogits over the logits, rope in place); an out of another shape is refused."""
from __future__ import annotations

import numpy as np
import pytest

from eulergen.runtime.engine.backend import NUMPY
from eulergen.runtime.engine.ops import OpLibrary
from eulergen.runtime.engine.registry import kind_of

RNG = np.random.default_rng(0)
LIB = OpLibrary(NUMPY)


def _f32(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


X, B, DY = _f32(2, 3, 8), _f32(8), _f32(2, 3, 8)
Q, K, V = _f32(2, 4, 2, 8), _f32(2, 4, 2, 8), _f32(2, 4, 2, 8)
TARGET = RNG.integers(0, 8, (2, 3)).astype(np.int32)

# (op, function, its arrays, the index of an input each result may be written over, or None)
CASES = [
    ("gelu", "backward_bias", (X, B, DY), (None, None)),
    ("swiglu", "forward", (X, DY), (0,)),
    ("layernorm", "forward_add", (X, DY, B, B), (0, None)),
    ("layernorm", "backward_add", (X, B, B, DY, DY), (4, None, None)),
    ("cross_entropy", "backward", (X, TARGET, np.full((2, 3), 0.5, np.float32)), (0,)),
    ("rope", "forward", (Q,), (0,)),
    ("causal_attention", "forward", (Q, K, V), (None, None)),
]


@pytest.mark.parametrize("op, name, arrays, over", CASES, ids=[f"{c[0]}.{c[1]}" for c in CASES])
def test_results_written_into_out_equal_the_returned_ones(op, name, arrays, over):
    function = getattr(_module(op), name)
    alone = function(*arrays)
    alone = alone if isinstance(alone, tuple) else (alone,)
    # a result written over an input: a copy of that input, handed in as the input too
    given = [np.array(arrays[k]) if k is not None else np.empty_like(r)
             for r, k in zip(alone, over)]
    inputs = [next((g for g, k in zip(given, over) if k == n), a) for n, a in enumerate(arrays)]
    got = function(*inputs, _out=tuple(given))
    got = got if isinstance(got, tuple) else (got,)
    for n, (r, g, o) in enumerate(zip(alone, got, given)):
        assert g is o, f"{op}.{name}: result {n} is not the out array"
        assert r.tobytes() == o.tobytes(), f"{op}.{name}: result {n} differs written into out"


def test_an_out_of_another_shape_is_refused():
    with pytest.raises(ValueError, match=r"out\[1\] has shape \(3,\), the result \(8,\)"):
        _module("gelu").backward_bias(X, B, DY, _out=(None, np.empty(3, np.float32)))


def _module(op):
    entry = LIB.op(op)
    return kind_of(entry).module(entry)
