"""Where one eulergen training step's time goes: every tape node, forward and backward,
and the loss, grad norm, step control and the optimizer's update ops (AdamW; `--set
training.optimizer=muon`: Muon's phases and Newton-Schulz GEMMs per matrix, its FLOPs
counted, and AdamW for the rest; clipping and the bf16 weight copy are inside the update
kernels), each between two CUDA events.

    python benchmarks/step_profile.py --preset gpt2,nanoeuler --dtype bf16 --batch 8,16
    python benchmarks/step_profile.py --json profile.json   # the tables as JSON too
    EULERGEN_GEMM=cublas python benchmarks/step_profile.py  # cublasGemmEx, no bias epilogues

The step is the trainer's (benchmarks/measure.py's `eulergen_stepper`: tokens, forward, loss,
backward, grad norm, step control with clip at 1.0, the update), on random tokens; plain steps
(replayed as CUDA graphs, as `train` runs them), timed for the wall time, alternate with
instrumented ones (the same kernels launched eagerly, on a Stepper of their own). The instrumentation lives here: the tape's nodes are
wrapped in timed stand-ins and a few of the model's and the tape's methods are shadowed
on their instances (GEMMs, the gradient adds inside a node, the loss between forward
and backward), so the runtime runs unchanged and pays nothing when nobody profiles it.
A span's time is its events' elapsed time less the spans timed inside it; those nested
spans (a Linear's GEMMs, an op's gradient add) get lines of their own, and what is left
of the outer span is its `rest` line. Lines of the blocks' layers are summed into one
(h.*.), `n` saying how many calls it holds. Times are medians over the steps.

GEMM and attention lines give TFLOP/s against the GPU's dense peak at the step's GEMM
precision (bf16, or TF32 for fp32 storage; runtime/train/metrics.py); attention counts causal
flash FLOPs (forward 2 GEMMs, backward 5 with the recompute, half the T×T square each).
Memory-bound lines give the bytes their arrays hold (each input and output once: the
fewest a kernel can move) against a device-to-device copy measured in the same run.
The host's share: the uninstrumented step's wall time against the GPU time the lines
add up to; what is left is the GPU waiting for launches and host reads.
"""
from __future__ import annotations

import argparse
import bisect
import json
import os
import re
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("CUPY_TF32", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from common import copy_gbps, say  # noqa: E402
from measure import config, eulergen_stepper  # noqa: E402

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


# -- one configuration -------------------------------------------------------------------


def profile(cfg, steps: int, warmup: int, copy: float | None = None) -> dict:
    """One configuration's lines and wall time; `copy`: the copy bandwidth, GB/s."""
    from eulergen.runtime.engine import bf16, gemm
    from eulergen.runtime.train import metrics
    from eulergen.runtime.engine.backend import get_backend
    from eulergen.runtime.model.gpt import build
    from eulergen.runtime.engine.ops import OpLibrary
    from eulergen.runtime.model.optimizer_plan import update_ops
    from eulergen.runtime.train.optimizer import Optimizer

    t = cfg.training
    backend = get_backend(t.device)
    lib = OpLibrary(backend)
    dtype = bf16.plan_dtype(t.dtype, backend)
    ops = update_ops(lib, t.optimizer)
    model = build(cfg.model, lib, t.batch_size, t.seq_len, tf32=True, dtype=dtype, optimizer=ops)
    model.init_weights(0)
    optim = Optimizer(model, ops, t)
    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, cfg.model.vocab_size, (t.batch_size, t.seq_len)) for _ in "xy")
    _, graphed = eulergen_stepper(model, optim, t, cuda_graph=backend.is_gpu)
    _, eager = eulergen_stepper(model, optim, t, cuda_graph=False)

    def step():
        graphed(x, y)

    start, done = time.perf_counter(), 0
    while done < warmup or time.perf_counter() - start < 1.0:   # clocks settle after compiling
        step()
        backend.synchronize()
        done += 1
    spans, walls, per_step = Spans(backend), [], []
    for _ in range(steps):
        # plain and timed steps alternate, so both meet the same clocks and temperature
        start = time.perf_counter()
        step()
        backend.synchronize()
        walls.append(1e3 * (time.perf_counter() - start))
        undo = instrument(model, spans)
        eager(x, y)
        per_step.append(spans.collect())
        undo()
    keys = list(dict.fromkeys(k for s in per_step for k in s))
    lines = []
    for name, kind in keys:
        rows = [s.get((name, kind), [0.0, 0, 0.0, 0.0]) for s in per_step]
        ms = statistics.median(r[0] for r in rows)
        calls, flops, nbytes = max(rows, key=lambda r: r[1])[1:]
        lines.append(Line(name, kind, calls, ms, flops, nbytes))
    device = backend.device
    precision = "bf16" if dtype == "bf16" else "tf32"
    return dict(preset=cfg.model.preset, batch=t.batch_size, seq=t.seq_len, dtype=t.dtype,
                device=device, gemm=gemm.describe(backend),
                peak_flops=metrics.peak_flops(device, precision),
                precision=precision, copy_gbps=copy,
                wall_ms=statistics.median(walls), lines=[asdict(r) for r in lines])


