"""The decoder's few-row GEMMs (generated/cuda/gemv.cu, from templates/gemv.cu.j2) without a
GPU: compiled by g++ over the CUDA emulator (tests/cudagen_emulator), each kernel launched
with its geometry's grid and block, against the float64 product. The kernel sums in float32
and rounds once, so it is within one rounding of the output's dtype plus float32's error of
a k-term sum (stated at each check)."""
from __future__ import annotations

import ctypes
import shutil

import numpy as np
import pytest

from eulergen import GENERATED_DIR
from eulergen.generator.plan import GEMV_LAUNCHES
from eulergen.runtime.engine import bf16
from eulergen.runtime.engine.manifest import load_manifest

from emulated import emulated_library, runner

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")

GEMV = load_manifest(GENERATED_DIR / "manifest.json").ops["gemv"]
CTYPES = {"long long": ctypes.c_longlong, "int": ctypes.c_int, "float": ctypes.c_float}


@pytest.fixture(scope="module")
def gemv(tmp_path_factory):
    lib = emulated_library(tmp_path_factory.mktemp("gemv"), "gemv.cu", [
        runner(k.name, f"int grid, {k.c_params}", "grid", k.geometry.threads,
               f"{k.name}({k.call_args})") for k in GEMV.kernels.values()])
    for k in GEMV.kernels.values():
        getattr(lib, f"run_{k.name}").argtypes = (ctypes.c_int, *(
            ctypes.c_void_p if c.endswith("*") else CTYPES[c] for _, c in k.args))
    return lib


def _run(lib, stage, dt, bound, x, w, b, y, rows, beta, cols=1):
    """Launch the kernel of `stage` in `dt` for at most `bound` rows over host arrays (the
    storage: bf16 as uint16 bits), `cols` output columns a block, with its geometry's grid."""
    k = GEMV.kernel(stage, dt, rows=bound)
    n = w.shape[0]
    at = k.geometry.launch(n, cols)
    getattr(lib, f"run_{k.name}")(
        at.grid[0], x.ctypes.data, x.strides[0] // x.itemsize, w.ctypes.data,
        w.strides[0] // w.itemsize, None if b is None else b.ctypes.data, y.ctypes.data,
        y.strides[0] // y.itemsize, rows, n, x.shape[1], cols, beta)


def _operands(rows, n, k, dt, seed):
    """x [rows, k], w [n, k], b [n] as float64 values the storage holds exactly, and their
    storage."""
    rng = np.random.default_rng(seed)
    vals = [rng.standard_normal(s) for s in ((rows, k), (n, k), n)]
    if dt == "bf16":
        stored = [bf16.to_bf16(v.astype(np.float32)) for v in vals]
        return [bf16.from_bf16(s).astype(np.float64) for s in stored], stored
    stored = [v.astype(np.float32) for v in vals]
    return [s.astype(np.float64) for s in stored], stored


def _bound(x, w, k):
    """float32's error bound of a k-term sum of x·w products, a column: k·2⁻²⁴·Σ|x·w|
    (the sum order is the kernel's own, any order within it)."""
    return k * 2.0 ** -24 * (np.abs(x) @ np.abs(w).T)


# k: within one chunk a warp (lanes left idle), several chunks, and more chunks than a
# column's warps keep in flight (the loop goes round), with a partial chunk at the end; cols:
# a block a column, or 2 and 4 of the 5 columns a block (the last block's columns past n idle)
@pytest.mark.parametrize("dt", ["f32", "bf16"])
@pytest.mark.parametrize("rows,bound,k,cols", [(1, 1, 64, 1), (1, 2, 1032, 2), (2, 2, 1032, 4),
                                               (2, 2, 4376, 1), (2, 2, 4376, 4)])
def test_a_kernel_gives_the_product_plus_bias_within_one_rounding(gemv, dt, rows, bound, k,
                                                                  cols):
    n = 5
    (x, w, b), (xs, ws, bs) = _operands(rows, n, k, dt, 1)
    store = bs.dtype
    y = np.full((rows + 2, n + 3), 7, store)          # a strided out, rows after `rows` kept
    _run(gemv, "gemv", dt, bound, xs, ws, bs, y[:, :n], rows, 0.0, cols)
    want = x @ w.T + b
    got = (bf16.from_bf16(y) if dt == "bf16" else y).astype(np.float64)
    ulp = 2.0 ** -8 if dt == "bf16" else 2.0 ** -24    # half a unit in the last place
    np.testing.assert_array_less(np.abs(got[:rows, :n] - want),
                                 ulp * np.abs(want) + _bound(x, w, k) + 1e-30)
    assert (y[rows:] == store.type(7)).all() and (y[:, n:] == store.type(7)).all()


@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_beta_one_adds_the_old_output_before_the_one_rounding(gemv, dt):
    rows, n, k = 2, 4, 264
    (x, w, _), (xs, ws, _) = _operands(rows, n, k, dt, 2)
    old = np.arange(rows * n, dtype=np.float64).reshape(rows, n) - 3.0    # exact in bf16
    y = bf16.to_bf16(old.astype(np.float32)) if dt == "bf16" else old.astype(np.float32)
    _run(gemv, "gemv", dt, 2, xs, ws, None, y, rows, 1.0, 4)
    want = x @ w.T + old
    got = (bf16.from_bf16(y) if dt == "bf16" else y).astype(np.float64)
    ulp = 2.0 ** -8 if dt == "bf16" else 2.0 ** -24
    np.testing.assert_array_less(np.abs(got - want), ulp * np.abs(want) + _bound(x, w, k) + 1e-30)


def test_bf16_operands_write_float32_logits(gemv):
    """The sampler's logits: bf16 x and w, float32 out, one float32 rounding of the sum."""
    rows, n, k = 1, 9, 776
    (x, w, _), (xs, ws, _) = _operands(rows, n, k, "bf16", 3)
    y = np.zeros((rows, n), np.float32)
    _run(gemv, "gemv_f32_out", "bf16", 1, xs, ws, None, y, rows, 0.0, 2)
    want = x @ w.T
    np.testing.assert_array_less(np.abs(y - want), 2.0 ** -24 * np.abs(want) + _bound(x, w, k))


def test_every_row_bound_has_a_kernel_of_each_storage_and_the_wide_bf16_form():
    bounds = sorted({k.geometry.rows for k in GEMV.kernels.values()})
    assert bounds == sorted({g.rows for g in GEMV_LAUNCHES}) and bounds[0] == 1
    for r in bounds:
        for stage, dt in (("gemv", "f32"), ("gemv", "bf16"), ("gemv_f32_out", "bf16")):
            assert GEMV.kernel(stage, dt, rows=r).geometry.rows == r


def test_a_launch_packs_columns_into_blocks_only_while_every_sm_keeps_its_blocks():
    from eulergen.runtime.engine.gemv import BLOCKS_PER_SM, columns
    sms = 132
    assert columns(50304, sms) == 4                         # the head: 12,576 blocks
    assert columns(2 * BLOCKS_PER_SM * sms, sms) == 2       # 4 a block would leave SMs short
    assert columns(768, sms) == 1                           # fewer columns than SMs' blocks
