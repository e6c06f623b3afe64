"""The generated decode kernels (attention over a KV cache) on the GPU, through
OpLibrary.decode: against the numpy decode on the very inputs the kernel saw (float64, from
the bf16-rounded values for bf16) and against rows of the CUDA flash forward over the whole
sequence. Cache rows past pos0+Tq hold NaN, so a read of one shows up in o.

Run on the H200: python -m pytest -m gpu tests/gpu/test_attention_decode.py -x -q
fp32 computes in fp32 FMA: within 1e-5 of max |o|. bf16: the inputs are exact, so the only
error is o's own rounding (2^-9 relative) on top of fp32 sums: within 2^-8 per element.
"""
from __future__ import annotations

import functools
import sys
import tempfile
from pathlib import Path

import jinja2
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import attention_ops  # noqa: E402

from eulergen import TEMPLATES_DIR  # noqa: E402
from eulergen.errors import EulerError  # noqa: E402
from eulergen.generator.plan_attention import TilePlan, plan_attention, plan_tiles  # noqa: E402
from eulergen.generator.render_attention import render_attention  # noqa: E402
from eulergen.runtime.engine.attention import AttentionKernels, attention_decode  # noqa: E402
from eulergen.runtime.engine.compile import compile_file  # noqa: E402
from eulergen.runtime.engine.bf16 import from_bf16, to_bf16  # noqa: E402

pytestmark = pytest.mark.gpu


def _inputs(B, Tq, H, KVH, D, tmax, n, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Tq, H, D)).astype(np.float32)
    kv = rng.standard_normal((2, B, tmax, KVH, D)).astype(np.float32)
    kv[:, :, n:] = np.nan
    return q, kv[0], kv[1]


def _device(cp, a, dtype):
    """(device array in the storage dtype, the float64 values it holds)."""
    if dtype == "bf16":
        bits = to_bf16(a)
        return cp.asarray(bits), from_bf16(bits).astype(np.float64)
    return cp.asarray(a), a.astype(np.float64)


def _host(cp, a, dtype):
    a = cp.asnumpy(a)
    return (from_bf16(a) if dtype == "bf16" else a).astype(np.float64)


def _check(ours, ref, dtype, what):
    assert np.all(np.isfinite(ours)), f"{what}: non-finite output"
    err = np.abs(ours - ref)
    if dtype == "f32":
        rel = err.max() / np.abs(ref).max()
        assert rel < 1e-5, f"{what}: {rel:.2e} of max |o|"
    else:
        bad = err > 2.0 ** -8 * np.abs(ref) + 1e-6
        assert not bad.any(), f"{what}: {bad.sum()} elements past bf16 rounding, max {err.max():.2e}"


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("B, KVH", [(1, 12), (3, 4)])
@pytest.mark.parametrize("tq", [1, 37])
@pytest.mark.parametrize("pos0", [0, 1, 500, 1023])
def test_decode_matches_numpy_decode(libs, cp, dtype, D, B, KVH, tq, pos0):
    gpu, cpu = libs
    H, n = 12, pos0 + tq
    q, k, v = _inputs(B, tq, H, KVH, D, n + 13, n, seed=pos0 + tq + D)
    (qd, q64), (kd, k64), (vd, v64) = (_device(cp, a, dtype) for a in (q, k, v))
    o = gpu.decode("causal_attention", qd, kd, vd, pos0)
    ref = cpu.decode("causal_attention", q64, k64, v64, pos0)
    _check(_host(cp, o, dtype), ref, dtype, f"B={B} KVH={KVH} tq={tq} pos0={pos0}")


