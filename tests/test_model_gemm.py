"""The cuBLAS GEMM binding's argument mapping (row-major arrays as column-major operands),
checked on the CPU: a stand-in for cublasGemmEx reads the operands through the very
pointers, leading dimensions, transpose flags and data types the binding passes, in fp32
and in bf16 (uint16 bits: widened, summed in float32, rounded once, as cuBLAS with
CUBLAS_COMPUTE_32F), refusing a leading dimension cuBLAS would refuse."""
from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

from eulergen.runtime.ops import from_bf16, to_bf16
from eulergen.runtime.tape import CublasGemm, numpy_gemm


class HostArray:
    """What the binding reads of a cupy array, over a numpy array."""

    def __init__(self, a):
        self.a, self.shape, self.strides, self.ndim, self.dtype = a, a.shape, a.strides, a.ndim, a.dtype
        self.data = SimpleNamespace(ptr=a.ctypes.data)


_ELEMENT = {CublasGemm.R_32F: ctypes.c_float, CublasGemm.R_16BF: ctypes.c_uint16}


def _column_major(ptr, rows, cols, ld, kind):
    assert ld >= max(1, rows), f"leading dimension {ld} < {rows} rows: cuBLAS refuses it"
    element = _ELEMENT[kind]
    buf = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(element)), shape=(ld * cols,))
    size = ctypes.sizeof(element)
    return as_strided(buf, shape=(rows, cols), strides=(size, ld * size))


def _gemm_ex(handle, ta, tb, m, n, k, alpha, A, a_type, lda, B, b_type, ldb, beta, C, c_type,
             ldc, compute, algo):
    """C = alpha·op(A)·op(B) + beta·C, column-major, as cuBLAS defines it; bf16 operands
    are widened and the float32 result rounded once."""
    assert a_type == b_type == c_type and algo == CublasGemm.GEMM_DEFAULT
    calls.append((c_type, compute))
    wide = (lambda x: from_bf16(x)) if c_type == CublasGemm.R_16BF else (lambda x: x)
    scalar = lambda p: ctypes.cast(p, ctypes.POINTER(ctypes.c_float))[0]  # noqa: E731
    a = (_column_major(A, k, m, lda, a_type).T if ta == CublasGemm.OP_T
         else _column_major(A, m, k, lda, a_type))
    b = (_column_major(B, n, k, ldb, b_type).T if tb == CublasGemm.OP_T
         else _column_major(B, k, n, ldb, b_type))
    c = _column_major(C, m, n, ldc, c_type)
    got = scalar(alpha) * (wide(a) @ wide(b)) + scalar(beta) * wide(c)
    c[...] = to_bf16(got) if c_type == CublasGemm.R_16BF else got


calls: list = []


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
@pytest.mark.parametrize("add", [False, True])
def test_cublas_binding_computes_what_numpy_computes(ta, tb, add):
    rng = np.random.default_rng(0)
    M, K, N = 5, 7, 3
    a = rng.standard_normal((K, M) if ta else (M, K)).astype(np.float32)
    # b as a row block of a wider matrix: a leading dimension larger than its width
    wide = rng.standard_normal((N + 4, K + 2) if tb else (K + 4, N + 2)).astype(np.float32)
    b = wide[2:2 + N, :K] if tb else wide[1:1 + K, :N]
    out = rng.standard_normal((M, N)).astype(np.float32)
    want = out.copy()
    CublasGemm(_gemm_ex, 0, tf32=False)(HostArray(a), HostArray(b), HostArray(out),
                                       ta=ta, tb=tb, add=add)
    numpy_gemm(a, b, want, ta=ta, tb=tb, add=add)
    np.testing.assert_allclose(out, want, rtol=1e-6)


def test_cublas_binding_refuses_a_column_strided_operand():
    a = np.ones((4, 8), np.float32)[:, ::2]
    with pytest.raises(ValueError, match="unit column stride"):
        CublasGemm(_gemm_ex, 0, tf32=False)(HostArray(a), HostArray(np.ones((4, 4), np.float32)),
                                            HostArray(np.ones((4, 4), np.float32)))


@pytest.mark.parametrize("ta, tb, a_shape, b_shape", [
    (False, True, (12, 8), (16, 8)),    # y = x·wᵀ
    (False, False, (12, 16), (16, 8)),  # dx = dy·w
    (True, False, (12, 16), (12, 8)),   # dw = dyᵀ·x
    (False, False, (1, 12), (12, 16)),  # db = 1ᵀ·dy
    (True, False, (1, 12), (1, 16)),    # the bf16 bias, written first: y = 1·b (k = 1)
])
@pytest.mark.parametrize("add", [False, True])
def test_bf16_gemms_sum_in_float32_and_round_once(ta, tb, a_shape, b_shape, add):
    rng = np.random.default_rng(1)
    a, b = (to_bf16(rng.standard_normal(s).astype(np.float32)) for s in (a_shape, b_shape))
    m, n = a_shape[1] if ta else a_shape[0], b_shape[0] if tb else b_shape[1]
    out = to_bf16(rng.standard_normal((m, n)).astype(np.float32))
    wa, wb = from_bf16(a), from_bf16(b)
    want = to_bf16((wa.T if ta else wa) @ (wb.T if tb else wb) + (from_bf16(out) if add else 0))
    calls.clear()
    CublasGemm(_gemm_ex, 0, tf32=True)(HostArray(a), HostArray(b), HostArray(out),
                                      ta=ta, tb=tb, add=add)
    # one bf16 rounding apart at most (numpy may sum the transposed product in another order)
    np.testing.assert_allclose(from_bf16(out), from_bf16(want), rtol=2.0 ** -8, atol=1e-6)
    # bf16 operands sum in float32 (CUBLAS_COMPUTE_32F), whatever training.tf32 says
    assert calls == [(CublasGemm.R_16BF, CublasGemm.COMPUTE_32F)]


def test_fp32_gemms_keep_tf32_compute():
    calls.clear()
    a = np.ones((2, 2), np.float32)
    CublasGemm(_gemm_ex, 0, tf32=True)(HostArray(a), HostArray(a), HostArray(a.copy()))
    assert calls == [(CublasGemm.R_32F, CublasGemm.COMPUTE_32F_FAST_TF32)]


def test_cublas_binding_refuses_mixed_dtypes():
    a = np.ones((2, 2), np.float32)
    with pytest.raises(ValueError, match="one dtype"):
        CublasGemm(_gemm_ex, 0, tf32=False)(HostArray(a), HostArray(to_bf16(a)), HostArray(a))
