"""The tape: a model's forward pass as a list of nodes, and its backward as that list reversed.

Every node is built once, over views of planned buffers, so running the tape allocates
nothing. The only backward math written here by hand is what has no formula to derive
(DESIGN.md, invariant 1): a GEMM's backward is two GEMMs, a residual stream's fan-in is a
sum (which the norms' `add` backward does in its pass). Every other backward is
`lib.backward` of an op: a generated one, or the embedding (templates/embedding.cu.j2: a
deterministic scatter-add).

A node writes each gradient either over its destination (the first writer of that
buffer in backward order) or adds into it (later writers: residual fan-in, the tied
embedding, and parameter gradients on the second and later micro-steps of gradient
accumulation).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eulergen.runtime import bf16


@dataclass(frozen=True)
class Grad:
    """Where a node puts one gradient. `param` gradients are overwritten on a step's first
    micro-step and accumulated on the later ones; others follow `add` alone."""
    buf: object
    add: bool = False
    param: bool = False


class Tape:
    def __init__(self, backend, lib, scratch, kernel_ws=None, *, tf32: bool = False):
        self.backend = backend
        self.xp = backend.xp
        self.lib = lib
        self.nodes: list = []
        self.accumulating = False   # True on micro-steps after the first
        self._scratch = scratch     # flat workspace for gradients that are added, not written
        self.kernel_ws = kernel_ws  # float32 workspace the generated backward kernels share
        self.gemm = CublasGemm.for_cupy(self.xp, tf32) if backend.is_gpu else numpy_gemm

    def record(self, node):
        self.nodes.append(node)
        return node

    def forward(self) -> None:
        for node in self.nodes:
            node.forward(self)

    def backward(self) -> None:
        for node in reversed(self.nodes):
            node.backward(self)

    def adds(self, g: Grad) -> bool:
        return g.add or (g.param and self.accumulating)

    def add(self, a, b, out) -> None:
        """out = a + b in the storage dtype (bf16: widened, added in float32, rounded once)."""
        if out.dtype == np.uint16:
            bf16.add(a, b, out)
        else:
            self.xp.add(a, b, out=out)

    def targets(self, grads) -> tuple:
        """Where a call writes each of `grads`: its buffer, or, where it is added, a view
        of the scratch workspace that `land` then adds into the buffer."""
        adds = [self.adds(g) for g in grads]
        temps = iter(self.scratch([g.buf.shape for g, a in zip(grads, adds) if a]))
        return tuple(next(temps) if a else g.buf for g, a in zip(grads, adds))

    def land(self, grads, targets) -> None:
        for g, t in zip(grads, targets):
            if t is not g.buf:
                self.add(g.buf, t, g.buf)

    def scratch(self, shapes) -> list:
        """Consecutive views of the scratch workspace, one per shape, valid until the next call."""
        views, at = [], 0
        for shape in shapes:
            n = int(np.prod(shape))
            if at + n > self._scratch.size:
                raise RuntimeError(f"scratch workspace too small: need {at + n}, "
                                   f"planned {self._scratch.size}")
            views.append(self._scratch[at:at + n].reshape(shape))
            at += n
        return views


# -- GEMM -----------------------------------------------------------------------------


def numpy_gemm(a, b, out, *, ta=False, tb=False, add=False) -> None:
    """out (+)= op(a) @ op(b) for 2-D arrays; op transposes when ta / tb."""
    a = a.T if ta else a
    b = b.T if tb else b
    if add:
        out += a @ b
    else:
        np.matmul(a, b, out=out)


class CublasGemm:
    """out (+)= op(a) @ op(b) through cublasGemmEx, so that accumulation is cuBLAS's beta=1
    (no temporary). float32 arrays: fp32 or TF32 tensor-core compute (training.tf32);
    bf16 arrays (uint16 bits, all three): bf16 operands, float32 accumulation and scaling
    (CUBLAS_COMPUTE_32F), the result rounded once to bf16, as torch's autocast matmul.

    cuBLAS is column-major: a row-major [r, c] array is its column-major transpose, so
    C = A·B row-major is computed as Cᵀ = Bᵀ·Aᵀ with the operands swapped."""

    # cublas_api.h / library_types.h values, stable since CUDA 11
    OP_N, OP_T, R_32F, R_16BF, COMPUTE_32F, COMPUTE_32F_FAST_TF32, GEMM_DEFAULT = \
        0, 1, 0, 14, 68, 77, -1
    TYPES = {np.dtype(np.float32): R_32F, np.dtype(np.uint16): R_16BF}

    def __init__(self, gemm_ex, handle, tf32: bool):
        self.gemm_ex, self.handle = gemm_ex, handle
        self.compute = self.COMPUTE_32F_FAST_TF32 if tf32 else self.COMPUTE_32F
        self.one = np.array(1.0, np.float32)    # host scalars: cuBLAS's default pointer mode
        self.zero = np.array(0.0, np.float32)

    @classmethod
    def for_cupy(cls, cupy, tf32: bool) -> CublasGemm:
        from cupy_backends.cuda.libs import cublas
        return cls(cublas.gemmEx, cupy.cuda.device.get_cublas_handle(), tf32)

    def __call__(self, a, b, out, *, ta=False, tb=False, add=False) -> None:
        kind = self.TYPES.get(out.dtype)
        for x in (a, b, out):
            if (x.ndim != 2 or x.dtype != out.dtype or kind is None
                    or x.strides[1] != x.dtype.itemsize):
                raise ValueError(f"gemm wants 2-D float32 or bf16 (uint16) arrays of one dtype "
                                 f"with unit column stride, got {x.shape} {x.dtype} strides "
                                 f"{x.strides} (out: {out.dtype})")
        m, k = (a.shape[1], a.shape[0]) if ta else a.shape
        k2, n = (b.shape[1], b.shape[0]) if tb else b.shape
        if k != k2 or out.shape != (m, n):
            raise ValueError(f"gemm shapes: op(a) {m}x{k}, op(b) {k2}x{n}, out {out.shape}")
        size = out.dtype.itemsize
        self.gemm_ex(
            self.handle, self.OP_T if tb else self.OP_N, self.OP_T if ta else self.OP_N, n, m, k,
            self.one.ctypes.data, b.data.ptr, kind, b.strides[0] // size,
            a.data.ptr, kind, a.strides[0] // size,
            (self.one if add else self.zero).ctypes.data, out.data.ptr, kind,
            out.strides[0] // size, self.compute if kind == self.R_32F else self.COMPUTE_32F,
            self.GEMM_DEFAULT)


def cublas_nrm2(x) -> float:
    """‖x‖₂ of a contiguous float32 CuPy vector by cublasSnrm2 into a host scalar (cuBLAS's
    default host pointer mode, as CublasGemm's scalars; the call returns once the result
    is there). Nothing is allocated on the device."""
    import cupy
    from cupy_backends.cuda.libs import cublas
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        raise ValueError(f"nrm2 wants a contiguous float32 array, got {x.dtype} {x.strides}")
    result = np.zeros((), np.float32)
    cublas.snrm2(cupy.cuda.device.get_cublas_handle(), x.size, x.data.ptr, 1,
                 result.ctypes.data)
    return float(result)


# -- nodes ----------------------------------------------------------------------------


class Linear:
    """y = x @ w.T (+ b), torch's nn.Linear orientation. Backward: dx = dy @ w, dw = dy.T @ x,
    db = 1ᵀ·dy (as a GEMM against a ones vector, so it is deterministic on cuBLAS too).

    In bf16 the bias is written first, as the rank-1 GEMM 1·b, and the product added to it
    by the GEMM's beta = 1: x·wᵀ + b is summed in float32 and rounded once."""

    def __init__(self, x, w, y, dy, dx: Grad | None, dw: Grad, b=None, db: Grad | None = None,
                 ones=None):
        self.x, self.w, self.y, self.b = x, w, y, b
        self.dy, self.dx, self.dw, self.db = dy, dx, dw, db
        self.ones = ones    # [1, rows] of 1.0, planned

    def forward(self, tape: Tape) -> None:
        if self.b is not None and self.y.dtype == np.uint16:
            tape.gemm(self.ones, self.b.reshape(1, -1), self.y, ta=True)
            tape.gemm(self.x, self.w, self.y, tb=True, add=True)
            return
        tape.gemm(self.x, self.w, self.y, tb=True)
        if self.b is not None:
            tape.xp.add(self.y, self.b, out=self.y)

    def backward(self, tape: Tape) -> None:
        if self.dx is not None:
            tape.gemm(self.dy, self.w, self.dx.buf, add=tape.adds(self.dx))
        tape.gemm(self.dy, self.x, self.dw.buf, ta=True, add=tape.adds(self.dw))
        if self.db is not None:
            tape.gemm(self.ones, self.dy, self.db.buf.reshape(1, -1), add=tape.adds(self.db))


