"""The GEMM bindings' argument mapping (row-major arrays as column-major operands), checked
on the CPU: stand-ins for cublasGemmEx and for nvmath-python's cuBLASLt read the operands
through the very pointers, leading dimensions, transpose flags, data types and epilogue
attributes the bindings pass, in fp32 and in bf16 (uint16 bits: widened, summed in
float32, rounded once, as cuBLAS with CUBLAS_COMPUTE_32F), refusing a leading dimension
cuBLAS would refuse. And the choice between them (runtime/engine/gemm.py) where one is missing."""
from __future__ import annotations

import ctypes
import enum
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

from eulergen.errors import EulerError
from eulergen.runtime.engine import gemm, gemm_search
from eulergen.runtime.engine.backend import NUMPY
from eulergen.runtime.engine.gemm import (COMPUTE_32F, COMPUTE_32F_FAST_TF32, OP_T, R_16BF, R_32F,
                                   CublasGemm, numpy_gemm)
from eulergen.runtime.engine.bf16 import from_bf16, to_bf16


class HostArray:
    """What the binding reads of a cupy array, over a numpy array."""

    def __init__(self, a):
        self.a, self.shape, self.strides, self.ndim, self.dtype = a, a.shape, a.strides, a.ndim, a.dtype
        self.size, self.nbytes, self.flags = a.size, a.nbytes, a.flags
        self.data = SimpleNamespace(ptr=a.ctypes.data)


_ELEMENT = {R_32F: ctypes.c_float, R_16BF: ctypes.c_uint16}


def _column_major(ptr, rows, cols, ld, kind):
    assert ld >= max(1, rows), f"leading dimension {ld} < {rows} rows: cuBLAS refuses it"
    element = _ELEMENT[kind]
    buf = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(element)), shape=(ld * cols,))
    size = ctypes.sizeof(element)
    return as_strided(buf, shape=(rows, cols), strides=(size, ld * size))


def _gemm_ex(ta, tb, m, n, k, alpha, A, a_type, lda, B, b_type, ldb, beta, C, c_type,
             ldc, compute, algo):
    """C = alpha·op(A)·op(B) + beta·C, column-major, as cuBLAS defines it; bf16 operands
    are widened and the float32 result rounded once."""
    assert a_type == b_type == c_type and algo == CublasGemm.GEMM_DEFAULT
    calls.append((c_type, compute))
    wide = (lambda x: from_bf16(x)) if c_type == R_16BF else (lambda x: x)
    scalar = lambda p: ctypes.cast(p, ctypes.POINTER(ctypes.c_float))[0]  # noqa: E731
    a = (_column_major(A, k, m, lda, a_type).T if ta == OP_T
         else _column_major(A, m, k, lda, a_type))
    b = (_column_major(B, n, k, ldb, b_type).T if tb == OP_T
         else _column_major(B, k, n, ldb, b_type))
    c = _column_major(C, m, n, ldc, c_type)
    got = scalar(alpha) * (wide(a) @ wide(b)) + scalar(beta) * wide(c)
    c[...] = to_bf16(got) if c_type == R_16BF else got


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
    CublasGemm(_gemm_ex, tf32=False)(HostArray(a), HostArray(b), HostArray(out),
                                       ta=ta, tb=tb, add=add)
    numpy_gemm(a, b, want, ta=ta, tb=tb, add=add)
    np.testing.assert_allclose(out, want, rtol=1e-6)


