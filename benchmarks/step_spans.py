"""The step profile's instrumentation (benchmarks/step_profile.py): spans between CUDA
events, the timed stand-ins that wrap each tape node, and `instrument(model, spans)`, which
shadows a few of the model's and the tape's methods on their instances (GEMMs, the gradient
adds inside a node, the loss) so the runtime runs unchanged and pays nothing unprofiled."""
from __future__ import annotations

import bisect
import re
import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np


KINDS = ("gemm", "attention fwd", "attention bwd", "norm", "activation", "add", "embedding",
         "loss", "optimizer", "other")


@dataclass(frozen=True)
class Line:
    name: str
    kind: str
    calls: int            # per step
    ms: float             # per step, median over the steps
    flops: float = 0.0    # per step
    nbytes: float = 0.0   # per step


# -- timing ------------------------------------------------------------------------------


class Spans:
    """Nested timed spans of one step: CUDA events on the GPU, perf_counter on numpy."""

    def __init__(self, backend):
        self.gpu = backend.is_gpu
        self.xp = backend.xp
        self.top: list = []
        self._open: list = []

    def _mark(self):
        if not self.gpu:
            return time.perf_counter()
        event = self.xp.cuda.Event()
        event.record()
        return event

    def begin(self, name: str, kind: str, flops: float = 0.0, nbytes: float = 0.0) -> None:
        """Open a span; one inside another is named after it (h.3.attn.c_attn→h.3.q bwd
        wgrad)."""
        if self._open:
            name = f"{self._open[-1]['name']} {name}"
        span = dict(name=name, kind=kind, flops=flops, nbytes=nbytes, inner=[],
                    start=self._mark())
        (self._open[-1]["inner"] if self._open else self.top).append(span)
        self._open.append(span)

    def end(self) -> None:
        self._open.pop()["stop"] = self._mark()

    def timed(self, name: str, kind: str, fn, *args, flops=0.0, nbytes=0.0, **kw):
        self.begin(name, kind, flops, nbytes)
        try:
            return fn(*args, **kw)
        finally:
            self.end()

    def collect(self) -> dict:
        """(name, kind) -> [ms, calls, flops, bytes] of the step, each span's own time
        (less its inner spans'); the spans are cleared for the next step."""
        if self.gpu:
            self.xp.cuda.get_current_stream().synchronize()
        out: dict = defaultdict(lambda: [0.0, 0, 0.0, 0.0])

        def ms(s):
            if self.gpu:
                return self.xp.cuda.get_elapsed_time(s["start"], s["stop"])
            return 1e3 * (s["stop"] - s["start"])

        def walk(spans):
            for s in spans:
                own = ms(s) - sum(ms(i) for i in s["inner"])
                name = re.sub(r"\bh\.\d+\.", "h.*.", s["name"])
                kind = s["kind"]
                if s["inner"]:
                    walk(s["inner"])
                    if kind == "gemm":   # a Linear's work outside cuBLAS (fp32: the bias add)
                        name, kind = f"{name} rest", "other"
                    if own < 1e-3 * len(s["inner"]):   # launch jitter, no work of its own
                        continue
                row = out[(name, kind)]
                row[0] += own
                row[1] += 1
                row[2] += s["flops"]
                row[3] += s["nbytes"]
        walk(self.top)
        self.top = []
        return dict(out)


# -- what each node is -------------------------------------------------------------------


def _ptr(a) -> int:
    return a.data.ptr if hasattr(a.data, "ptr") else a.ctypes.data


class Names:
    """The planned buffer (or parameter) an array is a view of, by its address."""

    def __init__(self, model):
        spans = [(_ptr(v), v.nbytes, name) for name, v in model.params.items()]
        spans += [(_ptr(model.mem[b.name]), b.nbytes, b.name) for b in model.mem.plan.buffers
                  if b.arena not in ("params", "params_bf16")]
        spans.sort()
        self.starts = [s[0] for s in spans]
        self.spans = spans

    def __call__(self, a) -> str:
        at = _ptr(a)
        i = bisect.bisect_right(self.starts, at) - 1
        while i >= 0:
            start, size, name = self.spans[i]
            if at < start + size:
                return name.removesuffix(".weight")
            i -= 1
        return "?"


