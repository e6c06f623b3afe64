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

from eulergen.runtime.engine import bf16
from eulergen.runtime.engine.gemm import gemm_for


@dataclass(frozen=True)
class Grad:
    """Where a node puts one gradient. `param` gradients are overwritten on a step's first
    micro-step and accumulated on the later ones; others follow `add` alone."""
    buf: object
    add: bool = False
    param: bool = False


class Tape:
    """`gemm_ws`: the planned GEMM workspace of a GPU tape (cuBLAS's and cuBLASLt's,
    runtime/engine/cublas.py), or None; `gemm`: another GEMM (the decoder's)."""

    def __init__(self, backend, lib, scratch, kernel_ws=None, *, tf32: bool = False,
                 gemm=None, gemm_ws=None):
        self.backend = backend
        self.xp = backend.xp
        self.lib = lib
        self.nodes: list = []
        self.accumulating = False   # True on micro-steps after the first
        self._scratch = scratch     # flat workspace for gradients that are added, not written
        self.kernel_ws = kernel_ws  # float32 workspace the generated backward kernels share
        # runtime/engine/gemm.py chooses the library; both are capturable, on the model's own
        # cuBLAS handle (`blas`, which also takes the grad norm) and planned workspace
        self.blas = None
        if backend.is_gpu and gemm is None:
            from eulergen.runtime.engine.cublas import Cublas
            self.blas = Cublas(gemm_ws)
        self.gemm = gemm or gemm_for(backend, tf32, gemm_ws, self.blas)
        self.epilogues = self.gemm.epilogues   # whether it takes bias and dbias

    def record(self, node):
        self.nodes.append(node)
        return node

    def forward(self) -> None:
        for node in self.nodes:
            node.forward(self)

    def backward(self, after=None) -> None:
        """The nodes' backward, last to first; `after(i)`, if given, after the i-th (data
        parallel: the buckets whose gradients are final then, runtime/distributed/buckets.py)."""
        for i, node in enumerate(reversed(self.nodes)):
            node.backward(self)
            if after is not None:
                after(i)

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


# -- nodes ----------------------------------------------------------------------------


class Linear:
    """y = x @ w.T (+ b), torch's nn.Linear orientation. Backward: dx = dy @ w, dw = dy.T @ x,
    db = 1ᵀ·dy: a sum over the rows, deterministic.

    With the GEMM's epilogues (cuBLASLt) the bias is added inside the forward GEMM and db
    written by the dW GEMM, unless db is added to (a later micro-step: the epilogue only
    writes) or of another dtype than dy (autocast's float32 gradients: the epilogue writes
    dy's), when it is the GEMM 1ᵀ·dy against the planned `ones` with beta = 1. Without
    them db is always that GEMM, and in bf16 the bias is written first, as the rank-1
    GEMM 1·b, and the product added to it by the GEMM's beta = 1. Either way x·wᵀ + b is
    summed in float32 and rounded once; fp32 without epilogues adds the bias after."""

    def __init__(self, x, w, y, dy, dx: Grad | None, dw: Grad, b=None, db: Grad | None = None,
                 ones=None):
        self.x, self.w, self.y, self.b = x, w, y, b
        self.dy, self.dx, self.dw, self.db = dy, dx, dw, db
        self.ones = ones    # [1, rows] of 1.0, planned

    def forward(self, tape: Tape) -> None:
        if self.b is not None and tape.epilogues:
            tape.gemm(self.x, self.w, self.y, tb=True, bias=self.b)
        elif self.b is not None and self.y.dtype == np.uint16:
            tape.gemm(self.ones, self.b.reshape(1, -1), self.y, ta=True)
            tape.gemm(self.x, self.w, self.y, tb=True, add=True)
        else:
            tape.gemm(self.x, self.w, self.y, tb=True)
            if self.b is not None:
                tape.xp.add(self.y, self.b, out=self.y)

    def backward(self, tape: Tape) -> None:
        if self.dx is not None:
            tape.gemm(self.dy, self.w, self.dx.buf, add=tape.adds(self.dx))
        db = self.db
        if (db is not None and tape.epilogues and not tape.adds(db)
                and db.buf.dtype == self.dy.dtype):
            tape.gemm(self.dy, self.x, self.dw.buf, ta=True, add=tape.adds(self.dw),
                      dbias=db.buf)
            return
        tape.gemm(self.dy, self.x, self.dw.buf, ta=True, add=tape.adds(self.dw))
        if db is not None:
            tape.gemm(self.ones, self.dy, db.buf.reshape(1, -1), add=tape.adds(db))


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
    gradients are written or added as their Grads say.

    `precision`: the op's precision variant ('autocast': the stream, its gradient and the
    weights float32, the branch, y and dy bf16); `copy`: where its backward also writes dx
    rounded to bf16 (the operand of the GEMMs that read the stream's gradient next), or
    None."""

    def __init__(self, op, x, branch, weights, outputs, params: dict, dy=None,
                 dx: Grad | None = None, dweights=(), precision: str = "", copy=None):
        self.op, self.x, self.branch, self.weights = op, x, branch, tuple(weights)
        self.outputs, self.params = tuple(outputs), params
        self.dy, self.dx, self.dweights = dy, dx, tuple(dweights)
        self.row = x if branch is None else self.outputs[0]
        self.precision, self.copy = precision, copy
        self.keywords = {"precision": precision} if precision else {}

    def forward(self, tape: Tape) -> None:
        if self.branch is None:
            tape.lib.forward(self.op, self.x, *self.weights, out=self.outputs, **self.keywords,
                             **self.params)
        else:
            tape.lib.forward(self.op, self.x, self.branch, *self.weights, out=self.outputs,
                             fusion="add", **self.keywords, **self.params)

    def backward(self, tape: Tape) -> None:
        weights = tape.targets(self.dweights)
        dx = self.dx.buf
        keywords = dict(self.keywords, copy=self.copy) if self.copy is not None else self.keywords
        if tape.adds(self.dx):
            tape.lib.backward(self.op, self.row, *self.weights, self.dy, dx, out=(dx, *weights),
                              workspace=tape.kernel_ws, fusion="add", **keywords, **self.params)
        else:
            tape.lib.backward(self.op, self.row, *self.weights, self.dy, out=(dx, *weights),
                              workspace=tape.kernel_ws, **keywords, **self.params)
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
