"""The device draw (generated/cuda/draw.cu, from templates/draw.cu.j2) without a GPU:
compiled by g++ over the CUDA emulator (tests/cudagen_emulator: a block's threads as fibers,
barriers and shuffles among them), launched as its geometry says, and run on the rows
numpy's `pick` draws from, with the same uniforms. Its weights are integers and its sums
exact, so the ids must be the same; the only way to differ is an exp that rounds differently
in its last bit exactly where a weight's rounding or the draw's boundary turns on it (glibc's
against numpy's here)."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from eulergen import GENERATED_DIR
from eulergen.runtime.engine.manifest import load_manifest
from eulergen.runtime.generate.draw import pick, uniforms

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")]

EMULATOR = Path(__file__).resolve().parent / "cudagen_emulator"
KERNEL = load_manifest(GENERATED_DIR / "manifest.json").ops["draw"].kernel("pick", "f32")
SHIM = r"""
#include <cuda_bf16.h>
inline unsigned atomicAdd(unsigned* p, unsigned v) { const unsigned o = *p; *p = o + v; return o; }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  const unsigned long long o = *p; *p = o + v; return o;
}
template <typename T> inline T __shfl_down_sync(unsigned, T v, int d) {
  const int src = emu::lane() + d;
  return emu_shfl(v, src < 32 ? src : emu::lane());
}
inline unsigned long long __double2ull_rn(double x) { return (unsigned long long)std::nearbyint(x); }
using std::exp;
using std::floor;
#include "draw.cu"
"""
WRAPPER = r"""
extern "C" void emu_draw(unsigned rows, const float* logits, long long stride, int vocab,
                         float temperature, int top_k, float top_p, unsigned long long seed,
                         int step, int* next_ids, int* drawn, int drawn_stride, int column) {
  emu_launch(dim3(rows), dim3(%d), [=] {
    %s(logits, stride, vocab, temperature, top_k, top_p, seed, step, next_ids, drawn,
       drawn_stride, column);
  });
}
""" % (KERNEL.geometry.launch(1).block[0], KERNEL.name)


@pytest.fixture(scope="module")
def draw(tmp_path_factory):
    folder = tmp_path_factory.mktemp("draw")
    for name in ("eulergen_common.cuh", "draw.cu"):
        shutil.copy(GENERATED_DIR / "cuda" / name, folder / name)
    (folder / "draw.cpp").write_text(SHIM + WRAPPER)
    built = subprocess.run(["g++", "-std=c++17", "-O1", "-w", "-shared", "-fPIC", "-I",
                            str(EMULATOR), "draw.cpp", "-o", "draw.so"], cwd=folder,
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-4000:]
    lib = ctypes.CDLL(str(folder / "draw.so"))
    lib.emu_draw.argtypes = (ctypes.c_uint, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int,
                             ctypes.c_float, ctypes.c_int, ctypes.c_float, ctypes.c_ulonglong,
                             ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                             ctypes.c_int)

    def run(logits, vocab, temperature, top_k, top_p, seed, step):
        logits = np.ascontiguousarray(logits, dtype=np.float32)
        rows = len(logits)
        ids = np.full(rows, -1, np.int32)
        drawn = np.full((rows, 4), -1, np.int32)
        lib.emu_draw(rows, logits.ctypes.data, logits.shape[1], vocab, temperature, top_k or 0,
                     1.0 if top_p is None else top_p, seed, step, ids.ctypes.data,
                     drawn.ctypes.data, 4, 2)
        assert np.array_equal(drawn[:, 2], ids) and (drawn[:, [0, 1, 3]] == -1).all()
        return ids
    return run


def _logits(rows, width, seed, scale=3.0):
    return (np.random.default_rng(seed).standard_normal((rows, width)) * scale).astype(np.float32)


# (each emulated block costs ~0.6 s: its 1024 fibers' stacks are allocated anew)
@pytest.mark.parametrize("temperature, top_k, top_p", [
    (0, None, None), (1.3, None, None), (0.8, 40, None), (0.7, 50, 0.8)])
def test_the_device_draw_picks_numpys_ids(draw, temperature, top_k, top_p):
    x = _logits(3, 2112, seed=top_k or 1)      # 2112: two ids a thread, a chunk of three
    x[:, 2100:] = 50.0                          # padding past vocab 2100 is never drawn
    u = uniforms(9, 4, len(x))
    want = pick(x, 2100, u, temperature, top_k, top_p)
    got = draw(x, 2100, temperature, top_k, top_p, 9, 4)
    assert np.array_equal(got, want), f"{got} vs {want}"
    assert (got < 2100).all()


def test_the_device_draw_keeps_ties_as_numpy_does(draw):
    # logits on a coarse grid: many equal values at the top-k and nucleus cuts
    x = np.round(_logits(3, 700, seed=5, scale=2.0) * 2) / 2
    for top_k, top_p in ((5, None), (None, 0.5)):
        u = uniforms(3, 0, len(x))
        assert np.array_equal(draw(x, 700, 1.0, top_k, top_p, 3, 0),
                              pick(x, 700, u, 1.0, top_k, top_p)), (top_k, top_p)