# -- the tables --------------------------------------------------------------------------


def table(p: dict) -> str:
    lines = [Line(**r) for r in p["lines"]]
    gpu = sum(r.ms for r in lines)
    wall, peak, copy = p["wall_ms"], p["peak_flops"], p["copy_gbps"]
    title = f"step profile: {p['preset']}, B={p['batch']} T={p['seq']}, {p['dtype']} on {p['device']}"
    out = [title + (f"; GEMM peak {peak / 1e12:.1f} TFLOP/s ({p['precision']})" if peak else ""),
           f"GEMMs: {p['gemm']}",
           f"copy bandwidth (device-to-device, read+write): {copy:,.0f} GB/s" if copy
           else "copy bandwidth: - (no GPU)"]
    head = (f"{'line':<52} {'kind':<13} {'n':>3} {'ms':>8} {'share':>6} {'TFLOP/s':>8} "
            f"{'of peak':>7} {'GB/s':>7} {'of copy':>7}")
    out += [head, "-" * len(head)]
    for r in lines:
        tf = r.flops / r.ms / 1e9 if r.flops and r.ms > 0 else None
        gb = r.nbytes / r.ms / 1e6 if r.nbytes and r.ms > 0 else None
        cells = [f"{tf:8.1f}" if tf else f"{'':>8}",
                 f"{tf * 1e12 / peak:7.0%}" if tf and peak else f"{'':>7}",
                 f"{gb:7.0f}" if gb else f"{'':>7}",
                 f"{gb / copy:7.0%}" if gb and copy else f"{'':>7}"]
        out.append(f"{r.name[:52]:<52} {r.kind:<13} {r.calls:3d} {r.ms:8.3f} "
                   f"{r.ms / gpu:6.1%} {' '.join(cells)}")
    out += ["", f"{'kind':<14} {'ms':>8} {'of GPU':>7} {'of wall':>7} {'TFLOP/s':>8} {'GB/s':>7}"]
    for kind in KINDS:
        rows = [r for r in lines if r.kind == kind]
        if not rows:
            continue
        ms = sum(r.ms for r in rows)
        flops, nbytes = sum(r.flops for r in rows), sum(r.nbytes for r in rows)
        tf = f"{flops / ms / 1e9:8.1f}" if flops and ms > 0 else f"{'':>8}"
        gb = f"{nbytes / ms / 1e6:7.0f}" if nbytes and ms > 0 else f"{'':>7}"
        out.append(f"{kind:<14} {ms:8.3f} {ms / gpu:7.1%} {ms / wall:7.1%} {tf} {gb}")
    out += [f"{'GPU (sum)':<14} {gpu:8.3f}",
            f"wall step {wall:.3f} ms (uninstrumented, median); GPU time {gpu:.3f} ms; " + (
                f"host share {1 - gpu / wall:.1%} (the GPU idle, waiting for launches and "
                f"host reads)" if gpu <= wall else
                f"host share: none seen; the lines add up to {gpu - wall:.3f} ms more than "
                f"the uninstrumented step: read them as upper bounds")]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt2", help="gpt2, nanoeuler or both, comma-separated")
    ap.add_argument("--batch", default="8", help="batch sizes, comma-separated")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--dtype", default="bf16", help="bf16, fp32 or both, comma-separated")
    ap.add_argument("--device", default="cuda", choices=("cuda", "numpy"))
    ap.add_argument("--steps", type=int, default=7, help="timed steps (medians over them)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    metavar="SECTION.KEY=VALUE", help="a config override (a smaller model)")
    ap.add_argument("--json", type=Path, help="also write the profiles to this JSON file")
    args = ap.parse_args()
    profiles = []
    copy = copy_gbps() if args.device == "cuda" else None
    for preset in args.preset.split(","):
        for dtype in args.dtype.split(","):
            for batch in (int(b) for b in args.batch.split(",")):
                say(f"profiling {preset} {dtype} B={batch}")
                cfg = config(preset, batch, args.seq, dtype, f"training.device={args.device}",
                             *args.overrides)
                p = profile(cfg, args.steps, args.warmup, copy)
                print(table(p), "\n", flush=True)
                profiles.append(p)
                if args.json:   # after each one: a run cut off still leaves what it measured
                    from eulergen.files import write_atomic
                    write_atomic(args.json, json.dumps(profiles, indent=1).encode())


if __name__ == "__main__":
    main()
