"""bf16 storage helpers: uint16 bit patterns, round-to-nearest-even like the kernels'
__float2bfloat16_rn (and torch's float → bfloat16)."""
from __future__ import annotations

import numpy as np
import pytest

from eulergen.runtime.engine.bf16 import from_bf16, to_bf16


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


# -- the CUDA text of runtime/engine/bf16.py's kernels, compiled by g++, against its numpy forms --

_CTYPE = {"float32": ("float", np.float32), "uint16": ("unsigned short", np.uint16)}


def _params(text: str) -> list[tuple[str, str]]:
    return [tuple(p.split()) for p in text.split(",")]


@pytest.fixture(scope="module")
def snippets(tmp_path_factory):
    """Each kernel's operation (and the row-norm reduction's map, reduce and post-map
    expressions, summed in row order) as a C function over arrays, built with the
    emulator's CUDA builtins: the text CuPy compiles, run on the CPU."""
    import ctypes
    import shutil
    import subprocess
    from pathlib import Path

    from eulergen.runtime.engine import bf16
    if shutil.which("g++") is None:
        pytest.skip("g++ not installed")
    emulator = Path(__file__).resolve().parent / "attention_emulator"
    lines = ['#include "cuda_bf16.h"', bf16.DEVICE]
    for name, (ins, outs, op) in bf16.ELEMENTWISE.items():
        params = _params(ins) + _params(outs)
        args = ", ".join(f"{_CTYPE[t][0]}* {n}_" for t, n in params)
        binds = " ".join(f"{_CTYPE[t][0]}& {n} = {n}_[k];" for t, n in params)
        lines.append(f'extern "C" void {name}({args}, long n) {{\n'
                     f"  for (long k = 0; k < n; ++k) {{ {binds} {op}; }}\n}}")
    (gt, g), (st, s), mapped, reduce, post, identity = (*_params(bf16.ROW_NORMS[0]),
                                                         *_params(bf16.ROW_NORMS[1]),
                                                         *bf16.ROW_NORMS[2:])
    lines.append(f'extern "C" void row_norms({_CTYPE[gt][0]}* g_, {_CTYPE[st][0]}* s_, long rows, '
                 f"long cols) {{\n  for (long r = 0; r < rows; ++r) {{\n"
                 f"    float a = {identity};\n"
                 f"    for (long k = 0; k < cols; ++k) {{ const {_CTYPE[gt][0]} {g} = g_[r * cols + k]; "
                 f"float b = {mapped}; a = {reduce}; }}\n"
                 f"    {_CTYPE[st][0]}& {s} = s_[r]; {post};\n  }}\n}}")
    folder = tmp_path_factory.mktemp("bf16")
    (folder / "bf16.cpp").write_text("\n".join(lines))
    subprocess.run(["g++", "-O1", "-shared", "-fPIC", "-I", str(emulator), "-o",
                    str(folder / "bf16.so"), str(folder / "bf16.cpp")], check=True)
    return ctypes.CDLL(str(folder / "bf16.so"))


def _ptr(a):
    import ctypes
    return a.ctypes.data_as(ctypes.c_void_p)


def _awkward(n, seed):
    """float32 values with ties, specials, tiny and huge magnitudes."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30, n)).astype(np.float32)
    x[:8] = [np.inf, -np.inf, np.nan, 0.0, -0.0, 3.4e38, 1 + 2.0 ** -8, -(1 + 3 * 2.0 ** -8)]
    return x


def test_the_cuda_rounding_is_to_bf16s(snippets):
    x = _awkward(50_000, 2)
    got = np.zeros(x.size, np.uint16)
    snippets.to_bf16(_ptr(x), _ptr(got), x.size)
    np.testing.assert_array_equal(got, to_bf16(x))


def test_the_cuda_add_is_the_numpy_form(snippets):
    from eulergen.runtime.engine import bf16
    a, b = to_bf16(_awkward(20_000, 3)), to_bf16(_awkward(20_000, 4))
    got, want = np.zeros_like(a), np.zeros_like(a)
    snippets.add(_ptr(a), _ptr(b), _ptr(got), a.size)
    bf16.add(a, b, want)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(from_bf16(want)[8:], from_bf16(
        to_bf16(from_bf16(a)[8:] + from_bf16(b)[8:])))


def test_the_cuda_row_norms_are_the_numpy_forms(snippets):
    from eulergen.runtime.engine import bf16
    rng = np.random.default_rng(5)
    g = to_bf16(rng.standard_normal((64, 256)).astype(np.float32) * 1e-3)
    got, want = np.zeros(64, np.float32), np.zeros(64, np.float32)
    snippets.row_norms(_ptr(g), _ptr(got), 64, 256)
    bf16.row_norms(g, want)
    np.testing.assert_allclose(got, want, rtol=1e-5)   # summation order only
    wide = from_bf16(g).astype(np.float64)
    np.testing.assert_allclose(want, np.sqrt((wide ** 2).sum(axis=1)), rtol=1e-5)


def test_bits_are_the_patterns_a_fill_needs():
    from eulergen.runtime.engine import bf16
    assert bf16.bits(1.0) == 0x3F80 and bf16.bits(-np.inf) == 0xFF80 and bf16.bits(0.0) == 0


def test_no_kernel_parameter_name_occurs_inside_another_identifier():
    """CuPy substitutes a ReductionKernel's parameter names into its expressions as text: a
    name inside another identifier (`g` in `eg_widen`, `s` in `sqrtf`) is rewritten too, and
    NVRTC refuses the kernel (seen on the H200). Every name occurs only as a whole word."""
    import re

    from eulergen.runtime.engine import bf16
    kernels = [(ins + ", " + outs, op) for ins, outs, op in bf16.ELEMENTWISE.values()]
    kernels.append((bf16.ROW_NORMS[0] + ", " + bf16.ROW_NORMS[1], " ".join(bf16.ROW_NORMS[2:5])))
    for params, code in kernels:
        for name in (p.split()[-1] for p in params.split(",")):
            identifiers = re.findall(r"[A-Za-z_]\w*", code)
            assert not [w for w in identifiers if name in w and w != name], (name, code)
