"""Attention over a KV cache (`decode`): the generated numpy module and OpLibrary.decode on
the numpy backend. Decoding Tq new queries at positions pos0 … pos0+Tq-1 must give rows
pos0 … of the full forward over the whole sequence, and never read a cache row past
pos0+Tq-1 (those rows are NaN here, so a read shows up as NaN in o)."""
from __future__ import annotations

import types

import numpy as np
import pytest

from eulergen.errors import EulerError
from eulergen.generator.numpy_attention import render_attention_module
from eulergen.runtime.engine.backend import get_backend
from eulergen.runtime.engine.ops import OpLibrary

import attention_ops

SPECS = attention_ops.SHIPPED + tuple(attention_ops.TEST_SPECS)


def _module(name: str, tmp_path) -> types.ModuleType:
    text = render_attention_module(attention_ops.load(name, tmp_path))
    mod = types.ModuleType(name)
    exec(compile(text, f"{name}.py", "exec"), mod.__dict__)
    return mod


def _sequence(B, T, H, KVH, D, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, T, H, D)).astype(dtype),
            rng.standard_normal((B, T, KVH, D)).astype(dtype),
            rng.standard_normal((B, T, KVH, D)).astype(dtype))


def _cache(x, tmax):
    """x [B, T, KVH, D] in the first T rows of a [B, tmax, KVH, D] cache of NaN."""
    cache = np.full((x.shape[0], tmax) + x.shape[2:], np.nan, x.dtype)
    cache[:, :x.shape[1]] = x
    return cache


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("pos0, tq", [(0, 1), (0, 9), (1, 1), (5, 4), (23, 1), (16, 8)])
def test_numpy_decode_equals_rows_of_forward(name, pos0, tq, tmp_path):
    mod = _module(name, tmp_path)
    B, H, KVH, D = 2, 6, 2, 16
    n = pos0 + tq
    q, k, v = _sequence(B, n, H, KVH, D, seed=pos0 * 31 + tq)
    ref, _ = mod.forward(q, k, v)
    o = mod.decode(q[:, pos0:], _cache(k, 40), _cache(v, 40), pos0)
    assert o.shape == (B, tq, H, D)
    err = np.max(np.abs(o - ref[:, pos0:]))
    assert err < 1e-12, f"{name} pos0={pos0} tq={tq}: {err:.2e}"


def test_numpy_decode_of_a_row_that_sees_no_key_is_zero(tmp_path):
    mod = _module("strict_attention", tmp_path)   # mask j < i: position 0 sees nothing
    q, k, v = _sequence(1, 3, 2, 1, 8)
    o = mod.decode(q, _cache(k, 8), _cache(v, 8), 0)
    assert np.all(o[:, 0] == 0.0) and np.all(np.isfinite(o))
    assert np.any(o[:, 1] != 0.0)


def test_numpy_decode_keeps_float32(tmp_path):
    mod = _module("causal_attention", tmp_path)
    q, k, v = _sequence(1, 12, 4, 4, 16, dtype=np.float32)
    ref, _ = mod.forward(q, k, v)
    o = mod.decode(q[:, 11:], _cache(k, 16), _cache(v, 16), 11)
    assert o.dtype == np.float32
    assert np.max(np.abs(o - ref[:, 11:])) < 1e-5   # float32 rounding of the same sums


@pytest.fixture(scope="module")
def lib():
    return OpLibrary(get_backend("numpy"))


@pytest.mark.parametrize("name", ["causal_attention", "softcap_attention", "alibi_attention"])
def test_library_decode_step_by_step_equals_forward(lib, name):
    """Prefill 5 tokens, then decode one at a time: every row matches the full forward."""
    B, T, H, KVH, D = 2, 13, 4, 2, 8
    q, k, v = _sequence(B, T, H, KVH, D, seed=3)
    ref = lib.forward(name, q, k, v)[0]
    kc, vc = _cache(k, 16), _cache(v, 16)
    got = [lib.decode(name, q[:, :5], kc, vc, 0)]
    for t in range(5, T):
        got.append(lib.decode(name, q[:, t:t + 1], kc, vc, t))
    assert np.max(np.abs(np.concatenate(got, axis=1) - ref)) < 1e-12


def test_library_decode_writes_out_and_takes_params(lib):
    q, k, v = _sequence(1, 6, 2, 2, 8, seed=4)
    q = q * 40.0   # large logits, so the cap changes the result
    out = np.empty((1, 1, 2, 8))
    got = lib.decode("softcap_attention", q[:, 5:], k, v, 5, out=out, cap=5.0)
    assert got is out
    ref = lib.forward("softcap_attention", q, k, v, cap=5.0)[0][:, 5:]
    assert np.max(np.abs(out - ref)) < 1e-12
    assert np.max(np.abs(out - lib.decode("softcap_attention", q[:, 5:], k, v, 5))) > 1e-3


@pytest.mark.parametrize("pos0, tq, match", [(-1, 1, "pos0"), (6, 1, "pos0"), (4, 3, "pos0")])
def test_library_decode_refuses_positions_past_the_cache(lib, pos0, tq, match):
    q, k, v = _sequence(1, 6, 2, 2, 8)
    with pytest.raises(EulerError, match=match):
        lib.decode("causal_attention", q[:, :tq], k, v, pos0)


def test_library_decode_refuses_mismatched_caches(lib):
    q, k, v = _sequence(1, 6, 4, 2, 8)
    with pytest.raises(EulerError, match="v_cache: shape"):
        lib.decode("causal_attention", q[:, :1], k, v[:, :5], 0)
    with pytest.raises(EulerError, match="do not divide"):
        lib.decode("causal_attention", q[:, :1, :3], k, v, 0)
    with pytest.raises(EulerError, match="4-d"):
        lib.decode("causal_attention", q[0], k, v, 0)


def test_library_decode_is_for_attention_ops(lib):
    x = np.zeros((1, 1, 2, 8))
    with pytest.raises(EulerError, match="'gelu' is a pointwise op: it has no decode"):
        lib.decode("gelu", x, x, x, 0)