def test_cublas_binding_refuses_a_column_strided_operand():
    a = np.ones((4, 8), np.float32)[:, ::2]
    with pytest.raises(ValueError, match="unit column stride"):
        CublasGemm(_gemm_ex, tf32=False)(HostArray(a), HostArray(np.ones((4, 4), np.float32)),
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
    CublasGemm(_gemm_ex, tf32=True)(HostArray(a), HostArray(b), HostArray(out),
                                      ta=ta, tb=tb, add=add)
    # one bf16 rounding apart at most (numpy may sum the transposed product in another order)
    np.testing.assert_allclose(from_bf16(out), from_bf16(want), rtol=2.0 ** -8, atol=1e-6)
    # bf16 operands sum in float32 (CUBLAS_COMPUTE_32F), whatever training.tf32 says
    assert calls == [(R_16BF, COMPUTE_32F)]


def test_fp32_gemms_keep_tf32_compute():
    calls.clear()
    a = np.ones((2, 2), np.float32)
    CublasGemm(_gemm_ex, tf32=True)(HostArray(a), HostArray(a), HostArray(a.copy()))
    assert calls == [(R_32F, COMPUTE_32F_FAST_TF32)]


def test_cublas_binding_refuses_mixed_dtypes():
    a = np.ones((2, 2), np.float32)
    with pytest.raises(ValueError, match="one dtype"):
        CublasGemm(_gemm_ex, tf32=False)(HostArray(a), HostArray(to_bf16(a)), HostArray(a))


# -- cuBLASLt (runtime/engine/gemm.py LtGemm) through a stand-in of nvmath.bindings.cublasLt -------


class FakeLt:
    """The part of nvmath.bindings.cublasLt that LtGemm calls, over host memory: descriptors
    and layouts as dicts of the attribute values written through the pointers it is given,
    cublasLtMatmul as cuBLAS defines it (column-major, D = alpha·op(A)·op(B) + beta·C, then
    the epilogue: BIAS adds a vector over D's rows to every column, BGRADB writes the sums
    over k of op(B), one per column of D, and wants transb = T)."""
    MatmulDescAttribute = enum.IntEnum("MatmulDescAttribute",
                                       "TRANSA TRANSB EPILOGUE BIAS_POINTER")
    MatmulPreferenceAttribute = enum.IntEnum("MatmulPreferenceAttribute", [
        "MAX_WORKSPACE_BYTES", *(f"MIN_ALIGNMENT_{x}_BYTES" for x in "ABCD")])
    Epilogue = enum.IntEnum("Epilogue", {"DEFAULT": 1, "BIAS": 4, "BGRADB": 512})
    matmul_heuristic_result_dtype = np.dtype([
        ("algo", np.uint64, (8,)), ("workspace_size", np.uint64), ("state", np.int32),
        ("waves_count", np.float32), ("reserved", np.int32, (4,))])

    class MatmulHeuristicResult:
        def __init__(self, size=1):
            self._data = np.zeros(size, FakeLt.matmul_heuristic_result_dtype)

        @property
        def ptr(self):
            return self._data.ctypes.data

    def __init__(self, algorithms: int = 1):
        self.algorithms = algorithms
        self.objects: dict[int, dict] = {}
        self.heuristics: list[dict] = []
        self.calls: list[dict] = []

    def get_version(self):
        return 130000

    def get_matmul_desc_attribute_dtype(self, attr):
        return np.intp if attr == self.MatmulDescAttribute.BIAS_POINTER else \
            np.uint32 if attr == self.MatmulDescAttribute.EPILOGUE else np.int32

    def get_matmul_preference_attribute_dtype(self, attr):
        P = self.MatmulPreferenceAttribute
        return np.uint64 if attr == P.MAX_WORKSPACE_BYTES else np.uint32

    def _new(self, **fields) -> int:
        self.objects[len(self.objects) + 1] = fields
        return len(self.objects)

    def _write(self, obj, names, dtype_of, attr, buf, size):
        dtype = np.dtype(dtype_of(attr))
        assert size == dtype.itemsize, f"{names(attr).name}: {size} bytes, want {dtype.itemsize}"
        value = np.frombuffer(ctypes.string_at(buf, size), dtype)[0].item()
        self.objects[obj][names(attr).name] = value

    def matmul_desc_create(self, compute, scale):
        return self._new(compute=compute, scale=scale, TRANSA=0, TRANSB=0, EPILOGUE=1,
                         BIAS_POINTER=0)

    def matmul_desc_set_attribute(self, desc, attr, buf, size):
        self._write(desc, self.MatmulDescAttribute, self.get_matmul_desc_attribute_dtype, attr,
                    buf, size)

    def matrix_layout_create(self, kind, rows, cols, ld):
        return self._new(kind=kind, rows=rows, cols=cols, ld=ld)

    def matmul_preference_create(self):
        return self._new()

    def matmul_preference_set_attribute(self, pref, attr, buf, size):
        self._write(pref, self.MatmulPreferenceAttribute,
                    self.get_matmul_preference_attribute_dtype, attr, buf, size)

    def matmul_preference_destroy(self, pref):
        self.heuristics.append(self.objects.pop(pref))

    def matmul_algo_get_heuristic(self, handle, desc, a, b, c, d, pref, requested, results, found):
        assert requested == 1 and c == d
        ctypes.cast(found, ctypes.POINTER(ctypes.c_int32))[0] = self.algorithms

    def _matrix(self, ptr, layout):
        return _column_major(ptr, layout["rows"], layout["cols"], layout["ld"], layout["kind"])

    def matmul(self, handle, desc, alpha, A, la, B, lb, beta, C, lc, D, ld, algo, ws, ws_size,
               stream):
        assert C == D and lc == ld, "LtGemm writes the product over C"
        op = dict(self.objects[desc])
        self.calls.append(dict(op, algo=algo, workspace=(ws, ws_size), stream=stream))
        la, lb, ld = (self.objects[x] for x in (la, lb, ld))
        kind = ld["kind"]
        wide = from_bf16 if kind == R_16BF else (lambda x: x)
        a, b = self._matrix(A, la), self._matrix(B, lb)
        a, b = (a.T if op["TRANSA"] == OP_T else a), (b.T if op["TRANSB"] == OP_T else b)
        scalar = lambda p: ctypes.cast(p, ctypes.POINTER(ctypes.c_float))[0]  # noqa: E731
        d = self._matrix(D, ld)
        got = scalar(alpha) * (wide(a) @ wide(b)) + scalar(beta) * wide(d)
        rows, cols = d.shape
        vector = lambda n: np.ctypeslib.as_array(  # noqa: E731
            ctypes.cast(op["BIAS_POINTER"], ctypes.POINTER(_ELEMENT[kind])), shape=(n,))
        if op["EPILOGUE"] == self.Epilogue.BIAS:
            got = got + wide(vector(rows))[:, None]
        elif op["EPILOGUE"] == self.Epilogue.BGRADB:
            assert op["TRANSB"] == OP_T, "BGRADB wants transb = T"
            sums = wide(b).sum(axis=0)
            vector(cols)[...] = to_bf16(sums) if kind == R_16BF else sums
        d[...] = to_bf16(got) if kind == R_16BF else got


def _lt(fake=None, tf32=False, workspace=None):
    ctx = gemm.LtContext(fake or FakeLt(), handle=7, stream=lambda: 5)
    return gemm.LtGemm(ctx, tf32, workspace), ctx.lt


def _operands(rng, ta, tb, dtype=np.float32):
    M, K, N = 5, 7, 3
    a = rng.standard_normal((K, M) if ta else (M, K)).astype(np.float32)
    # b as a row block of a wider matrix: a leading dimension larger than its width
    wide = rng.standard_normal((N + 4, K + 2) if tb else (K + 4, N + 2)).astype(np.float32)
    b = wide[2:2 + N, :K] if tb else wide[1:1 + K, :N]
    out = rng.standard_normal((M, N)).astype(np.float32)
    if dtype == np.uint16:
        a, b, out = (to_bf16(x) for x in (a, b, out))
    return a, b, out


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
@pytest.mark.parametrize("add", [False, True])
def test_lt_binding_computes_what_numpy_computes(ta, tb, add):
    a, b, out = _operands(np.random.default_rng(0), ta, tb)
    want = out.copy()
    lt_gemm, fake = _lt()
    lt_gemm(HostArray(a), HostArray(b), HostArray(out), ta=ta, tb=tb, add=add)
    numpy_gemm(a, b, want, ta=ta, tb=tb, add=add)
    np.testing.assert_allclose(out, want, rtol=1e-6)
    assert fake.calls[0]["EPILOGUE"] == FakeLt.Epilogue.DEFAULT


@pytest.mark.parametrize("dtype", [np.float32, np.uint16])
@pytest.mark.parametrize("add", [False, True])
def test_the_bias_epilogue_adds_the_bias_to_every_row_in_one_rounding(dtype, add):
    rng = np.random.default_rng(1)
    x, w, y = _operands(rng, False, True, dtype)                 # y = x·wᵀ (+ y) + b
    b = rng.standard_normal(3).astype(np.float32)
    b = to_bf16(b) if dtype == np.uint16 else b
    wide = from_bf16 if dtype == np.uint16 else (lambda v: v)
    want = wide(x) @ wide(w).T + (wide(y) if add else 0) + wide(b)
    lt_gemm, fake = _lt()
    lt_gemm(HostArray(x), HostArray(w), HostArray(y), tb=True, add=add, bias=HostArray(b))
    # bf16: the float32 sum rounded once, within half a bf16 step of it (2^-8 relative)
    np.testing.assert_allclose(wide(y), want, rtol=2.0 ** -8 if dtype == np.uint16 else 1e-6,
                               atol=1e-6)
    call = fake.calls[0]
    assert (call["EPILOGUE"], call["BIAS_POINTER"]) == (FakeLt.Epilogue.BIAS, b.ctypes.data)


@pytest.mark.parametrize("dtype", [np.float32, np.uint16])
@pytest.mark.parametrize("add", [False, True])
def test_the_bias_gradient_epilogue_writes_db_beside_dw(dtype, add):
    rng = np.random.default_rng(2)
    dy, x, dw = _operands(rng, True, False, dtype)               # dw (+)= dyᵀ·x, db = 1ᵀ·dy
    db = np.full(5, 3, dtype)                                    # written over, never added to
    want_dw, want_db = dw.copy(), np.zeros(5, dtype)
    wide = from_bf16 if dtype == np.uint16 else (lambda v: v)
    lt_gemm, fake = _lt()
    lt_gemm(HostArray(dy), HostArray(x), HostArray(dw), ta=True, add=add, dbias=HostArray(db))
    want_dw = wide(dy).T @ wide(x) + (wide(want_dw) if add else 0)
    want_db = wide(dy).sum(axis=0)
    tol = dict(rtol=2.0 ** -8, atol=1e-6) if dtype == np.uint16 else dict(rtol=1e-6)
    np.testing.assert_allclose(wide(dw), want_dw, **tol)
    np.testing.assert_allclose(wide(db), want_db, **tol)
    assert fake.calls[0]["EPILOGUE"] == FakeLt.Epilogue.BGRADB


def test_numpy_gemm_is_the_epilogues_reference():
    rng = np.random.default_rng(3)
    dy, x, w, b = (rng.standard_normal(s) for s in ((6, 4), (6, 3), (4, 3), 4))
    dw, db, y = np.zeros((4, 3)), np.zeros(4), np.zeros((6, 4))
    numpy_gemm(dy, x, dw, ta=True, dbias=db)
    np.testing.assert_allclose(dw, dy.T @ x)
    np.testing.assert_allclose(db, np.ones(6) @ dy)
    numpy_gemm(x, w, y, tb=True, bias=b)
    np.testing.assert_allclose(y, x @ w.T + b[None, :])


@pytest.mark.parametrize("kw, match", [
    (dict(bias=np.zeros(4, np.float32)), "bias: want 3"),
    (dict(dbias=np.zeros(5, np.float32)), "wants ta=True"),
    (dict(bias=np.zeros(3, np.float32), dbias=np.zeros(5, np.float32)), "one epilogue"),
    (dict(bias=np.zeros(3, np.float64)), "bias: want 3 contiguous float32"),
])
def test_the_lt_binding_refuses_an_epilogue_it_cannot_run(kw, match):
    x, w, y = _operands(np.random.default_rng(4), False, True)
    with pytest.raises(ValueError, match=match):
        _lt()[0](HostArray(x), HostArray(w), HostArray(y), tb=True,
                 **{k: HostArray(v) for k, v in kw.items()})


def test_an_lt_plan_is_made_once_and_each_call_sets_its_own_bias():
    rng = np.random.default_rng(5)
    workspace = np.zeros(4096, np.uint8)
    lt_gemm, fake = _lt(workspace=HostArray(workspace))
    x, w, y = _operands(rng, False, True)
    biases = [rng.standard_normal(3).astype(np.float32) for _ in range(2)]
    for b in biases:
        lt_gemm(HostArray(x), HostArray(w), HostArray(y), tb=True, bias=HostArray(b))
    lt_gemm(HostArray(x), HostArray(w), HostArray(y), tb=True)   # another epilogue: its own plan
    assert len(fake.heuristics) == 2
    assert fake.heuristics[0]["MAX_WORKSPACE_BYTES"] == 4096 - 256   # a margin for epilogues
    assert fake.heuristics[0]["MIN_ALIGNMENT_D_BYTES"] == min(256, y.ctypes.data & -y.ctypes.data)
    assert [c["BIAS_POINTER"] for c in fake.calls[:2]] == [b.ctypes.data for b in biases]
    assert {c["stream"] for c in fake.calls} == {5}
    assert {c["workspace"] for c in fake.calls} == {(workspace.ctypes.data, 4096)}
    # the algorithm passed is the heuristic result's, not a copy made per call
    assert fake.calls[0]["algo"] == fake.calls[1]["algo"] != fake.calls[2]["algo"]


def test_lt_sums_bf16_in_float32_and_float32_in_tf32_if_asked():
    rng = np.random.default_rng(6)
    for dtype, tf32, compute in ((np.uint16, True, COMPUTE_32F), (np.float32, True,
                                 COMPUTE_32F_FAST_TF32), (np.float32, False, COMPUTE_32F)):
        lt_gemm, fake = _lt(tf32=tf32)
        lt_gemm(*(HostArray(v) for v in _operands(rng, False, False, dtype)))
        assert (fake.calls[0]["compute"], fake.calls[0]["scale"]) == (compute, R_32F)


def test_a_shape_without_an_lt_algorithm_is_one_error_naming_the_fallback():
    x, w, y = _operands(np.random.default_rng(7), False, True)
    with pytest.raises(EulerError, match="no algorithm .* EULERGEN_GEMM=cublas"):
        _lt(FakeLt(algorithms=0))[0](HostArray(x), HostArray(w), HostArray(y), tb=True)


# -- the choice --------------------------------------------------------------------------


class _HostCupy:
    """What gemm's choice and probe use of CuPy, over host arrays."""
    asarray = staticmethod(lambda h: HostArray(np.array(h)))
    asnumpy = staticmethod(lambda d: d.a)
    cuda = SimpleNamespace(get_current_stream=lambda: SimpleNamespace(ptr=9))


class _Wrong(FakeLt):
    """A cuBLASLt whose bias epilogue adds nothing."""

    def matmul(self, *args):
        desc = self.objects[args[1]]
        epilogue, desc["EPILOGUE"] = desc["EPILOGUE"], self.Epilogue.DEFAULT
        super().matmul(*args)
        desc["EPILOGUE"] = epilogue


@pytest.fixture
def choose(monkeypatch):
    """gemm's choice made afresh on a stand-in CuPy, with `bindings` as nvmath's cuBLASLt
    (None: nvmath not installed), EULERGEN_GEMM set to `mode` and EULERGEN_GEMM_SEARCH to
    `search` (None: unset, the default)."""
    def choose(bindings, mode=None, search="off"):
        monkeypatch.setitem(sys.modules, "cupy", _HostCupy)
        if search is None:
            monkeypatch.delenv("EULERGEN_GEMM_SEARCH", raising=False)
        else:
            monkeypatch.setenv("EULERGEN_GEMM_SEARCH", search)
        if bindings is None:
            monkeypatch.setitem(sys.modules, "nvmath", None)
        else:
            nvmath = SimpleNamespace(bindings=SimpleNamespace(cublasLt=bindings))
            monkeypatch.setitem(sys.modules, "nvmath", nvmath)
            monkeypatch.setitem(sys.modules, "nvmath.bindings", nvmath.bindings)
            monkeypatch.setattr(bindings, "create", lambda: 11, raising=False)
        if mode is None:
            monkeypatch.delenv("EULERGEN_GEMM", raising=False)
        else:
            monkeypatch.setenv("EULERGEN_GEMM", mode)
        gemm._cuda_choice.cache_clear()
        return gemm._cuda_choice()
    yield choose
    gemm._cuda_choice.cache_clear()


def test_without_nvmath_the_gpu_runs_cublas_gemm_ex_and_says_why(choose):
    choice = choose(None)
    assert choice.lt is None and "nvmath" in choice.why
    with pytest.raises(EulerError, match="EULERGEN_GEMM: cuBLASLt cannot run"):
        choose(None, "lt")


def test_a_working_cublaslt_is_chosen_once_it_passes_the_probe(choose):
    choice = choose(FakeLt())
    assert choice.lt is not None and choice.why == "cuBLASLt 130000 with bias epilogues"
    assert choice.lt.handle == 11 and choice.lt.stream() == 9


def test_by_default_the_choice_times_each_shape_and_says_so(choose, monkeypatch, tmp_path):
    made = []
    monkeypatch.setattr(gemm_search, "for_device", lambda version: made.append(version) or
                        gemm_search.Search(gemm_search.Record(tmp_path / "g.json")))
    choice = choose(FakeLt(), search=None)
    assert made == [130000] and isinstance(choice.lt.search, gemm_search.Search)
    assert choice.why == ("cuBLASLt 130000 with bias epilogues, algorithms timed per shape "
                          "(EULERGEN_GEMM_SEARCH)")
    assert choose(FakeLt()).lt.search is None


def test_a_cublaslt_that_computes_wrong_is_not_used(choose):
    choice = choose(_Wrong())
    assert choice.lt is None and "probe's bf16 x·wᵀ + b differs" in choice.why


@pytest.mark.parametrize("mode, lt", [("cublas", False), ("auto", True), ("lt", True)])
def test_eulergen_gemm_picks_the_path(choose, mode, lt):
    assert (choose(FakeLt(), mode).lt is not None) == lt


def test_an_unknown_eulergen_gemm_is_one_error(choose):
    with pytest.raises(EulerError, match="EULERGEN_GEMM: 'fast': want one of auto, lt, cublas"):
        choose(FakeLt(), "fast")


def test_the_numpy_backend_plans_no_gemm_workspace_and_takes_no_epilogues():
    assert gemm.gemm_for(NUMPY, tf32=False) is numpy_gemm and not numpy_gemm.epilogues
    assert gemm.workspace_bytes(NUMPY) == 0 and gemm.describe(NUMPY) == "numpy"
