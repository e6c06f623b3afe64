"""runtime/engine/attention.py's attention_decode end to end without a GPU: the generated decode
kernels compiled by g++ over tests/attention_emulator/ (see test_attention_runtime_emulated.py,
whose stand-in cupy and kernel library this reuses), against the generated numpy decode.
Covers the split-K merge (many splits, and one), GQA rows, prefill chunks, rows that see no
key, and that cache rows past pos0+Tq are never read (they hold NaN)."""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from eulergen.generator.plan_attention import TilePlan, plan_tiles
from eulergen.runtime.engine.bf16 import from_bf16, to_bf16

import test_attention_runtime_emulated as emu
from test_attention_runtime_emulated import FakeArray

pytestmark = emu.pytestmark


@pytest.fixture(scope="module")
def decode(monkeypatch_module):
    cupy = emu._fake_cupy()
    cupy.zeros = lambda shape, dtype: np.zeros(shape, dtype).view(FakeArray)
    monkeypatch_module.setitem(sys.modules, "cupy", cupy)
    from eulergen.runtime.engine import attention
    built = {}

    def run(name, q, k_cache, v_cache, pos0, *, sms, out=None, rows=None, **params):
        """`rows`: a decode plan with that many rows a block instead of the planner's."""
        if (name, rows) not in built:
            tiles = None if rows is None else {
                cfg: TilePlan(**{**plan_tiles(*cfg).__dict__, "dec_rows": rows})
                for cfg in emu.CONFIGS}
            rendered, derived, lib, mod = emu._library(
                name, Path(tempfile.mkdtemp(prefix="eg-attn-dec-")), tiles=tiles,
                roles=("decode",))
            sigs = {k.name: k for k in rendered.kernels}
            ak = attention.AttentionKernels(
                name, rendered.kernels,
                {p.name: p.default for p in derived.params},
                lambda kernel, sigs=sigs, lib=lib: emu.FakeKernel(lib, sigs[kernel]))
            built[name, rows] = ak, mod
        ak, mod = built[name, rows]
        monkeypatch_module.setattr(attention, "sm_count", lambda: sms)
        return attention.attention_decode(ak, q, k_cache, v_cache, pos0, out=out, **params), mod
    return run


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _device(x, dtype):
    """(device array, what the kernel reads as float64): bf16 rounds the inputs."""
    if dtype == "bf16":
        dev = to_bf16(x).view(FakeArray)
        return dev, from_bf16(np.asarray(dev)).astype(np.float64)
    dev = x.astype(np.float32).view(FakeArray)
    return dev, dev.astype(np.float64)


def _case(B, Tq, H, KVH, D, tmax, n, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Tq, H, D)).astype(np.float32)
    kv = rng.standard_normal((2, B, tmax, KVH, D)).astype(np.float32)
    kv[:, :, n:] = np.nan   # past the valid rows: must never be read
    return q, kv[0], kv[1]


# (pos0, Tq, SMs): SMs sets how far the cache is split (1 SM: as few splits as fill 4 blocks;
# 512: every tile a split of its own, with 9 rows rather than 37: the emulator's time).
CASES = [(0, 1, 1), (69, 1, 1), (69, 1, 64), (130, 1, 64), (5, 9, 1), (100, 37, 8), (130, 9, 512)]


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("pos0, tq, sms", CASES)
def test_decode_kernel_matches_numpy_decode(decode, dtype, pos0, tq, sms):
    B, H, KVH, D, tmax = 2, 6, 2, 64, 160
    q, k, v = _case(B, tq, H, KVH, D, tmax, pos0 + tq, seed=pos0 + tq)
    (qd, q64), (kd, k64), (vd, v64) = (_device(x, dtype) for x in (q, k, v))
    o, mod = decode("causal_attention", qd, kd, vd, pos0, sms=sms)
    ours = from_bf16(np.asarray(o)) if dtype == "bf16" else np.asarray(o)
    ref = mod.decode(q64, k64, v64, pos0)
    assert np.all(np.isfinite(ours))
    err = np.max(np.abs(ours - ref))
    # fp32: fp32 sums of ≤ 167 products; bf16: the output's rounding (2^-8 relative, |o| < 3)
    assert err < {"f32": 2e-5, "bf16": 1.6e-2}[dtype], f"{dtype} pos0={pos0} tq={tq}: {err:.2e}"