def _nbytes(arrays) -> int:
    return sum(int(a.nbytes) for a in arrays if a is not None)


def _attention_flops(q) -> float:
    """Causal attention forward: QKᵀ and PV over half the T×T square, 2 FLOPs a MAC."""
    B, T, H, D = q.shape
    return 2.0 * B * H * T * T * D


def _embedding_bytes(node, backward: bool) -> int:
    """The bytes the embedding's kernels move (runtime/engine/kinds/embedding.py). Forward: ids, a table
    row per token (and its position's), the output. The deterministic backward: the sort
    reads the ids and writes int64 keys per token and an int32 first-rank per table row,
    the merge reads and writes the keys, the table kernel reads keys, first-ranks and
    dout and writes every row of dtable, or, adding to it (the tied LM head wrote it
    first), reads and writes the rows of the ids that occur; the positions kernel reads
    dout again and writes dwpe. The ids are read to the host here, outside the timing."""
    n, (V, C) = node.ids.size, node.table.shape
    s = node.table.dtype.itemsize
    pos = node.positions
    if not backward:
        return 4 * n + 2 * n * C * s + (0 if pos is None else n * C * s)
    ids = node.ids.get() if hasattr(node.ids, "get") else node.ids   # CuPy, numpy
    dtable = 2 * np.unique(ids).size * C * s if node.dtable.add else V * C * s
    sort = 4 * n + 8 * n + 4 * V
    merge = 16 * n
    table = 8 * n + 4 * V + n * C * s + dtable
    return sort + merge + table + (0 if pos is None else n * C * s + pos.nbytes)


class Timed:
    """A tape node in a stand-in that times its forward and backward."""

    def __init__(self, node, spans: Spans, names: Names):
        from eulergen.runtime.model import tape
        self.node, self.spans, n = node, spans, node
        flops = (0.0, 0.0)
        if isinstance(n, tape.Linear):   # its bytes and FLOPs: its GEMMs' lines
            self.kind, self.name, nbytes = "gemm", f"{names(n.w)}→{names(n.y)}", (0, 0)
        elif isinstance(n, tape.Op):
            self.kind = {"row": "norm", "pointwise": "activation",
                         "attention": "attention"}.get(n.op.kind, "other")
            self.name = f"{n.op.name}→{','.join(names(o) for o in n.outputs)}"
            nbytes = (_nbytes(n.inputs) + _nbytes(n.outputs),
                      _nbytes(n.inputs) + _nbytes(n.saved) + _nbytes(n.douts)
                      + _nbytes(g.buf for g in n.dins))
            if self.kind == "attention":
                f = _attention_flops(n.inputs[0])
                flops, nbytes = (f, 2.5 * f), (0, 0)
        elif isinstance(n, tape.Norm):   # with a branch: the residual add in the same pass
            self.kind = "norm"
            self.name = f"{n.op.name}→{','.join(names(o) for o in n.outputs)}"
            reads = (n.x,) if n.branch is None else (n.x, n.branch)
            # backward: the row, dy, and dx read too where it adds into the stream
            dx = 2 * n.dx.buf.nbytes if n.dx is not None and n.dx.add else 0
            nbytes = (_nbytes(reads) + _nbytes(n.weights) + _nbytes(n.outputs),
                      (n.row.nbytes + _nbytes(n.weights) + n.dy.nbytes + dx
                       + _nbytes(g.buf for g in n.dweights)) if n.dy is not None else 0)
        elif isinstance(n, tape.Embedding):
            self.kind, self.name = "embedding", f"embedding→{names(n.out)}"
            nbytes = (_embedding_bytes(n, False), _embedding_bytes(n, True) if n.dtable else 0)
        else:
            self.kind, self.name, nbytes = "other", type(n).__name__, (0, 0)
        self.flops, self.nbytes = flops, nbytes

    def _kind_of(self, phase: int) -> str:
        return f"attention {('fwd', 'bwd')[phase]}" if self.kind == "attention" else self.kind

    def forward(self, tape) -> None:
        self.spans.timed(f"{self.name} fwd", self._kind_of(0), self.node.forward, tape,
                         flops=self.flops[0], nbytes=self.nbytes[0])

    def backward(self, tape) -> None:
        self.spans.timed(f"{self.name} bwd", self._kind_of(1), self.node.backward, tape,
                             flops=self.flops[1], nbytes=self.nbytes[1])


