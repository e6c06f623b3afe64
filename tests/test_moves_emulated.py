"""The decoder's row moves (generated/cuda/moves.cu, from templates/moves.cu.j2) without a
GPU: compiled by g++ over the CUDA emulator (tests/cudagen_emulator), each kernel launched
with its geometry's block on a grid of two blocks (threads stride over the rest: any grid is
correct), against runtime/generate/moves.py's numpy forms. They are copies: every bit."""
from __future__ import annotations

import ctypes
import shutil

import numpy as np
import pytest

from eulergen import GENERATED_DIR
from eulergen.runtime.engine.manifest import load_manifest
from eulergen.runtime.generate.moves import scatter_rows, take_row

from emulated import emulated_library, runner

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")

MOVES = load_manifest(GENERATED_DIR / "manifest.json").ops["moves"]
STORAGE = {"f32": ("float", np.float32), "bf16": ("__nv_bfloat16", np.uint16)}
RUNNERS = {   # call -> (the runner's parameters over element type T, the kernel's arguments)
    "scatter": ("const T* src, long long src_sb, long long src_st, const int* positions, T* dst, "
                "long long rows, long long width, long long seq, long long n",
                "src, src_sb, src_st, positions, dst, rows, width, seq, n"),
    "take": ("const T* x, const int* index, T* y, long long rows, long long width, long long n",
             "x, index, y, rows, width, n"),
}


@pytest.fixture(scope="module")
def moves(tmp_path_factory):
    runners = []
    for dt, (ctype, _) in STORAGE.items():
        for call, (params, args) in RUNNERS.items():
            k = MOVES.kernel(call, dt)
            runners.append(runner(f"{call}_{dt}", params.replace("T*", ctype + "*"), "2",
                                  k.geometry.threads, f"{k.name}({args})"))
    lib = emulated_library(tmp_path_factory.mktemp("moves"), "moves.cu", runners)
    P, L = ctypes.c_void_p, ctypes.c_longlong
    for dt in STORAGE:
        getattr(lib, f"run_scatter_{dt}").argtypes = (P, L, L, P, P, L, L, L, L)
        getattr(lib, f"run_take_{dt}").argtypes = (P, P, P, L, L, L)
    return lib


def _values(shape, dtype, seed):
    """Random bit patterns of the storage type (a copy must keep every one)."""
    bits = np.random.default_rng(seed).integers(0, 2 ** 16, shape, dtype=np.uint32)
    return (bits * 65537).view(np.float32) if dtype == np.float32 else bits.astype(np.uint16)


@pytest.mark.parametrize("dt", list(STORAGE))
def test_scatter_writes_a_strided_sources_rows_at_their_positions(moves, dt):
    """k of a fused qkv buffer [B, T, 3·H, D] (rows of H·D contiguous, strided between) into a
    cache [B, S, H, D] at each sequence's own positions."""
    elem = STORAGE[dt][1]
    B, T, S, H, D = 2, 3, 8, 2, 5
    qkv = _values((B, T, 3 * H, D), elem, 1)
    src = qkv[:, :, H:2 * H]
    positions = np.int32([[5, 1, 7], [0, 6, 3]])
    want, got = _values((B, S, H, D), elem, 2), _values((B, S, H, D), elem, 2)
    scatter_rows(src, positions, want)
    step = src.itemsize
    getattr(moves, f"run_scatter_{dt}")(src.ctypes.data, src.strides[0] // step,
                                        src.strides[1] // step, positions.ctypes.data,
                                        got.ctypes.data, T, H * D, S, B * T * H * D)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def test_token_ids_move_as_words_through_the_f32_kernel(moves):
    """The decoder's held ids (int32) go through the f32 scatter as 4-byte words."""
    ids = np.int32([[3, 50256, 0], [-1, 7, 2 ** 31 - 1]])
    positions = np.int32([[2, 0, 1], [1, 2, 0]])
    want, got = np.full((2, 4), -5, np.int32), np.full((2, 4), -5, np.int32)
    scatter_rows(ids, positions, want)
    moves.run_scatter_f32(ids.ctypes.data, 3, 1, positions.ctypes.data, got.ctypes.data, 3, 1,
                          4, 6)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dt", list(STORAGE))
def test_take_copies_each_sequences_row_at_the_held_index(moves, dt):
    elem = STORAGE[dt][1]
    x = _values((3, 6, 40), elem, 3)
    index = np.int32([4])
    want, got = np.zeros((3, 40), elem), np.zeros((3, 40), elem)
    take_row(x, index, want)
    getattr(moves, f"run_take_{dt}")(x.ctypes.data, index.ctypes.data, got.ctypes.data, 6, 40,
                                     got.size)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