@pytest.mark.parametrize("sms", [1, 64])
def test_decode_kernel_row_that_sees_no_key_is_zero(decode, sms):
    B, tq, H, KVH, D, tmax = 1, 3, 2, 2, 64, 100
    q, k, v = _case(B, tq, H, KVH, D, tmax, tq, seed=9)
    (qd, q64), (kd, k64), (vd, v64) = (_device(x, "f32") for x in (q, k, v))
    o, mod = decode("strict_attention", qd, kd, vd, 0, sms=sms)   # mask j < i
    assert np.all(np.asarray(o)[:, 0] == 0.0)
    assert np.max(np.abs(np.asarray(o) - mod.decode(q64, k64, v64, 0))) < 2e-5


def test_decode_kernel_writes_a_strided_out_and_takes_params(decode):
    B, tq, H, KVH, D, tmax = 1, 1, 4, 4, 64, 300
    q, k, v = _case(B, tq, H, KVH, D, tmax, 260, seed=4)
    q *= 8.0   # large logits, so the cap matters
    (qd, q64), (kd, k64), (vd, v64) = (_device(x, "f32") for x in (q, k, v))
    buf = np.zeros((B, tq, H, 2 * D), np.float32).view(FakeArray)
    out = buf[..., D:]
    got, mod = decode("softcap_attention", qd, kd, vd, 259, sms=64, out=out, cap=3.0)
    assert got is out and np.all(buf[..., :D] == 0.0)
    assert np.max(np.abs(np.asarray(out) - mod.decode(q64, k64, v64, 259, cap=3.0))) < 2e-5


@pytest.mark.parametrize("rows", [2, 4])
@pytest.mark.parametrize("pos0, tq, sms", [(69, 1, 64), (130, 9, 512)])
def test_decode_plans_with_more_rows_a_block_match_numpy(decode, rows, pos0, tq, sms):
    """Blocks of 2 or 4 rows (the planner gives 1): a GQA group of 3 spans two blocks of 2,
    or sits in one block of 4 with a row to spare."""
    B, H, KVH, D, tmax = 2, 6, 2, 64, 160
    q, k, v = _case(B, tq, H, KVH, D, tmax, pos0 + tq, seed=rows)
    (qd, q64), (kd, k64), (vd, v64) = (_device(x, "f32") for x in (q, k, v))
    o, mod = decode("causal_attention", qd, kd, vd, pos0, sms=sms, rows=rows)
    assert np.max(np.abs(np.asarray(o) - mod.decode(q64, k64, v64, pos0))) < 2e-5


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("pos0, tq, sms", [(0, 1, 1), (69, 1, 64), (5, 9, 1), (130, 9, 512)])
def test_decode_kernel_reads_new_rows_and_writes_them_into_the_cache(decode, dtype, pos0, tq,
                                                                      sms):
    """`new=(k, v)`: the step's keys and values as strided views of one qkv-like buffer; the
    cache holds NaN from pos0 on, so a block that read a new row from the cache would show."""
    B, H, KVH, D, tmax = 2, 6, 2, 64, 160
    q, k, v = _case(B, tq, H, KVH, D, tmax, pos0 + tq, seed=pos0 + 3 * tq)
    qkv = np.zeros((B, tq, 3, KVH, D), np.float32)
    qkv[:, :, 1], qkv[:, :, 2] = k[:, pos0:pos0 + tq], v[:, pos0:pos0 + tq]
    (qd, q64), (kd, k64), (vd, v64), (nd, _) = (_device(x, dtype) for x in (q, k, v, qkv))
    nan = to_bf16(np.full(1, np.nan, np.float32))[0] if dtype == "bf16" else np.float32(np.nan)
    kd[:, pos0:] = vd[:, pos0:] = nan
    o, mod = decode("causal_attention", qd, kd, vd, pos0, sms=sms, new=(nd[:, :, 1], nd[:, :, 2]))
    ours = from_bf16(np.asarray(o)) if dtype == "bf16" else np.asarray(o)
    err = np.max(np.abs(ours - mod.decode(q64, k64, v64, pos0)))
    assert err < {"f32": 2e-5, "bf16": 1.6e-2}[dtype], f"{dtype} pos0={pos0} tq={tq}: {err:.2e}"
    for cache, part in ((kd, 1), (vd, 2)):
        assert np.array_equal(np.asarray(cache)[:, pos0:pos0 + tq], np.asarray(nd)[:, :, part])
        past = np.asarray(cache)[:, pos0 + tq:]
        assert np.all(np.isnan(from_bf16(past) if dtype == "bf16" else past))
