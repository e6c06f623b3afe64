"""The generated kernels launched raw, with the grids their manifest geometry gives
(eulergen/launch.py), without the runtime in between: the fused cross-entropy in place over a 50257-wide row, the
embedding gather and its deterministic scatter, the stable math helpers at ±1e4.
Run on the H200: `pytest -m gpu tests/gpu/test_cudagen_raw.py`.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from eulergen import GENERATED_DIR, launch
from eulergen.runtime.engine.bf16 import from_bf16, to_bf16  # bf16 lives in uint16 arrays (bits)

pytestmark = pytest.mark.gpu

MANIFEST = GENERATED_DIR / "manifest.json"
OPS = json.loads(MANIFEST.read_text())["ops"] if MANIFEST.exists() else {}


def source(op: str) -> str:
    common = (GENERATED_DIR / "cuda" / "eulergen_common.cuh").read_text()
    text = (GENERATED_DIR / OPS[op]["cuda"]).read_text()
    return text.replace('#include "eulergen_common.cuh"', common, 1)


_MODULES: dict = {}


def kernel(cp, op: str, name: str):
    if op not in _MODULES:
        _MODULES[op] = cp.RawModule(code=source(op), options=("-std=c++17",))
    return _MODULES[op].get_function(name)


def geometry(op: str, name: str):
    return launch.from_json(OPS[op]["kernels"][name]["geometry"])


def numpy_module(op: str):
    from eulergen.runtime.engine.manifest import load_manifest, load_numpy_module
    return load_numpy_module(load_manifest(MANIFEST).ops[op])


def store(cp, x: np.ndarray, dtype: str):
    return cp.asarray(to_bf16(x) if dtype == "bf16" else x.astype(np.float32))


def load(cp, a, dtype: str) -> np.ndarray:
    h = cp.asnumpy(a)
    return from_bf16(h) if dtype == "bf16" else h


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


TOL = {"f32": 1e-5, "bf16": 2e-2}


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("layout", ["", "_block"])
def test_fused_cross_entropy_overwrites_50257_wide_logits_with_their_gradient(cp, layout, dtype):
    op, rows, cols = "cross_entropy", 64, 50257
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((rows, cols)) * 3).astype(np.float32)
    if dtype == "bf16":
        x = from_bf16(to_bf16(x))
    target = rng.integers(0, cols, rows).astype(np.int32)
    dloss = np.full(rows, 1.0 / rows, np.float32)
    # The `_unaligned` kernel. The runtime launches the aligned one here (one row operand, so
    # one offset: any row length); test_kernels.py's fused test takes it at 50257 columns.
    name = f"{op}_fwdbwd{layout}_unaligned_{dtype}"
    at = geometry(op, name).launch(rows, cols)
    logits = store(cp, x, dtype)
    loss = cp.full(rows, np.nan, np.float32)
    kernel(cp, op, name)(at.grid, at.block, (logits, cp.asarray(target), cp.asarray(dloss), loss,
                                               logits, np.int64(rows), np.int32(cols)))
    mod = numpy_module(op)
    want_loss = mod.forward(x.astype(np.float64), target)
    want_dx = mod.backward(x.astype(np.float64), target, dloss.astype(np.float64))
    assert rel_err(cp.asnumpy(loss), want_loss) < 1e-5
    assert rel_err(load(cp, logits, dtype), want_dx) < TOL[dtype]


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("C,with_wpe", [(768, True), (768, False), (50, True)])
def test_embedding_forward_gathers_and_backward_scatters_deterministically(cp, C, with_wpe, dtype):
    rng = np.random.default_rng(C)
    B, T, V = 4, 1280, 300                           # 5120 ids: three sort tiles
    ids = rng.integers(0, V - 20, (B, T)).astype(np.int32)   # the last 20 ids are absent
    ids[0, :300] = 7                                  # a long run: the second kernel's
    wte = rng.standard_normal((V, C)).astype(np.float32)
    wpe = rng.standard_normal((T, C)).astype(np.float32)
    if dtype == "bf16":
        wte, wpe = from_bf16(to_bf16(wte)), from_bf16(to_bf16(wpe))
    d_wte, d_wpe = store(cp, wte, dtype), store(cp, wpe, dtype)
    out = store(cp, np.full((B, T, C), np.nan, np.float32), dtype)
    at = geometry("embedding", f"embedding_forward_{dtype}").launch(B * T)   # a warp a row
    kernel(cp, "embedding", f"embedding_forward_{dtype}")(
        at.grid, at.block, (cp.asarray(ids), d_wte, d_wpe if with_wpe else np.uint64(0), out,
                                   np.int64(B * T), np.int32(T), np.int32(C), np.int32(V)))
    want = wte[ids] + (wpe[None] if with_wpe else 0)
    assert rel_err(load(cp, out, dtype), want) < TOL[dtype] / 4

    dout = rng.standard_normal((B, T, C)).astype(np.float32)
    if dtype == "bf16":
        dout = from_bf16(to_bf16(dout))
    n = ids.size
    tiled, keys = cp.empty(n, cp.int64), cp.empty(n, cp.int64)
    first = cp.full(V, -1, cp.int32)
    long = geometry("embedding", f"embedding_backward_wte_long_{dtype}")
    runs = cp.full(1 + n // (long.long_run + 1), -1, cp.int32)
    at = geometry("embedding", f"embedding_backward_sort_{dtype}").launch(n)
    kernel(cp, "embedding", f"embedding_backward_sort_{dtype}")(
        at.grid, at.block, (cp.asarray(ids), tiled, first, runs, np.int32(n), np.int32(V)))
    at = geometry("embedding", f"embedding_backward_merge_{dtype}").launch(n)
    kernel(cp, "embedding", f"embedding_backward_merge_{dtype}")(
        at.grid, at.block, (tiled, keys, first, np.int32(n)))
    flat = ids.reshape(-1)
    want_keys = np.sort((flat.astype(np.int64) << 32) | np.arange(n))
    assert (cp.asnumpy(keys) == want_keys).all(), "sorted keys"
    present, rank = np.unique(want_keys >> 32, return_index=True)
    want_first = np.zeros(V, np.int32)
    want_first[present] = n - rank
    assert (cp.asnumpy(first) == want_first).all(), "first-key ranks"
    grads = []
    for _ in range(2):
        dwte = store(cp, np.ones((V, C), np.float32), dtype)   # accumulate: added into
        wte = geometry("embedding", f"embedding_backward_wte_{dtype}")
        vec = C % wte.vec == 0
        d_dout = store(cp, dout, dtype)
        runs[0] = 0                                   # as the sort leaves it
        at = wte.launch(V, C, vec)
        kernel(cp, "embedding", f"embedding_backward_wte_{dtype}")(
            at.grid, at.block, (d_dout, keys, first, runs, dwte, np.int32(n), np.int32(V),
                                np.int32(C), np.int32(vec), np.int32(1)))
        at = long.launch(runs.size - 1, C, vec)
        kernel(cp, "embedding", f"embedding_backward_wte_long_{dtype}")(
            at.grid, at.block, (d_dout, keys, first, runs, dwte, np.int32(n), np.int32(C),
                                np.int32(vec), np.int32(1)))
        listed = cp.asnumpy(runs)
        counts = np.bincount(ids.reshape(-1), minlength=V)
        assert sorted(listed[1:1 + listed[0]]) == list(np.flatnonzero(counts > long.long_run))
        dwpe = store(cp, np.full((T, C), np.nan, np.float32), dtype)   # written
        at = geometry("embedding", f"embedding_backward_wpe_{dtype}").launch(T * C)
        kernel(cp, "embedding", f"embedding_backward_wpe_{dtype}")(
            at.grid, at.block,
            (store(cp, dout, dtype), dwpe, np.int32(B), np.int32(T), np.int32(C), np.int32(0)))
        grads.append((cp.asnumpy(dwte).copy(), cp.asnumpy(dwpe).copy()))
    assert all(a.tobytes() == b.tobytes() for a, b in zip(*grads)), "two runs differ"
    want_wte = np.ones((V, C))
    np.add.at(want_wte, flat, dout.reshape(-1, C).astype(np.float64))
    assert rel_err(from_bf16(grads[0][0]) if dtype == "bf16" else grads[0][0], want_wte) < TOL[dtype]
    got_wpe = from_bf16(grads[0][1]) if dtype == "bf16" else grads[0][1]
    assert rel_err(got_wpe, dout.astype(np.float64).sum(0)) < TOL[dtype]


def test_stable_helpers_give_no_nan_at_the_extremes(cp):
    common = (GENERATED_DIR / "cuda" / "eulergen_common.cuh").read_text()
    src = common + r'''
extern "C" __global__ void helpers(const float* x, float* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  out[4 * i] = eg_sigmoid(x[i]);
  out[4 * i + 1] = eg_softplus(x[i]);
  out[4 * i + 2] = eg_logaddexp(x[i], -x[i]);
  out[4 * i + 3] = eg_logaddexp(x[i], x[i]);
}
'''
    f = cp.RawModule(code=src, options=("-std=c++17",)).get_function("helpers")
    x = np.array([0, 1e-30, -1e-30, 1, -1, 80, -80, 1e4, -1e4], np.float32)
    out = cp.zeros(4 * len(x), np.float32)
    f((1,), (32,), (cp.asarray(x), out, np.int32(len(x))))
    got = cp.asnumpy(out).reshape(-1, 4).astype(np.float64)
    xd = x.astype(np.float64)
    want = np.stack([np.exp(-np.logaddexp(0, -xd)), np.logaddexp(0, xd), np.logaddexp(xd, -xd),
                     np.logaddexp(xd, xd)], 1)
    assert np.isfinite(got).all()
    assert np.allclose(got, want, rtol=1e-6, atol=1e-30)


def test_rope_sine_and_cosine_stay_accurate_at_long_positions(cp):
    common = (GENERATED_DIR / "cuda" / "eulergen_common.cuh").read_text()
    src = common + r'''
extern "C" __global__ void trig(const float* x, float* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) { out[2 * i] = eg_sinf(x[i]); out[2 * i + 1] = eg_cosf(x[i]); }
}
'''
    f = cp.RawModule(code=src, options=("-std=c++17",)).get_function("trig")
    x = np.linspace(-70000, 70000, 100001).astype(np.float32)
    out = cp.zeros(2 * len(x), np.float32)
    f((launch.cdiv(len(x), 256),), (256,), (cp.asarray(x), out, np.int32(len(x))))
    got = cp.asnumpy(out).reshape(-1, 2)
    xd = x.astype(np.float64)
    assert np.max(np.abs(got[:, 0] - np.sin(xd))) < 2e-6
    assert np.max(np.abs(got[:, 1] - np.cos(xd))) < 2e-6