@pytest.mark.parametrize("name", ["softcap_attention", "alibi_attention"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("pos0, tq", [(0, 37), (700, 1)])
def test_decode_of_score_specs_matches_numpy_decode(libs, cp, name, dtype, pos0, tq):
    gpu, cpu = libs
    B, H, KVH, D, n = 2, 12, 4, 64, pos0 + tq
    q, k, v = _inputs(B, tq, H, KVH, D, n + 5, n, seed=11)
    q *= 6.0   # logits large enough for the softcap to bend them
    params = {"cap": 8.0} if name == "softcap_attention" else {}
    (qd, q64), (kd, k64), (vd, v64) = (_device(cp, a, dtype) for a in (q, k, v))
    o = gpu.decode(name, qd, kd, vd, pos0, **params)
    ref = cpu.decode(name, q64, k64, v64, pos0, **params)
    _check(_host(cp, o, dtype), ref, dtype, f"{name} tq={tq} pos0={pos0}")


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("D", [64, 128])
def test_decode_equals_rows_of_the_cuda_forward(libs, cp, dtype, D):
    """Prefill 37 tokens, then decode token by token: the rows of the flash forward over the
    whole 300 tokens (fp32 flash is split-bf16, ~1e-5 relative; bf16 flash rounds P)."""
    gpu, _ = libs
    B, T, H, KVH = 2, 300, 12, 4
    q, k, v = _inputs(B, T, H, KVH, D, T, T, seed=D)
    (qd, _), (kd, _), (vd, _) = (_device(cp, a, dtype) for a in (q, k, v))
    full = _host(cp, gpu.forward("causal_attention", qd, kd, vd)[0], dtype)
    o = cp.empty_like(qd)
    gpu.decode("causal_attention", qd[:, :37], kd, vd, 0, out=o[:, :37])
    for t in range(37, T):
        gpu.decode("causal_attention", qd[:, t:t + 1], kd, vd, t, out=o[:, t:t + 1])
    err = np.abs(_host(cp, o, dtype) - full).max() / np.abs(full).max()
    assert err < {"f32": 1e-4, "bf16": 2e-2}[dtype], f"{err:.2e}"


# Plans other than the planner's (rows a block, key tile), so that the defaults can follow
# benchmarks/attention.py --decode-sweep: each is checked here as the default is above.
VARIANTS = ((("dec_rows", 4),), (("dec_rows", 2),), (("dec_tile", 128),),
            (("dec_rows", 1), ("dec_tile", 128)), (("dec_rows", 2), ("dec_tile", 32)))


@functools.lru_cache(maxsize=None)
def _variant(change: tuple) -> AttentionKernels:
    """causal_attention's decode kernels alone, every (D, dtype), with `change` to the plan."""
    folder = Path(tempfile.mkdtemp(prefix="eg-decode-"))
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES_DIR)))
    (folder / "eulergen_common.cuh").write_text(
        env.get_template("common.cuh.j2").render(header="prelude for the decode tests"))
    tiles = {(d, dt): TilePlan(**{**plan_tiles(d, dt).__dict__, **dict(change)})
             for d in (64, 128) for dt in ("f32", "bf16")}
    derived = attention_ops.load("causal_attention")
    rendered = render_attention(derived, plan_attention(derived, tiles=tiles, roles=("decode",)))
    (folder / "causal_attention.cu").write_text(rendered.source)
    return AttentionKernels("causal_attention", rendered.kernels,
                            {}, compile_file(folder / "causal_attention.cu").function)


@pytest.mark.parametrize("change", VARIANTS, ids=lambda c: "-".join(f"{k}{v}" for k, v in c))
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("B, KVH, tq, pos0", [(1, 12, 1, 1023), (3, 4, 1, 500), (3, 4, 37, 500),
                                              (16, 12, 1, 1023)])
def test_decode_plan_variants_match_numpy(libs, cp, change, dtype, D, B, KVH, tq, pos0):
    _, cpu = libs
    H, n = 12, pos0 + tq
    q, k, v = _inputs(B, tq, H, KVH, D, n + 3, n, seed=B + tq + D)
    (qd, q64), (kd, k64), (vd, v64) = (_device(cp, a, dtype) for a in (q, k, v))
    o = attention_decode(_variant(change), qd, kd, vd, pos0)
    ref = cpu.decode("causal_attention", q64, k64, v64, pos0)
    _check(_host(cp, o, dtype), ref, dtype, f"{dict(change)} B={B} KVH={KVH} tq={tq}")


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("B, KVH, tq, pos0", [(1, 12, 1, 0), (1, 4, 1, 1023), (3, 4, 37, 500),
                                              (16, 12, 1, 700)])
