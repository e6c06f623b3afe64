"""The GEMMs of every tape: out (+)= op(a) @ op(b) over 2-D row-major arrays (and out =
alpha·op(a)·op(b) + beta·out, the Newton-Schulz steps of a matrix update), and which
library runs them. The choice is made here, once a process, and stated (`describe`):

- numpy: `numpy_gemm`, the reference.
- CUDA with nvmath-python (NVIDIA's bindings of cuBLASLt): `LtGemm`, which also takes the
  bias epilogues, so a Linear with a bias is one GEMM forward, y = x·wᵀ + b (the bias
  added to the float32 accumulator, one rounding), and one backward for dW and db
  (dw = dyᵀ·x with db = 1ᵀ·dy written by the same GEMM). A bias gradient that is added to
  (gradient accumulation's later micro-steps) is not the epilogue's: it writes db. The
  tape then runs 1ᵀ·dy with beta = 1 beside the plain wgrad GEMM, as without epilogues.
- CUDA without it (not installed, a cuBLASLt too old, its handle refused, the start-up
  probe wrong, or EULERGEN_GEMM=cublas): `CublasGemm`, cublasGemmEx through ctypes on
  the tape's own handle (runtime/engine/cublas.py: CuPy's binding refuses a capturing stream), no
  epilogues; the tape writes a bias first as the rank-1 GEMM 1·b and adds the
  product to it by beta = 1 (the same float32 sum, rounded once).

EULERGEN_GEMM: auto (the default: cuBLASLt where it starts), lt (cuBLASLt or an error),
cublas (cublasGemmEx). Both CUDA paths compute in float32 (TF32 tensor cores for float32
arrays when training.tf32) and round once to the output's dtype; bf16 arrays are uint16 bits.
bf16 operands may write a float32 output (autocast's float32 weight gradients; the
sampler's float32 logits), without epilogues.

cuBLASLt's algorithm for each (dtype, compute, transposes, shape, leading dimensions,
alignments, epilogue, workspace) is chosen at the first call: the fastest of its
heuristic's first candidates, timed (runtime/engine/gemm_search.py, kept on disk;
EULERGEN_GEMM_SEARCH=off: the heuristic's first); and kept with its descriptors for the
process; later calls only set the bias pointer and launch on CuPy's current stream into the
caller's workspace, so a call allocates nothing, never syncs and can be captured in a CUDA
graph. The workspace is the model's, planned (WORKSPACE_BYTES in the `gemm` arena, shared
with the cuBLAS handle: one stream).
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy as np

from eulergen import env
from eulergen.errors import EulerError
from eulergen.runtime.engine import bf16, gemm_search
from eulergen.runtime.engine.cublas import WORKSPACE_BYTES

# cublas_api.h / library_types.h values, stable since CUDA 11
OP_N, OP_T = 0, 1
R_32F, R_16BF = 0, 14
COMPUTE_32F, COMPUTE_32F_FAST_TF32 = 68, 77
TYPES = {np.dtype(np.float32): R_32F, np.dtype(np.uint16): R_16BF}

# nvmath-python adds 16 bytes to the workspace an epilogue's algorithm reports (a cuBLASLt
# issue): the heuristic is offered a little less than the buffer holds
_LT_SLACK = 256
# cuBLASLt >= 11.8 has both bias epilogues for every dtype here
_LT_MIN_VERSION = 111103
ENV, SEARCH_ENV = "EULERGEN_GEMM", "EULERGEN_GEMM_SEARCH"
_ONE, _ZERO = np.array(1.0, np.float32), np.array(0.0, np.float32)   # host scalars


def operands(a, b, out, ta: bool, tb: bool) -> tuple[int, int, int, int, int]:
    """(m, n, k, the operands' cuBLAS data type, out's) of out [m, n] = op(a) [m, k] @
    op(b) [k, n]: operands of one dtype, out of theirs or float32 (bf16 logits kept in
    float32 by the sampler); ValueError for arrays cuBLAS cannot read as they lie."""
    kind, out_kind = TYPES.get(a.dtype), TYPES.get(out.dtype)
    for x in (a, b, out):
        if (x.ndim != 2 or b.dtype != a.dtype or kind is None
                or out_kind not in (kind, R_32F) or x.strides[1] != x.dtype.itemsize):
            raise ValueError(f"gemm wants 2-D float32 or bf16 (uint16) operands of one dtype "
                             f"(out: theirs or float32) with unit column stride, got "
                             f"{x.shape} {x.dtype} strides {x.strides} (out: {out.dtype})")
    m, k = (a.shape[1], a.shape[0]) if ta else a.shape
    k2, n = (b.shape[1], b.shape[0]) if tb else b.shape
    if k != k2 or out.shape != (m, n):
        raise ValueError(f"gemm shapes: op(a) {m}x{k}, op(b) {k2}x{n}, out {out.shape}")
    return m, n, k, kind, out_kind


def _vector(v, size: int, out, what: str):
    if v.size != size or v.dtype != out.dtype or not v.flags.c_contiguous:
        raise ValueError(f"gemm {what}: want {size} contiguous {out.dtype}, got {v.shape} "
                         f"{v.dtype} strides {v.strides}")
    return v


def _scalars(add: bool, alpha: float, beta: float | None) -> tuple[float, float]:
    """(alpha, beta) of out = alpha·op(a)·op(b) + beta·out: `add` is beta = 1."""
    if beta is not None and add:
        raise ValueError("gemm: add= is beta=1; give one of them")
    return float(alpha), (1.0 if add else 0.0) if beta is None else float(beta)


class NumpyGemm:
    """The numpy backend's GEMM, and the reference of the epilogues: `bias` [n] is added to
    every row of the product, `dbias` [m] gets the row sums of op(a) (with ta: the column
    sums of a, 1ᵀ·dy). The numpy tape keeps the two-GEMM bias path (`epilogues` False),
    so its training numerics stay as they were. `alpha`, `beta`: out = alpha·product +
    beta·out, each product and the sum rounded to out's dtype."""
    epilogues = False

    def __call__(self, a, b, out, *, ta=False, tb=False, add=False, bias=None, dbias=None,
                 alpha=1.0, beta=None):
        a = a.T if ta else a
        b = b.T if tb else b
        alpha, beta = _scalars(add, alpha, beta)
        if (alpha, beta) == (1.0, 1.0):
            out += a @ b
        elif (alpha, beta) == (1.0, 0.0):
            np.matmul(a, b, out=out)
        else:
            product = a @ b
            np.multiply(out, out.dtype.type(beta), out=out)
            out += out.dtype.type(alpha) * product
        if bias is not None:
            out += bias.reshape(1, -1)
        if dbias is not None:
            np.sum(a, axis=1, out=dbias.reshape(-1))


