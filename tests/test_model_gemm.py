"""The cuBLAS GEMM binding's argument mapping (row-major arrays as column-major operands),
checked on the CPU: a stand-in for cublasGemmEx reads the operands through the very
pointers, leading dimensions and transpose flags the binding passes."""
from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

from eulergen.runtime.tape import CublasGemm, numpy_gemm


class HostArray:
    """What the binding reads of a cupy array, over a numpy array."""

    def __init__(self, a):
        self.a, self.shape, self.strides, self.ndim, self.dtype = a, a.shape, a.strides, a.ndim, a.dtype
        self.data = SimpleNamespace(ptr=a.ctypes.data)


def _column_major(ptr, rows, cols, ld):
    buf = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(ld * cols,))
    return as_strided(buf, shape=(rows, cols), strides=(4, ld * 4))


def _gemm_ex(handle, ta, tb, m, n, k, alpha, A, a_type, lda, B, b_type, ldb, beta, C, c_type,
             ldc, compute, algo):
    """C = alpha·op(A)·op(B) + beta·C, column-major, as cuBLAS defines it."""
    scalar = lambda p: ctypes.cast(p, ctypes.POINTER(ctypes.c_float))[0]  # noqa: E731
    a = _column_major(A, k, m, lda).T if ta == CublasGemm.OP_T else _column_major(A, m, k, lda)
    b = _column_major(B, n, k, ldb).T if tb == CublasGemm.OP_T else _column_major(B, k, n, ldb)
    c = _column_major(C, m, n, ldc)
    c[...] = scalar(alpha) * (a @ b) + scalar(beta) * c


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