def test_decode_with_new_rows_equals_the_filled_cache_and_writes_it(libs, cp, dtype, D, B, KVH,
                                                                     tq, pos0):
    """new=(k, v), strided views of one qkv-like buffer, over a cache that holds NaN from pos0
    on: o bit for bit the decode of the cache that already holds them, and those rows written."""
    gpu, _ = libs
    H, n = 12, pos0 + tq
    q, k, v = _inputs(B, tq, H, KVH, D, n + 3, n, seed=pos0 + D)
    (qd, _), (kd, _), (vd, _) = (_device(cp, a, dtype) for a in (q, k, v))
    want = gpu.decode("causal_attention", qd, kd, vd, pos0)
    qkv = cp.zeros((B, tq, 3, KVH, D), kd.dtype)
    qkv[:, :, 1], qkv[:, :, 2] = kd[:, pos0:n], vd[:, pos0:n]
    kc, vc = kd.copy(), vd.copy()
    kc[:, pos0:], vc[:, pos0:] = kd[:, -1:], vd[:, -1:]   # NaN: rows past n are
    got = gpu.decode("causal_attention", qd, kc, vc, pos0, new=(qkv[:, :, 1], qkv[:, :, 2]))
    assert cp.array_equal(got, want)
    for cache, full in ((kc, kd), (vc, vd)):
        assert cp.array_equal(cache[:, :n], full[:, :n])
        assert np.isnan(_host(cp, cache[:, n:], dtype)).all()


def test_decode_is_deterministic(libs, cp):
    """The split-K merge runs in split order whichever block finishes last."""
    gpu, _ = libs
    q, k, v = _inputs(16, 1, 12, 4, 64, 1024, 1024, seed=3)
    qd, kd, vd = (cp.asarray(a) for a in (q, k, v))
    first = gpu.decode("causal_attention", qd, kd, vd, 1023)
    for _ in range(5):
        assert cp.array_equal(gpu.decode("causal_attention", qd, kd, vd, 1023), first)


def test_decode_row_that_sees_no_key_is_zero(cp, tmp_path):
    """strict attention (j < i): position 0 sees nothing, so o = 0, as in the forward."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES_DIR)))
    (tmp_path / "eulergen_common.cuh").write_text(
        env.get_template("common.cuh.j2").render(header="prelude for the decode test"))
    derived = attention_ops.load("strict_attention", tmp_path)
    rendered = render_attention(derived, plan_attention(derived, configs=((64, "f32"),)))
    (tmp_path / "strict_attention.cu").write_text(rendered.source)
    ak = AttentionKernels("strict_attention", rendered.kernels,
                          {}, compile_file(tmp_path / "strict_attention.cu").function)
    q, k, v = _inputs(2, 5, 4, 2, 64, 8, 5, seed=1)
    o = cp.asnumpy(attention_decode(ak, *(cp.asarray(a) for a in (q, k, v)), 0))
    assert np.all(o[:, 0] == 0.0) and np.all(np.isfinite(o)) and np.any(o[:, 1] != 0.0)


def test_decode_refuses_bad_input_before_launch(libs, cp):
    gpu, _ = libs
    q = cp.zeros((1, 1, 12, 64), cp.float32)
    kc = cp.zeros((1, 16, 4, 64), cp.float32)
    with pytest.raises(EulerError, match="pos0"):
        gpu.decode("causal_attention", q, kc, kc, 16)
    with pytest.raises(EulerError, match="dtype"):
        gpu.decode("causal_attention", q, kc.astype(cp.uint16), kc.astype(cp.uint16), 3)
    with pytest.raises(EulerError, match="head dim 32"):
        small = cp.zeros((1, 1, 12, 32), cp.float32)
        gpu.decode("causal_attention", small, kc[..., :32], kc[..., :32], 3)
    wide = cp.zeros((1, 16, 4, 66), cp.float32)[..., 1:65]   # base 4 bytes in: misaligned
    with pytest.raises(EulerError, match="16 bytes"):
        gpu.decode("causal_attention", q, wide, wide, 3)
