"""The memory plan of the GPT (runtime/model/gpt.py) for training or evaluation: every
buffer its step touches, laid out from the Arch's graph before anything is allocated.
`plan_on` is the plan a run makes on a backend; the trainer's and `eulergen plan`'s come
from it (runtime/train/resolve.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from eulergen.errors import EulerError
from eulergen.runtime.engine import gemm
from eulergen.runtime.model.arch import Arch
from eulergen.runtime.model.memory import ALIGN, Plan, Planner
from eulergen.runtime.model.optimizer_plan import lanes_for, plan_optimizer
from eulergen.runtime.model.params import plan_params
from eulergen.runtime.model.recompute import NONE, own, per_layer, shared
from eulergen.signature import AUTOCAST, bf16_copy


@dataclass(frozen=True)
class Precision:
    """What a plan stores in which dtype: `dtype` the storage dtype ("float32", "float64" on
    numpy, or "bf16"), `name` training.precision, which says what a bf16 plan keeps in
    float32 besides the master weights, the moments and the per-row values: "bf16" (as
    llm.c) nothing more; "autocast" (as torch.autocast) the residual stream and its
    gradient, the weights the norms and the embedding read (the master's) and every
    parameter gradient. A plan of float32 storage holds everything in it already."""
    dtype: str
    name: str = "bf16"

    @property
    def master(self) -> str:
        return "float32" if self.dtype == "bf16" else self.dtype

    @property
    def autocast(self) -> bool:
        return self.dtype == "bf16" and self.name == AUTOCAST

    @property
    def stream(self) -> str:
        return self.master if self.autocast else self.dtype

    grads = stream   # the parameter gradients' dtype: the stream's


def plan_on(lib, a: Arch, batch: int, seq: int, *, training: bool = True,
            dtype: str = "float32", precision: str = "bf16", buckets=None,
            for_gpu: bool = False, recompute: str = NONE, optimizer=None) -> Plan:
    """plan_model with the workspaces a run on `lib`'s backend plans: on a GPU the
    kernels' (lib.workspace_elements) and the GEMM libraries' (gemm.workspace_bytes), on
    numpy none. `for_gpu`: a GPU's on any machine (`eulergen plan`: no GPU needed).
    `optimizer`: the run's UpdateOps (runtime/model/optimizer_plan.py), whose state a
    training plan holds; None: none."""
    if for_gpu and not lib.backend.is_gpu:
        from eulergen.runtime.engine.cublas import WORKSPACE_BYTES
        from eulergen.runtime.engine.cuda_ops import workspace_elements
        workspace, gemm_workspace = workspace_elements, WORKSPACE_BYTES
    else:
        workspace, gemm_workspace = lib.workspace_elements, gemm.workspace_bytes(lib.backend)
    lanes = lanes_for(for_gpu or lib.backend.is_gpu)
    planned = plan_optimizer(a, optimizer, buckets, lanes=lanes) \
        if optimizer is not None and training else None
    return plan_model(a, batch, seq, training=training, dtype=dtype, precision=precision,
                      workspace=workspace, gemm_workspace=gemm_workspace, buckets=buckets,
                      recompute=recompute, optimizer=planned)


def plan_model(a: Arch, batch: int, seq: int, *, training: bool = True,
               dtype: str = "float32", precision: str = "bf16", workspace=None,
               gemm_workspace: int = 0, buckets=None, recompute: str = NONE,
               optimizer=None) -> Plan:
    """Lay out parameters, (gradients, optimizer state,) activations and workspace: per block
    the values a backward reads, once for all blocks the values none reads (`proj`) and
    every gradient (graph.py). `dtype`: the storage dtype, "float32" (or "float64" on
    numpy) or "bf16" (mixed precision: float32 master weights and optimizer state beside a
    bf16 copy the kernels read, bf16 gradients, activations and workspace, the per-row
    float32 values in `stats`). `precision`: training.precision (Precision): "autocast"
    keeps a bf16 plan's residual stream, its gradient (with a bf16 copy that the GEMMs
    read) and the parameter gradients in float32, in the `stream` arena and `grads`.
    `workspace(op, stage, shape, dtype=, table_rows=, fusion=, precision=)`: the float32
    elements a backward call needs from the kernels' workspace, as
    OpLibrary.workspace_elements answers it; None: none. `gemm_workspace`: the bytes of the
    GEMM libraries' workspace (on a GPU, so that a captured step's GEMMs allocate
    nothing), its own arena `gemm`; 0: none. plan_on passes a run's.
    `buckets`: data-parallel training's BucketPlan (runtime/distributed/buckets.py): the
    rank's loss and sum of squares have a slot each for the collectives. `recompute`:
    training.recompute (runtime/model/recompute.py): "blocks" keeps a layer's x and ln_1
    only, and the rest a backward reads once. `optimizer`: the OptimizerPlan
    (runtime/model/optimizer_plan.py) whose buffers the `optimizer` arena holds (with ZeRO-1
    one rank's share); None: no optimizer state."""
    if seq > a.max_seq:
        raise EulerError(f"seq_len {seq} exceeds the model's max_seq_len {a.max_seq}",
                         key="training.seq_len")
    B, T, N, d = batch, seq, batch * seq, a.d
    g, lead = a.graph, (batch, seq)
    kept = g.kept()
    pr = Precision(dtype, precision)
    master = pr.master   # weights, moments, per-row values
    p = Planner()

    def add(arena: str, name: str, shape, per_row: bool = False, of: str | None = None) -> None:
        """A buffer of the storage dtype, or a float32 per-row one (bf16: in `stats`), or
        one of dtype `of` (the stream's or the gradients': autocast's float32, in
        `stream`)."""
        if per_row:
            p.add("stats" if master != dtype else arena, name, shape, master)
        elif of is not None and of != dtype:
            p.add("stream", name, shape, of)
        else:
            p.add(arena, name, shape, dtype)

    def of(v) -> str | None:
        return pr.stream if v.stream else None

    plan_params(p, a, master)
    total = a.param_layout.total
    if master != dtype:
        p.add("params_bf16", "params_bf16", (total,), dtype)   # refreshed after every update
    if training:
        # same layout as params: a parameter's gradient / moments sit at its offset
        p.add("grads", "grads", (total,), pr.grads)
        for name, size in optimizer.buffers() if optimizer is not None else ():
            p.add("optimizer", name, (size,), master)

    # what a block hands on is the next block's x and ln_1, and after the last the head's;
    # parts (q, k, v of qkv) are views of their root's buffers
    block = [g.values[n] for n in g.order(g.block)
             if n not in g.handoff and not g.values[n].part]
    mine = per_layer(g, recompute)
    for layer in range(a.layers):
        for v in block:
            if v.name in mine:
                add("activations", own(layer, v.name), v.shape(lead), v.per_row, of(v))
    for v in block:   # recomputing: one block's, which each block's forward writes again
        if v.name in kept - mine:
            add("activations", shared(v.name), v.shape(lead), v.per_row, of(v))
    for name in dict.fromkeys([head for _, head in g.handoff.values()] + g.order(g.head)):
        add("activations", name, g.values[name].shape(lead), of=of(g.values[name]))
    add("activations", "losses", (N,), per_row=True)   # the fused cross-entropy writes dlogits
    add("activations", "loss", (1,), per_row=True)     # over the logits

    for slot, v in _first((v.buffer, v) for v in block if v.name not in kept).items():
        add("workspace", slot, v.shape(lead), v.per_row, of(v))
    add("workspace", "dloss", (N,), per_row=True)      # d(mean loss)/d(row loss), constant
    if a.bias:
        add("workspace", "ones", (1, N))                # bias gradients as a GEMM: 1ᵀ·dy
    if training:
        values = [g.values[n] for n in g.order(g.stem + g.block + g.head)
                  if not g.values[n].part]
        # one buffer per gradient, shared by every block; the logits hold their own. The
        # stream's (autocast: float32) has a bf16 copy, which the GEMMs of its branches read
        streams = {v.grad for v in values if v.stream}
        for name, v in _first((v.grad, v) for v in values
                              if v.grad and v.grad not in g.values).items():
            add("workspace", name, v.shape(lead), of=pr.stream if name in streams else None)
            if name in streams and pr.autocast:
                add("workspace", bf16_copy(name), v.shape(lead))
        # parameter gradients a node adds on a later micro-step pass through here (the
        # norms add into the stream's gradient in their own pass): a norm's weights, the
        # activation's biases; in the gradients' dtype
        biases = len(a.ops.activation.inputs) * a.ffn if a.bias else 0
        add("workspace", "scratch", (max(len(a.norm_weights) * d, biases, 1),), of=pr.grads)
        if pr.grads != master:
            add("stats", "grad_rows", (total // _norm_row(total),), per_row=True)
        add("workspace", "grad_norm", (1,), per_row=True)   # cuBLAS writes it on the device
        if buckets is not None:
            add("workspace", "dp_loss", (1,), per_row=True)
            add("workspace", "dp_sumsq", (1,), per_row=True)
            if buckets.zero:   # the norms of a rank's share, each row's (bf16) or span's
                if pr.grads != master:
                    add("stats", "shard_rows", (buckets.moments // ALIGN,), per_row=True)
                else:
                    add("workspace", "shard_norms", (len(buckets.owned(0)),), per_row=True)
        # float32 workspace of the generated backward kernels, reused call after call
        # (one stream: a call's kernels have read it before the next call writes it)
        kdt = "bf16" if dtype == "bf16" else "f32"
        norm = {"precision": AUTOCAST} if pr.autocast else {}   # its stream's storage
        kernel_ws = 0 if workspace is None else max(
            workspace(a.ops.norm, "backward", (B, T, d), dtype=kdt, **norm),
            workspace(a.ops.norm, "backward", (B, T, d), dtype=kdt, fusion="add", **norm),
            workspace(a.ops.activation, "backward", (B, T, a.ffn), dtype=kdt,
                      fusion="bias" if a.bias else ""),
            workspace(a.ops.attention, "backward", (B, T, a.heads, a.head_dim), dtype=kdt),
            # autocast: from the float32 tables into the float32 stream
            workspace(a.ops.embedding, "backward", (B, T), dtype="f32" if pr.autocast else kdt,
                      table_rows=a.vocab_rows))
        if kernel_ws:
            p.add("kernels", "kernel_ws", (kernel_ws,), "float32")
    if gemm_workspace:
        p.add("gemm", "gemm_ws", (gemm_workspace,), "uint8")
    p.add("tokens", "idx", (B, T), "int32")
    p.add("tokens", "targets", (B, T), "int32")
    return p.plan()


def _norm_row(total: int) -> int:
    """The row length of the bf16 gradient norm: the gradients as a [rows, K] matrix whose
    row norms one reduction writes (K divides the arena: a multiple of memory.ALIGN)."""
    return math.gcd(total, 4096)


def _first(pairs) -> dict:
    """(key, value) pairs as a dict of each key's first value, in order of first appearance."""
    out = {}
    for key, value in pairs:
        out.setdefault(key, value)
    return out
