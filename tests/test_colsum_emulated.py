"""The Linear layers' bias-gradient column sums (generated/cuda/colsum.cu, from
templates/colsum.cu.j2) without a GPU: compiled by g++ over the CUDA emulator, the partial
rows and then their reduce, against the float64 column sums. The kernels sum in float32 and
round once, so each sum is within half a unit of the output's dtype plus float32's error of
a rows-term sum, rows·2⁻²⁴·Σ|x| (stated at each check)."""
from __future__ import annotations

import ctypes
import shutil

import numpy as np
import pytest

from eulergen import GENERATED_DIR
from eulergen.launch import cdiv
from eulergen.runtime.engine import bf16
from eulergen.runtime.engine.manifest import load_manifest

from emulated import emulated_library

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")

COLSUM = load_manifest(GENERATED_DIR / "manifest.json").ops["colsum"]
CTYPES = {"long long": ctypes.c_longlong, "int": ctypes.c_int}


def _runner(k) -> str:
    return (f'extern "C" void run_{k.name}(int gx, int gy, {k.c_params}) {{\n'
            f"  emu_launch_2d(dim3(gx, gy), dim3({', '.join(map(str, _block(k)))}), "
            f"[&] {{ {k.name}({k.call_args}); }});\n}}")


def _block(k) -> tuple[int, int]:
    return k.geometry.threads_x, k.geometry.threads_y


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    lib = emulated_library(tmp_path_factory.mktemp("colsum"), "colsum.cu",
                           [_runner(k) for k in COLSUM.kernels.values()])
    for k in COLSUM.kernels.values():
        getattr(lib, f"run_{k.name}").argtypes = (ctypes.c_int, ctypes.c_int, *(
            ctypes.c_void_p if c.endswith("*") else CTYPES[c] for _, c in k.args))
    return lib


def _colsum(lib, xs, out, *, aligned, groups=None, add=False):
    """out (+)= the column sums of host matrix xs (bf16 as uint16 bits, any row stride) by
    the partials kernel (its geometry's grid, or `groups` row groups) and the reduce."""
    rows, cols = xs.shape
    dt = "bf16" if xs.dtype == np.uint16 else "f32"
    k = COLSUM.kernel("partials", dt, aligned=aligned)
    gx, gy = k.geometry.launch(rows, cols).grid
    gy = groups or gy
    partials = np.full((gy, cols), np.nan, np.float32)   # every slot the reduce reads is written
    getattr(lib, f"run_{k.name}")(gx, gy, xs.ctypes.data, xs.strides[0] // xs.itemsize,
                                  partials.ctypes.data, rows, cols)
    r = COLSUM.kernel("reduce", "bf16" if out.dtype == np.uint16 else "f32")
    getattr(lib, f"run_{r.name}")(r.geometry.launch(cols).grid[0], 1, partials.ctypes.data,
                                  out.ctypes.data, gy, cols, int(add))


def _matrix(rows, cols, dt, seed, ld=None):
    """[rows, cols] values the storage holds exactly (float64) and their storage, rows
    `ld` elements apart."""
    x = np.random.default_rng(seed).standard_normal((rows, ld or cols))
    stored = bf16.to_bf16(x.astype(np.float32)) if dt == "bf16" else x.astype(np.float32)
    exact = bf16.from_bf16(stored) if dt == "bf16" else stored
    return exact.astype(np.float64)[:, :cols], stored[:, :cols]


def _check(got, want, x, out_dtype):
    half = 2.0 ** -8 if out_dtype == np.uint16 else 2.0 ** -24   # half a unit in the last place
    got = (bf16.from_bf16(got) if out_dtype == np.uint16 else got).astype(np.float64)
    bound = half * np.abs(want) + x.shape[0] * 2.0 ** -24 * np.abs(x).sum(0)
    np.testing.assert_array_less(np.abs(got - want), bound * (1 + 2.0 ** -7) + 1e-30)


# aligned: whole 16-byte vectors (bf16: 8, f32: 4 a vector) with 3 column blocks' worth and a
# last block partly idle; unaligned: 5 and 13 columns, rows ld = cols + 3 apart
@pytest.mark.parametrize("dt", ["f32", "bf16"])
@pytest.mark.parametrize("rows,cols,ld,aligned", [(37, 264, None, True), (300, 40, 48, True),
                                                  (37, 5, 8, False), (70, 13, 16, False)])
def test_the_column_sums_are_within_one_rounding_and_a_float32_sum(lib, dt, rows, cols, ld,
                                                                   aligned):
    x, xs = _matrix(rows, cols, dt, 1, ld)
    out = np.zeros(cols, xs.dtype)
    _colsum(lib, xs, out, aligned=aligned)
    _check(out, x.sum(0), x, xs.dtype)


@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_a_lane_takes_several_rounds_of_rows_when_the_groups_are_few(lib, dt):
    """Two row groups of 8 lanes over 300 rows: each lane loads 4 rows at a time, 5 times."""
    x, xs = _matrix(300, 16, dt, 2)
    out = np.zeros(16, xs.dtype)
    _colsum(lib, xs, out, aligned=True, groups=2)
    _check(out, x.sum(0), x, xs.dtype)
    out2 = np.zeros(16, xs.dtype)
    _colsum(lib, xs, out2, aligned=False, groups=2)
    _check(out2, x.sum(0), x, xs.dtype)


def test_bf16_rows_sum_into_a_float32_gradient_and_accumulate(lib):
    """autocast: bf16 dy, float32 db; a later micro-step adds to it before its one rounding."""
    x, xs = _matrix(64, 24, "bf16", 3)
    old = np.arange(24, dtype=np.float32) - 5.0
    out = old.copy()
    _colsum(lib, xs, out, aligned=True, add=True)
    _check(out, old + x.sum(0), x, np.float32)


def test_a_launch_keeps_a_whole_round_of_loads_a_lane_and_the_sm_full():
    k = COLSUM.kernel("partials", "bf16", aligned=True)
    g = k.geometry
    # GPT-2's 768 columns: 3 column blocks; 8192 rows give each lane one round of 4 rows
    assert g.launch(8192, 768).grid == (3, cdiv(8192, g.threads_y * g.rows_in_flight))
    # 2304 columns (qkv): the blocks' target caps the groups, so the lanes loop
    assert g.launch(8192, 2304).grid == (9, cdiv(g.blocks, 9))
    assert g.launch(1, 5).grid == (1, 1)