def _gemm_role(m: int, n: int, k: int, ta: bool, backward: bool, epilogue=None) -> str:
    """A GEMM's line in its Linear: the product, the bias written as 1·b or its gradient as
    1ᵀ·dy, or a product with a bias epilogue (`epilogue`: "bias", "dbias")."""
    if k == 1:
        return "bias"
    if m == 1:
        return "bias grad"
    role = ("wgrad" if ta else "dgrad") if backward else "gemm"
    return {None: role, "bias": f"{role}+bias", "dbias": f"{role}+bias grad"}[epilogue]


def instrument(model, spans: Spans):
    """Shadow the model's step on its instances with timed stand-ins (see the module doc);
    returns the call that takes them away again."""
    tp, names, saved = model.tape, Names(model), []
    nodes = list(tp.nodes)
    tp.nodes[:] = [Timed(n, spans, names) for n in nodes]
    phase = {"backward": False}
    gemm, add, forward, backward = tp.gemm, tp.add, tp.forward, tp.backward

    def shadow(obj, name: str, stand_in) -> None:
        saved.append((obj, name, vars(obj).get(name, _MISSING)))
        setattr(obj, name, stand_in)

    def timed_gemm(a, b, out, *, ta=False, tb=False, add=False, **epilogue):
        m, k = (a.shape[1], a.shape[0]) if ta else a.shape
        n = b.shape[0] if tb else b.shape[1]
        role = _gemm_role(m, n, k, ta, phase["backward"], next(iter(epilogue), None))
        spans.timed(role, "gemm", gemm, a, b, out, ta=ta, tb=tb, add=add, **epilogue,
                    flops=2.0 * m * n * k)

    def timed_add(a, b, out):
        # inside a node's backward: a gradient added through scratch
        if not phase["backward"]:
            return add(a, b, out)
        return spans.timed("grad add", "add", add, a, b, out, nbytes=3 * out.nbytes)

    def timed_forward():
        phase["backward"] = False
        forward()
        spans.begin("cross-entropy (mask, fused loss+dlogits, mean)", "loss",
                    nbytes=2 * model.mem["logits"].nbytes)

    def timed_backward(after=None):
        spans.end()
        phase["backward"] = True
        backward(after)

    for name, stand_in in (("gemm", timed_gemm), ("add", timed_add),
                           ("forward", timed_forward), ("backward", timed_backward)):
        shadow(tp, name, stand_in)
    grads = model.mem.arenas["grads"].nbytes
    norm = model.grad_norm
    shadow(model, "grad_norm", lambda **kw: spans.timed("grad norm", "optimizer", norm, **kw,
                                                        nbytes=grads))
    step = model.lib.step

    def timed_step(op, *arrays, copy=None, **kw):
        # reads every array and writes all but the grads (and the bf16 copy of the weight)
        moved = sum(a.nbytes * (1 if o.role == "grad" else 2) for o, a in zip(op.inputs, arrays))
        spans.timed(op.name, "optimizer", step, op, *arrays, copy=copy, **kw,
                    flops=_newton_schulz_flops(op, arrays[0].shape),
                    nbytes=moved + (0 if copy is None else copy.nbytes))
    shadow(model.lib, "step", timed_step)

    def undo() -> None:
        tp.nodes[:] = nodes
        for obj, name, before in reversed(saved):
            if before is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, before)
    return undo


_MISSING = object()


def _newton_schulz_flops(op, shape) -> float:
    """A matrix op's GEMM FLOPs on one [rows, cols] parameter: ‖X‖², then per step A = XXᵀ,
    A·A and B·X (runtime/engine/newton_schulz.py); 0 for a pointwise update."""
    if op.matrix is None:
        return 0.0
    s, n = min(shape), max(shape)
    return 2.0 * s * n + op.matrix.steps * 2.0 * (2 * s * s * n + s ** 3)