class Op:
    """A generated op: forward through `lib.forward`, backward through `lib.backward`, with
    its manifest entry `op` (resolved once, not looked up by name at each call) and the
    fused variant `fusion` of it, if any (the activation's 'bias': inputs x…, then b…).

    `saved` are the arrays the op's backward reads besides its inputs and output grads:
    attention's (o, lse), for which the backward signature is (q, k, v, o, lse, do)."""

    def __init__(self, op, inputs, outputs, douts, dins, params: dict, saved=(),
                 fusion: str = ""):
        self.op, self.inputs, self.outputs, self.params = op, inputs, outputs, params
        self.douts, self.dins, self.saved, self.fusion = douts, dins, saved, fusion

    def forward(self, tape: Tape) -> None:
        tape.lib.forward(self.op, *self.inputs, out=tuple(self.outputs), fusion=self.fusion,
                         **self.params)

    def backward(self, tape: Tape) -> None:
        targets = tape.targets(self.dins)
        tape.lib.backward(self.op, *self.inputs, *self.saved, *self.douts, out=targets,
                          workspace=tape.kernel_ws, fusion=self.fusion, **self.params)
        tape.land(self.dins, targets)


class Norm:
    """y = norm(x), a row op of one row input, or with a `branch` (the op's `add` fusion)
    h = x + branch written beside y = norm(h), in one pass: `outputs` are (y,) or (h, y).

    Backward at the row the op normalized (x, or h): where dx adds (the residual stream's
    gradient, which later nodes have written) the op's `add` backward adds the norm's dx
    to it in the same pass, reading it as the stream's incoming gradient and writing it in
    place; where dx is the stream gradient's first writer, the op's own backward. Weight
    gradients are written or added as their Grads say."""

    def __init__(self, op, x, branch, weights, outputs, params: dict, dy=None,
                 dx: Grad | None = None, dweights=()):
        self.op, self.x, self.branch, self.weights = op, x, branch, tuple(weights)
        self.outputs, self.params = tuple(outputs), params
        self.dy, self.dx, self.dweights = dy, dx, tuple(dweights)
        self.row = x if branch is None else self.outputs[0]

    def forward(self, tape: Tape) -> None:
        if self.branch is None:
            tape.lib.forward(self.op, self.x, *self.weights, out=self.outputs, **self.params)
        else:
            tape.lib.forward(self.op, self.x, self.branch, *self.weights, out=self.outputs,
                             fusion="add", **self.params)

    def backward(self, tape: Tape) -> None:
        weights = tape.targets(self.dweights)
        dx = self.dx.buf
        if tape.adds(self.dx):
            tape.lib.backward(self.op, self.row, *self.weights, self.dy, dx, out=(dx, *weights),
                              workspace=tape.kernel_ws, fusion="add", **self.params)
        else:
            tape.lib.backward(self.op, self.row, *self.weights, self.dy, out=(dx, *weights),
                              workspace=tape.kernel_ws, **self.params)
        tape.land(self.dweights, weights)


