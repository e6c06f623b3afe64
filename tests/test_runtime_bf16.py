"""bf16 storage helpers: uint16 bit patterns, round-to-nearest-even like the kernels'
__float2bfloat16_rn (and torch's float → bfloat16)."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from eulergen import GENERATED_DIR
from eulergen.runtime.engine.bf16 import from_bf16, to_bf16
from eulergen.runtime.engine.manifest import load_manifest


def test_widening_is_exact_and_rounding_is_idempotent():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(10_000).astype(np.float32) * 100
    b = to_bf16(x)
    assert b.dtype == np.uint16
    np.testing.assert_array_equal(to_bf16(from_bf16(b)), b)
    # One bf16 ulp is 2^-7 relative; round-to-nearest is within half of it.
    assert np.max(np.abs(from_bf16(b) - x) / np.abs(x)) <= 2.0 ** -8


def test_ties_round_to_even():
    # 1 + 2^-8 lies halfway between bf16 1.0 and 1 + 2^-7: even mantissa (1.0) wins;
    # 1 + 3·2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6: 1 + 2^-6 (even) wins.
    x = np.float32([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, -(1 + 2.0 ** -8)])
    np.testing.assert_array_equal(from_bf16(to_bf16(x)), [1.0, 1 + 2.0 ** -6, -1.0])


def test_specials_survive():
    x = np.float32([np.inf, -np.inf, np.nan, 0.0, -0.0, 3.4e38])
    y = from_bf16(to_bf16(x))
    assert y[0] == np.inf and y[1] == -np.inf and np.isnan(y[2])
    assert y[3] == 0 and np.signbit(y[4]) and y[5] == np.inf   # max float rounds up to inf
    nan_low_payload = np.uint32(0x7F800001).view(np.float32)
    assert np.isnan(from_bf16(to_bf16(np.float32([nan_low_payload]))))[0]


def test_matches_torch_bfloat16_rounding():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(100_000), rng.standard_normal(1000) * 1e30,
                        rng.standard_normal(1000) * 1e-38]).astype(np.float32)
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(to_bf16(x), want)


# -- the generated kernels (generated/cuda/bf16.cu), compiled by g++, against the numpy forms --

BF16 = load_manifest(GENERATED_DIR / "manifest.json").ops["bf16"]
RUNNERS = {   # call -> (the runner's parameters, the kernel's arguments)
    "round": ("const float* x, unsigned short* y, long long n", "x, y, n"),
    "widen": ("const unsigned short* x, float* y, long long n", "x, y, n"),
    "add": ("const unsigned short* a, const unsigned short* b, unsigned short* y, long long n",
            "a, b, y, n"),
    "row_norms": ("const unsigned short* g, float* norms, long long rows, int cols",
                  "g, norms, rows, cols"),
}


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    """`run_<call>` for each kernel, launched with its geometry's block on a grid of two
    blocks (the kernels stride over the rest: any grid is correct), the emulator's CUDA
    builtins on the CPU."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not installed")
    folder = tmp_path_factory.mktemp("bf16")
    for name in ("eulergen_common.cuh", "bf16.cu"):
        shutil.copy(GENERATED_DIR / "cuda" / name, folder / name)
    lines = ['#include "bf16.cu"']
    for call, (params, args) in RUNNERS.items():
        k = BF16.kernel(call, "bf16")
        lines.append(f'extern "C" void run_{call}({params}) {{\n'
                     f"  emu_launch(dim3(2), dim3({k.geometry.threads}), [&] "
                     f"{{ {k.name}({args}); }});\n}}")
    (folder / "bf16.cpp").write_text("\n".join(lines) + "\n")
    emulator = Path(__file__).resolve().parent / "cudagen_emulator"
    subprocess.run(["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-I", str(emulator), "-o",
                    str(folder / "bf16.so"), str(folder / "bf16.cpp")], check=True)
    lib = ctypes.CDLL(str(folder / "bf16.so"))
    P, L = ctypes.c_void_p, ctypes.c_longlong
    lib.run_round.argtypes = (P, P, L)
    lib.run_widen.argtypes = (P, P, L)
    lib.run_add.argtypes = (P, P, P, L)
    lib.run_row_norms.argtypes = (P, P, L, ctypes.c_int)
    return lib


def _ptr(a):
    return a.ctypes.data


def _awkward(n, seed):
    """float32 values with ties, specials, tiny and huge magnitudes."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30, n)).astype(np.float32)
    x[:8] = [np.inf, -np.inf, np.nan, 0.0, -0.0, 3.4e38, 1 + 2.0 ** -8, -(1 + 3 * 2.0 ** -8)]
    return x


def test_the_cuda_rounding_is_to_bf16s(kernels):
    x = _awkward(50_000, 2)
    got = np.zeros(x.size, np.uint16)
    kernels.run_round(_ptr(x), _ptr(got), x.size)
    np.testing.assert_array_equal(got, to_bf16(x))


def test_the_cuda_widening_is_exact(kernels):
    x = to_bf16(_awkward(50_000, 6))
    got = np.zeros(x.size, np.float32)
    kernels.run_widen(_ptr(x), _ptr(got), x.size)
    np.testing.assert_array_equal(got.view(np.uint32), from_bf16(x).view(np.uint32))
    into = np.zeros(x.size, np.float32)
    assert from_bf16(x, out=into) is into
    np.testing.assert_array_equal(into.view(np.uint32), got.view(np.uint32))


def test_the_cuda_add_is_the_numpy_form(kernels):
    from eulergen.runtime.engine import bf16
    a, b = to_bf16(_awkward(20_000, 3)), to_bf16(_awkward(20_000, 4))
    got, want = np.zeros_like(a), np.zeros_like(a)
    kernels.run_add(_ptr(a), _ptr(b), _ptr(got), a.size)
    bf16.add(a, b, want)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(from_bf16(want)[8:], from_bf16(
        to_bf16(from_bf16(a)[8:] + from_bf16(b)[8:])))


@pytest.mark.parametrize("cols", [256, 250])   # 16-byte loads a lane; one element a lane
def test_the_cuda_row_norms_are_the_numpy_forms(kernels, cols):
    from eulergen.runtime.engine import bf16
    rng = np.random.default_rng(5)
    g = to_bf16(rng.standard_normal((40, cols)).astype(np.float32) * 1e-3)
    got, want = np.zeros(40, np.float32), np.zeros(40, np.float32)
    kernels.run_row_norms(_ptr(g), _ptr(got), 40, cols)
    bf16.row_norms(g, want)
    np.testing.assert_allclose(got, want, rtol=1e-5)   # summation order only
    wide = from_bf16(g).astype(np.float64)
    np.testing.assert_allclose(want, np.sqrt((wide ** 2).sum(axis=1)), rtol=1e-5)


def test_bits_are_the_patterns_a_fill_needs():
    from eulergen.runtime.engine import bf16
    assert bf16.bits(1.0) == 0x3F80 and bf16.bits(-np.inf) == 0xFF80 and bf16.bits(0.0) == 0