numpy_gemm = NumpyGemm()


def _compute(kind: int, tf32: bool) -> int:
    """bf16 operands always sum in float32; float32 ones on TF32 tensor cores if asked."""
    return COMPUTE_32F_FAST_TF32 if tf32 and kind == R_32F else COMPUTE_32F


class CublasGemm:
    """out (+)= op(a) @ op(b) through cublasGemmEx, accumulation as cuBLAS's beta = 1 (no
    temporary); no epilogues. cuBLAS is column-major: a row-major [r, c] array is its
    column-major transpose, so C = A·B row-major is computed as Cᵀ = Bᵀ·Aᵀ with the
    operands swapped."""
    epilogues = False
    GEMM_DEFAULT = -1

    def __init__(self, gemm_ex, tf32: bool):
        """`gemm_ex(transb, transa, m, n, k, alpha, …, algo)`: cublasGemmEx on a handle
        (runtime/engine/cublas.py's Cublas.gemm_ex)."""
        self.gemm_ex, self.tf32 = gemm_ex, tf32

    @classmethod
    def for_cupy(cls, tf32: bool, workspace=None, blas=None) -> CublasGemm:
        """On a cuBLAS handle of its own (`blas`, or a new one over `workspace`):
        runtime/engine/cublas.py, callable while a stream captures."""
        from eulergen.runtime.engine.cublas import Cublas
        return cls((blas or Cublas(workspace)).gemm_ex, tf32)

    def __call__(self, a, b, out, *, ta=False, tb=False, add=False, alpha=1.0,
                 beta=None) -> None:
        m, n, k, kind, out_kind = operands(a, b, out, ta, tb)
        size = a.dtype.itemsize
        scale = _host_scalars(*_scalars(add, alpha, beta))   # read by cuBLAS during the call
        self.gemm_ex(
            OP_T if tb else OP_N, OP_T if ta else OP_N, n, m, k,
            scale[0].ctypes.data, b.data.ptr, kind, b.strides[0] // size,
            a.data.ptr, kind, a.strides[0] // size,
            scale[1].ctypes.data, out.data.ptr, out_kind,
            out.strides[0] // out.dtype.itemsize, _compute(kind, self.tf32), self.GEMM_DEFAULT)


def _host_scalars(alpha: float, beta: float) -> tuple:
    """alpha and beta as cuBLAS reads them in host pointer mode: float32 host values (the
    shared ones for the tape's 1 and 0)."""
    known = {1.0: _ONE, 0.0: _ZERO}
    return tuple(known.get(v, np.array(v, np.float32)) for v in (alpha, beta))


# -- cuBLASLt -----------------------------------------------------------------------------


class _LtPlan:
    """One cached GEMM: descriptors, the heuristic's algorithm, and the host buffer the
    bias pointer is set from."""

    def __init__(self, desc, a, b, d, result, algo: int):
        self.desc, self.a, self.b, self.d = desc, a, b, d
        self.result, self.algo = result, algo   # result owns the memory algo points into
        self.vector = np.zeros((), np.intp)


class LtContext:
    """The process's cuBLASLt: the nvmath bindings module `lt`, a handle, and the plans made
    so far. `stream()` is the current stream's handle; `search` (gemm_search.Search) picks
    among the heuristic's candidates, None: its first."""

    def __init__(self, lt, handle: int, stream):
        self.lt, self.handle, self.stream = lt, handle, stream
        self.version = lt.get_version()
        self.search: gemm_search.Search | None = None
        self.plans: dict[tuple, _LtPlan] = {}

    def _set(self, setter, dtype_of, obj, attr, value) -> None:
        buf = np.array(value, dtype=dtype_of(attr))
        setter(obj, attr, buf.ctypes.data, buf.itemsize)

    def plan(self, key: tuple, vector: int, trial=None) -> _LtPlan:
        """The plan of `key` (LtGemm.__call__ builds it, in cuBLAS's column-major terms),
        made at its first call: the heuristic's candidates, one picked by `search`;
        `trial(desc, a, b, d, algo)` times one call of them (None: none may run now)."""
        kind, out_kind, compute, ta, tb, m, n, k, lda, ldb, ldd, epilogue, aligns, workspace = key
        lt, D = self.lt, self.lt.MatmulDescAttribute
        desc = lt.matmul_desc_create(compute, R_32F)
        set_desc = functools.partial(self._set, lt.matmul_desc_set_attribute,
                                     lt.get_matmul_desc_attribute_dtype, desc)
        set_desc(D.TRANSA, OP_T if ta else OP_N)
        set_desc(D.TRANSB, OP_T if tb else OP_N)
        set_desc(D.EPILOGUE, epilogue)
        if vector:   # the heuristic may look at the bias pointer: the first call's
            set_desc(D.BIAS_POINTER, vector)
        a = lt.matrix_layout_create(kind, *((k, m) if ta else (m, k)), lda)
        b = lt.matrix_layout_create(kind, *((n, k) if tb else (k, n)), ldb)
        d = lt.matrix_layout_create(out_kind, m, n, ldd)
        P = lt.MatmulPreferenceAttribute
        pref = lt.matmul_preference_create()
        set_pref = functools.partial(self._set, lt.matmul_preference_set_attribute,
                                     lt.get_matmul_preference_attribute_dtype, pref)
        set_pref(P.MAX_WORKSPACE_BYTES, workspace)
        for attr, align in zip((P.MIN_ALIGNMENT_A_BYTES, P.MIN_ALIGNMENT_B_BYTES,
                                P.MIN_ALIGNMENT_C_BYTES, P.MIN_ALIGNMENT_D_BYTES), aligns):
            set_pref(attr, align)
        wanted = gemm_search.CANDIDATES if self.search else 1
        result, found = lt.MatmulHeuristicResult(wanted), np.zeros(1, np.int32)
        try:
            lt.matmul_algo_get_heuristic(self.handle, desc, a, b, d, d, pref, wanted,
                                         result.ptr, found.ctypes.data)
        except Exception as err:   # cuBLASLtError: NOT_SUPPORTED and the like
            found[0], why = 0, f" ({err})"
        else:
            why = ""
        finally:
            lt.matmul_preference_destroy(pref)
        if found[0] < 1:
            name = lt.Epilogue(epilogue).name
            dtype = "bf16" if kind == R_16BF else "float32"
            if out_kind != kind:
                dtype += " (float32 out)"
            raise EulerError(f"cuBLASLt has no algorithm for a {dtype} GEMM of {m}x{n}x{k} "
                             f"(transposes {ta:d}{tb:d}, epilogue {name}){why}; {ENV}=cublas "
                             "runs cublasGemmEx instead", key=ENV)
        step = lt.matmul_heuristic_result_dtype.itemsize
        algos = [result.ptr + i * step + lt.matmul_heuristic_result_dtype.fields["algo"][1]
                 for i in range(int(found[0]))]
        index = 0
        if self.search is not None:
            size = lt.matmul_algo_dtype.itemsize
            timer = None if trial is None else lambda i: trial(desc, a, b, d, algos[i])
            index = self.search.pick(key, [ctypes.string_at(p, size) for p in algos], timer)
        plan = self.plans[key] = _LtPlan(desc, a, b, d, result, algos[index])
        return plan


def _alignment(ptr: int) -> int:
    """The largest power of two up to 256 that divides an address: what the heuristic may
    assume of it."""
    return min(256, ptr & -ptr) if ptr else 256


class LtGemm:
    """out (+)= op(a) @ op(b) through cublasLtMatmul, with the epilogues of NumpyGemm:
    `bias` (CUBLASLT_EPILOGUE_BIAS) and, with ta, `dbias` (CUBLASLT_EPILOGUE_BGRADB: in
    cuBLAS's terms the reduction over k of op(B), our op(a)). As CublasGemm, the product
    is computed as Cᵀ = Bᵀ·Aᵀ: a row-major [r, c] array is read as column-major [c, r]."""
    epilogues = True

    def __init__(self, ctx: LtContext, tf32: bool, workspace=None):
        self.ctx, self.tf32 = ctx, tf32
        self.workspace = 0 if workspace is None else workspace.data.ptr
        self.workspace_bytes = 0 if workspace is None else workspace.nbytes
        self.offered = max(0, self.workspace_bytes - _LT_SLACK)
        E = ctx.lt.Epilogue
        self.epilogue = {None: int(E.DEFAULT), "bias": int(E.BIAS), "dbias": int(E.BGRADB)}

    def __call__(self, a, b, out, *, ta=False, tb=False, add=False, bias=None, dbias=None,
                 alpha=1.0, beta=None):
        m, n, k, kind, out_kind = operands(a, b, out, ta, tb)
        alpha, beta = _scalars(add, alpha, beta)
        scale = _host_scalars(alpha, beta)
        if out_kind != kind and (bias is not None or dbias is not None):
            raise ValueError(f"gemm: cuBLASLt's epilogues here write the operands' dtype, not "
                             f"{out.dtype}")
        if bias is not None and dbias is not None:
            raise ValueError("gemm: one epilogue at a time (bias or dbias)")
        vector, which = 0, None
        if bias is not None:
            vector, which = _vector(bias, n, out, "bias").data.ptr, "bias"
        elif dbias is not None:
            if not ta:   # cuBLAS's B is our a, and BGRADB wants it transposed
                raise ValueError("gemm dbias: the bias-gradient epilogue wants ta=True")
            vector, which = _vector(dbias, m, out, "dbias").data.ptr, "dbias"
        size = a.dtype.itemsize
        pa, pb, pd = b.data.ptr, a.data.ptr, out.data.ptr   # cuBLAS's A is our b
        key = (kind, out_kind, _compute(kind, self.tf32), tb, ta, n, m, k, b.strides[0] // size,
               a.strides[0] // size, out.strides[0] // out.dtype.itemsize, self.epilogue[which],
               (_alignment(pa), _alignment(pb), _alignment(pd), _alignment(pd)), self.offered)
        ctx = self.ctx
        plan = ctx.plans.get(key)
        if plan is None:
            with gemm_search.Scratch(out.shape[0] * out.strides[0]) as scratch:
                plan = ctx.plan(key, vector, self._trial(pa, pb, pd, scratch if beta else None))
        if vector:
            plan.vector[...] = vector
            ctx.lt.matmul_desc_set_attribute(plan.desc, ctx.lt.MatmulDescAttribute.BIAS_POINTER,
                                             plan.vector.ctypes.data, plan.vector.itemsize)
        ctx.lt.matmul(ctx.handle, plan.desc, scale[0].ctypes.data, pa, plan.a, pb, plan.b,
                      scale[1].ctypes.data, pd, plan.d, pd, plan.d, plan.algo,
                      self.workspace, self.workspace_bytes, ctx.stream())

    def _trial(self, pa: int, pb: int, pd: int, scratch):
        """What times a candidate algorithm of this call (LtContext.plan's `trial`): with
        beta = 0, into out (the call proper writes it after) or, for a call that adds to
        out, into `scratch`. None while the stream captures (nothing may sync) or where
        the scratch cannot be had."""
        ctx = self.ctx
        if ctx.search is None:
            return None
        import cupy
        stream = cupy.cuda.get_current_stream()
        if stream.is_capturing():
            return None

        def trial(desc, a, b, d, algo):
            target = scratch.address() if scratch is not None else pd
            if not target:
                return None
            return gemm_search.time_launches(lambda: ctx.lt.matmul(
                ctx.handle, desc, _ONE.ctypes.data, pa, a, pb, b, _ZERO.ctypes.data, target, d,
                target, d, algo, self.workspace, self.workspace_bytes, stream.ptr), stream)
        return trial


# -- the choice ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Choice:
    """The CUDA GEMM of this process: cuBLASLt (`lt` set) or cublasGemmEx, and why."""
    lt: LtContext | None
    why: str


def open_lt(cupy) -> LtContext:
    """cuBLASLt through nvmath-python on CuPy's current stream; raises what stops it."""
    from nvmath.bindings import cublasLt
    ctx = LtContext(cublasLt, cublasLt.create(), lambda: cupy.cuda.get_current_stream().ptr)
    if ctx.version < _LT_MIN_VERSION:
        raise RuntimeError(f"cuBLASLt {ctx.version} is older than {_LT_MIN_VERSION}, "
                           "which has the bias epilogues")
    return ctx


def probe(gemm, xp) -> str:
    """'' if `gemm` computes the tape's GEMMs with both epilogues as numpy_gemm does, in bf16
    and float32, else what differs. Small integers: every sum is exact in both dtypes."""
    rng = np.random.default_rng(0)
    x, w, dy, b = (rng.integers(-2, 3, s).astype(np.float32)
                   for s in ((64, 32), (48, 32), (64, 48), 48))
    y, dw, db = (np.zeros(s, np.float32) for s in ((64, 48), (48, 32), 48))
    numpy_gemm(x, w, y, tb=True, bias=b)
    numpy_gemm(dy, x, dw, ta=True, dbias=db)
    for name, up, down in (
            ("bf16", lambda h: xp.asarray(bf16.to_bf16(h)),
             lambda d: bf16.from_bf16(xp.asnumpy(d))),
            ("float32", xp.asarray, xp.asnumpy)):
        x_, w_, dy_, b_ = map(up, (x, w, dy, b))
        y_, dw_, db_ = (up(np.full_like(h, 7.0)) for h in (y, dw, db))   # written over
        gemm(x_, w_, y_, tb=True, bias=b_)
        gemm(dy_, x_, dw_, ta=True, dbias=db_)
        for what, want, got in (("x·wᵀ + b", y, y_), ("dyᵀ·x", dw, dw_),
                                ("1ᵀ·dy", db, db_)):
            if not np.array_equal(down(got), want):
                return f"the start-up probe's {name} {what} differs from numpy's"
    return ""


@functools.cache
def _cuda_choice() -> Choice:
    import cupy
    mode = env.get(ENV)
    if mode == "cublas":
        return Choice(None, f"{ENV}=cublas")
    ctx = None
    try:
        ctx = open_lt(cupy)
        wrong = probe(LtGemm(ctx, tf32=True), cupy)
    except Exception as err:   # no nvmath, no libcublasLt, a driver it cannot use
        wrong = f"{type(err).__name__}: {err}"
    if not wrong:
        why = f"cuBLASLt {ctx.version} with bias epilogues"
        if env.get(SEARCH_ENV) == "on":
            ctx.search = gemm_search.for_device(ctx.version)
            why += f", algorithms timed per shape ({SEARCH_ENV})"
        return Choice(ctx, why)
    if mode == "lt":
        raise EulerError(f"cuBLASLt cannot run: {wrong}", key=ENV)
    return Choice(None, f"cuBLASLt not used: {wrong}")


def warm(backend) -> None:
    """Make this process's GEMM choice now (nvmath's import, cuBLASLt's probe: about a
    second), for a caller with a wait ahead of it; the first model would make it anyway."""
    if backend.is_gpu:
        _cuda_choice()


def gemm_for(backend, tf32: bool, workspace=None, blas=None):
    """The GEMM a tape on `backend` calls; `workspace`: the planned GEMM workspace, `blas`
    the tape's cuBLAS handle (runtime/engine/cublas.py) for the cublasGemmEx path."""
    if not backend.is_gpu:
        return numpy_gemm
    choice = _cuda_choice()
    if choice.lt is None:
        return CublasGemm.for_cupy(tf32, workspace, blas)
    return LtGemm(choice.lt, tf32, workspace)


def workspace_bytes(backend) -> int:
    """The GEMM workspace a model on `backend` plans: on a GPU always (a captured step's
    GEMMs must allocate nothing), shared by cuBLAS and cuBLASLt (one stream)."""
    return WORKSPACE_BYTES if backend.is_gpu else 0


def describe(backend) -> str:
    """The GEMM path in a few words, for the run's first line and the profiles."""
    if not backend.is_gpu:
        return "numpy"
    choice = _cuda_choice()
    return choice.why if choice.lt else f"cublasGemmEx ({choice.why})"