class Embedding:
    """out = table[ids] (+ positions[:T] broadcast over the batch): the op library's
    embedding, forward and backward.

    Backward: dtable[ids[i]] (+)= dout[i] summed in token order per id (deterministic),
    dpositions (+)= Σ_batch dout; each gradient is added or written as its Grad says (the
    table's is added: the tied LM head, later in the forward pass, writes it first). The
    sort the backward needs lives in the tape's kernel workspace. `op`: the embedding
    op's manifest entry."""

    def __init__(self, op, ids, table, out, dout, dtable: Grad | None, positions=None,
                 dpositions: Grad | None = None):
        self.op, self.ids, self.table, self.out, self.dout = op, ids, table, out, dout
        self.dtable, self.positions, self.dpositions = dtable, positions, dpositions

    def forward(self, tape: Tape) -> None:
        tape.lib.forward(self.op, self.ids, self.table, self.positions, out=self.out)

    def backward(self, tape: Tape) -> None:
        dpos = self.dpositions
        adds = (tape.adds(self.dtable), dpos is not None and tape.adds(dpos))
        tape.lib.backward(self.op, self.ids, self.table, self.positions, self.dout,
                          out=(self.dtable.buf, None if dpos is None else dpos.buf),
                          accumulate=adds, workspace=tape.kernel_ws)
