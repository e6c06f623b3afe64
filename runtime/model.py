"""The GPT model: its shape, its memory plan, and its forward pass recorded on a tape.

Pre-norm blocks, x → x + attn(norm(x)) → x + mlp(norm(x)), with the norm, the
activation and the attention named by op (ModelConfig.norm / activation / attention),
so `--set model.activation=myact` swaps the generated kernels and nothing else. An
activation op with two inputs makes the MLP gated: c_fc's rows 0..F-1 feed its first
input, rows F..2F-1 its second. Token embedding tied to the LM head, learned positions
or RoPE (the `rope` op on q and k), grouped-query attention, final norm, cross-entropy
averaged over tokens. The graph is runtime/graph.py's (each residual add folded into the
norm after it, c_fc's bias into the activation: the ops' generated fused variants); the
parameters runtime/params.py's.

Every GEMM writes into its own contiguous buffer (q, k and v are three GEMMs over row
blocks of c_attn.weight; a gated MLP's two inputs are two GEMMs) so that every op a
generated kernel sees is dense.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from eulergen.errors import EulerError
from eulergen.runtime import bf16
from eulergen.runtime.attention import head_dims
from eulergen.runtime.graph import model_graph
from eulergen.runtime.memory import Memory, Plan, Planner, check_fits, upload
from eulergen.runtime.params import (ParamSpec, load_params, padded_vocab,  # noqa: F401
                                     param_count, parameters, plan_params)
from eulergen.runtime.tape import Tape, cublas_nrm2
from eulergen.runtime.training_tape import record_training

# norm-op weight inputs are named `weight`, then `bias`, as torch names them
_NORM_PARAM_NAMES = ("weight", "bias")
# the padded vocab rows' logit in bf16 storage, rounded once here, not at every step
_NEG_INF_BF16 = bf16.bits(-np.inf)


@dataclass(frozen=True)
class ModelOps:
    """The manifest entries of the ops a model runs, resolved once by arch_of: the tape's
    nodes call the library with them, never by name."""
    norm: object            # manifest.OpEntry
    activation: object
    attention: object
    embedding: object
    loss: object            # cross_entropy
    rope: object = None     # positions 'rope' only


@dataclass(frozen=True)
class Arch:
    """The model's shape, with what it learns from the ops it names."""
    d: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int                        # the tokenizer's (model.vocab_size); vocab_rows is padded
    max_seq: int
    ffn: int                          # F: the activation's width
    gated: bool
    rope: bool
    bias: bool
    norm_weights: tuple[str, ...]     # 'weight'[, 'bias'] per norm, from the op's weight inputs
    norm_params: dict = field(hash=False)
    rope_params: dict = field(hash=False)
    ops: ModelOps = field(repr=False)

    @property
    def vocab_rows(self) -> int:
        return padded_vocab(self.vocab)

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


def _need_op(lib, name: str, key: str, kinds: tuple[str, ...]):
    try:
        op = lib.op(name)
    except EulerError as err:
        raise EulerError(err.message, key=key) from None
    if op.kind not in kinds:
        raise EulerError(f"op {name!r} is a {op.kind} op; this slot wants {' or '.join(kinds)}",
                         key=key)
    return op


def _op_params(op, wanted: dict) -> dict:
    """The config values an op declares as parameters (eps, base), and nothing else."""
    return {k: v for k, v in wanted.items() if k in op.params}


def arch_of(cfg, lib) -> Arch:
    """Check a ModelConfig against the ops it names; EulerError names the key at fault.
    The shape checks that need no op (heads dividing hidden_dim, an even rope head dim…)
    are the config loader's (config._validate): every ModelConfig comes from it."""
    d, H, KVH = cfg.hidden_dim, cfg.num_heads, cfg.num_kv_heads
    norm = _need_op(lib, cfg.norm, "model.norm", ("row",))
    weights = [o.name for o in norm.inputs if o.role == "weight"]
    rows = [o for o in norm.inputs if o.role == "row"]
    if len(rows) != 1 or len(weights) > len(_NORM_PARAM_NAMES) or len(norm.outputs) != 1:
        raise EulerError(f"op {cfg.norm!r} does not look like a norm (one row input, at most "
                         "two weights, one output)", key="model.norm")
    act = _need_op(lib, cfg.activation, "model.activation", ("pointwise",))
    if len(act.inputs) not in (1, 2) or len(act.outputs) != 1:
        raise EulerError(f"activation {cfg.activation!r} has {len(act.inputs)} inputs and "
                         f"{len(act.outputs)} outputs; want 1 (or 2: gated) and 1",
                         key="model.activation")
    # the graph folds the residual adds into the norms and c_fc's bias into the activation
    for op, fusion, key in ((norm, "add", "model.norm"), (act, "bias", "model.activation")):
        if fusion not in op.fusions:
            raise EulerError(f"op {op.name!r} has no `{fusion}` fusion in its manifest (a build "
                             "older than fused variants: run `eulergen build`)", key=key)
    attention = _need_op(lib, cfg.attention, "model.attention", ("attention",))
    if lib.backend.is_gpu:
        _check_head_dim(attention, d, H)
    rope, rope_params = None, {}
    if cfg.positions == "rope":
        rope = _need_op(lib, "rope", "model.positions", ("pair",))
        rope_params = _op_params(rope, {"base": float(cfg.rope_base)})
    ops = ModelOps(norm=norm, activation=act, attention=attention, rope=rope,
                   embedding=_need_op(lib, "embedding", "model", ("embedding",)),
                   loss=_need_op(lib, "cross_entropy", "model", ("row",)))
    return Arch(d=d, layers=cfg.num_layers, heads=H, kv_heads=KVH, head_dim=d // H,
                vocab=cfg.vocab_size, max_seq=cfg.max_seq_len, ffn=cfg.mlp_hidden,
                gated=len(act.inputs) == 2, rope=cfg.positions == "rope", bias=bool(cfg.bias),
                norm_weights=_NORM_PARAM_NAMES[:len(weights)],
                norm_params=_op_params(norm, {"eps": float(cfg.norm_eps)}),
                rope_params=rope_params, ops=ops)


def _check_head_dim(attention, d: int, heads: int) -> None:
    """The flash kernels exist for a few head dims only: refuse another one when the
    config is read, not at the first attention launch after the run has started."""
    dims = head_dims(attention)
    if d // heads in dims:
        return
    fits = [d // hd for hd in dims if d % hd == 0]
    hint = f"; e.g. --set model.num_heads={fits[0]} (num_kv_heads dividing it)" if fits else ""
    raise EulerError(f"head dim {d // heads} (hidden_dim {d} / num_heads {heads}): "
                     f"{attention.name} has CUDA kernels for head dims {dims} only{hint}",
                     key="model.num_heads")


def plan_model(a: Arch, batch: int, seq: int, *, training: bool = True,
               dtype: str = "float32", workspace=None) -> Plan:
    """Lay out parameters, (gradients, AdamW state,) activations and workspace: per block
    the values a backward reads, once for all blocks the values none reads (`proj`) and
    every gradient (graph.py). `dtype`: the storage dtype, "float32" (or "float64" on
    numpy) or "bf16" (mixed precision: float32 master weights and AdamW moments beside a
    bf16 copy the kernels read, bf16 gradients, activations and workspace, the per-row
    float32 values in `stats`). `workspace(op, stage, shape, dtype=, table_rows=,
    fusion=)`: the
    float32 elements a backward call needs from the kernels' workspace, as
    OpLibrary.workspace_elements answers it (what `build` passes;
    cuda_ops.workspace_elements for the GPU's plan on any machine); None: none."""
    if seq > a.max_seq:
        raise EulerError(f"seq_len {seq} exceeds the model's max_seq_len {a.max_seq}",
                         key="training.seq_len")
    B, T, N, d = batch, seq, batch * seq, a.d
    g, lead = model_graph(a), (batch, seq)
    kept = g.kept()
    master = "float32" if dtype == "bf16" else dtype   # weights, moments, per-row values
    p = Planner()

    def add(arena: str, name: str, shape, per_row: bool = False) -> None:
        """A buffer of the storage dtype, or a float32 per-row one (bf16: in `stats`)."""
        if per_row:
            p.add("stats" if master != dtype else arena, name, shape, master)
        else:
            p.add(arena, name, shape, dtype)

    plan_params(p, a, master)
    total = p.plan().arena("params").size
    if master != dtype:
        p.add("params_bf16", "params_bf16", (total,), dtype)   # refreshed after every update
    if training:
        # same layout as params: a parameter's gradient / moments sit at its offset
        p.add("grads", "grads", (total,), dtype)
        for arena in ("adam_m", "adam_v"):
            p.add(arena, arena, (total,), master)

    # what a block hands on is the next block's x and ln_1, and after the last the head's
    block = [g.values[n] for n in g.order(g.block) if n not in g.handoff]
    for layer in range(a.layers):
        for v in block:
            if v.name in kept:
                add("activations", f"h.{layer}.{v.name}", v.shape(lead), v.per_row)
    for name in dict.fromkeys([head for _, head in g.handoff.values()] + g.order(g.head)):
        add("activations", name, g.values[name].shape(lead))
    add("activations", "losses", (N,), per_row=True)   # the fused cross-entropy writes dlogits
    add("activations", "loss", (1,), per_row=True)     # over the logits

    for slot, v in _first((v.buffer, v) for v in block if v.name not in kept).items():
        add("workspace", slot, v.shape(lead), v.per_row)
    add("workspace", "dloss", (N,), per_row=True)      # d(mean loss)/d(row loss), constant
    if a.bias:
        add("workspace", "ones", (1, N))                # bias gradients as a GEMM: 1ᵀ·dy
    if training:
        values = [g.values[n] for n in g.order(g.stem + g.block + g.head)]
        # one buffer per gradient, shared by every block; the logits hold their own
        for name, v in _first((v.grad, v) for v in values
                              if v.grad and v.grad not in g.values).items():
            add("workspace", name, v.shape(lead))
        # parameter gradients a node adds on a later micro-step pass through here (the
        # norms add into the stream's gradient in their own pass): a norm's weights, the
        # activation's biases
        biases = len(a.ops.activation.inputs) * a.ffn if a.bias else 0
        add("workspace", "scratch", (max(len(a.norm_weights) * d, biases, 1),))
        if master != dtype:
            add("stats", "grad_rows", (total // _norm_row(total),), per_row=True)
        # float32 workspace of the generated backward kernels, reused call after call
        # (one stream: a call's kernels have read it before the next call writes it)
        kdt = "bf16" if dtype == "bf16" else "f32"
        kernel_ws = 0 if workspace is None else max(
            workspace(a.ops.norm, "backward", (B, T, d), dtype=kdt),
            workspace(a.ops.norm, "backward", (B, T, d), dtype=kdt, fusion="add"),
            workspace(a.ops.activation, "backward", (B, T, a.ffn), dtype=kdt,
                      fusion="bias" if a.bias else ""),
            workspace(a.ops.attention, "backward", (B, T, a.heads, a.head_dim), dtype=kdt),
            workspace(a.ops.embedding, "backward", (B, T), dtype=kdt,
                      table_rows=a.vocab_rows))
        if kernel_ws:
            p.add("kernels", "kernel_ws", (kernel_ws,), "float32")
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


class GPT:
    """The model over one planned Memory, for a fixed batch and sequence length.

    `loss_and_grad()` runs forward, the fused cross-entropy (loss and dlogits in one pass)
    and the reversed tape, leaving the gradients in the grads arena; `loss()` runs forward
    and the loss only; `logits()` runs forward over the whole window.

    `master` are the weights a checkpoint holds and AdamW updates, `params` the ones the
    tape reads: the same arrays, except in a bf16 plan, where `params` is the bf16 copy
    (`params_bf16`) that `sync_weights()` rounds from the float32 master after every
    change."""

    def __init__(self, arch: Arch, lib, memory: Memory, batch: int, seq: int, *,
                 tf32: bool = False):
        self.arch, self.lib, self.mem = arch, lib, memory
        self.backend = lib.backend
        self.xp = lib.backend.xp
        self.batch, self.seq = batch, seq
        self.training = "grads" in memory.arenas
        self.bf16 = "params_bf16" in memory.arenas
        self.specs = parameters(arch)
        self.param_total = param_count(arch)
        self.master = {s.name: memory[s.name] for s in self.specs}
        self.params = self._views("params_bf16") if self.bf16 else self.master
        self.grads = self._views("grads") if self.training else {}
        if arch.bias:
            memory["ones"][...] = bf16.bits(1.0) if self.bf16 else 1
        self.set_accumulation(1)
        self.tape = Tape(self.backend, lib, memory["scratch"] if self.training else None,
                         memory["kernel_ws"] if "kernel_ws" in memory else None, tf32=tf32)
        self.graph = model_graph(arch)
        record_training(self)

    def _views(self, arena: str) -> dict:
        """Each parameter's view into an arena laid out as params (grads, the bf16 copy)."""
        flat, plan = self.mem.arenas[arena], self.mem.plan
        return {s.name: flat[b.offset:b.offset + b.size].reshape(b.shape)
                for s in self.specs for b in (plan.buffer(s.name),)}

    # -- running it -------------------------------------------------------------------

    def set_accumulation(self, micro_steps: int) -> None:
        """The loss is the mean over all tokens of all micro-steps of a step."""
        self.mem["dloss"][...] = 1.0 / (self.batch * self.seq * micro_steps)

    def load_tokens(self, idx, targets=None) -> None:
        """Copy a [B, T] batch (host integers) into the planned token buffers. Ids are
        checked on the host first: an id past the table would index outside it."""
        for name, ids in (("idx", idx), ("targets", targets)):
            if ids is None:
                continue
            ids = np.asarray(ids)
            lo, hi = (int(ids.min()), int(ids.max())) if ids.size else (0, 0)
            if lo < 0 or hi >= self.arch.vocab:
                raise EulerError(f"token id {hi if hi >= self.arch.vocab else lo} is outside the "
                                 f"model's vocabulary of {self.arch.vocab} (a dataset tokenized "
                                 "for another vocab?)", key="model.vocab_size")
            upload(self.mem[name], ids)

    def logits(self):
        self.tape.forward()
        return self.mem["logits"].reshape(self.batch, self.seq, -1)

    def _mask_padding(self) -> None:
        """Padded vocab rows take no part in the loss, as in llm.c and transformers: their
        logits become -inf, so the softmax gives them 0 and their dlogits are 0. (The zero rows
        an imported model pads with give logits of 0, which can outweigh every real id: a
        trained model's logits may all sit below 0.)"""
        a = self.arch
        if a.vocab_rows > a.vocab:
            self.mem["logits"][:, a.vocab:] = _NEG_INF_BF16 if self.bf16 else -np.inf

    def loss(self):
        """Mean cross-entropy of the loaded batch, as a 1-element device array."""
        m = self.mem
        self.tape.forward()
        self._mask_padding()
        self.lib.forward(self.arch.ops.loss, m["logits"], m["targets"].reshape(-1),
                         out=(m["losses"],))
        self.xp.mean(m["losses"], keepdims=True, out=m["loss"])
        return m["loss"]

    def loss_and_grad(self, *, accumulate: bool = False):
        """Forward, loss and backward for the loaded batch. With `accumulate`, parameter
        gradients add to those already in the grads arena (a later micro-step)."""
        m = self.mem
        self.tape.forward()
        self._mask_padding()
        self.lib.fused(self.arch.ops.loss, m["logits"], m["targets"].reshape(-1), m["dloss"],
                       out=(m["losses"], m["logits"]))
        self.xp.mean(m["losses"], keepdims=True, out=m["loss"])
        self.tape.accumulating = accumulate
        self.tape.backward()
        return m["loss"]

    def grad_norm(self) -> float:
        """The global L2 norm of the gradients, read to the host. On the GPU it is cuBLAS's
        snrm2 straight into a host scalar: `cupy.dot(g, g)` would allocate a temporary the
        size of every gradient (CuPy multiplies, then sums), outside the plan. bf16
        gradients: float32 norms of rows of the arena into the planned `grad_rows`, then
        snrm2 of those (cuBLAS has no bf16 norm with a float32 result)."""
        g = self.mem.arenas["grads"]
        if self.bf16:
            rows = self.mem["grad_rows"]
            bf16.row_norms(g.reshape(rows.size, -1), rows)
            g = rows
        if self.backend.is_gpu:
            return cublas_nrm2(g)
        return math.sqrt(float(np.dot(g, g)))

    def scale_grads(self, factor: float) -> None:
        """Multiply every gradient by `factor` in place (clipping)."""
        g = self.mem.arenas["grads"]
        if self.bf16:
            bf16.scale(g, factor)
        else:
            self.xp.multiply(g, factor, out=g)

    def sync_weights(self) -> None:
        """Round the float32 master weights into the bf16 copy the kernels read (one pass
        over the arena, into planned memory); nothing to do in fp32."""
        if self.bf16:
            bf16.to_bf16(self.mem.arenas["params"], out=self.mem.arenas["params_bf16"])

    # -- weights ----------------------------------------------------------------------

    def init_weights(self, seed: int) -> None:
        """GPT-2's init: N(0, 0.02), residual projections N(0, 0.02/sqrt(2·layers)), biases
        zero, norm weights one. One generator per run, parameters drawn in model order."""
        rng = np.random.Generator(np.random.PCG64(seed))
        std = {"normal": 0.02, "residual": 0.02 / math.sqrt(2 * self.arch.layers)}
        for s in self.specs:
            view = self.master[s.name]
            if s.init in std:
                host = rng.standard_normal(s.shape, dtype=np.float64) * std[s.init]
            else:
                host = np.full(s.shape, 1.0 if s.init == "ones" else 0.0)
            upload(view, host)
        self.sync_weights()

    def state_dict(self) -> dict:
        """Parameter name -> host array (a copy of the master weights), in model order."""
        return {s.name: self.backend.asnumpy(self.master[s.name]).copy() for s in self.specs}

    def load_state_dict(self, state: dict) -> None:
        load_params(self.master, state)
        self.sync_weights()


def ops_used(cfg) -> tuple[str, ...]:
    """The ops a run of this ModelConfig calls: what `eulergen train` builds before it starts."""
    return tuple(dict.fromkeys((cfg.norm, cfg.activation, cfg.attention, "cross_entropy", "adamw")
                               + (("rope",) if cfg.positions == "rope" else ())))


def build(cfg, lib, batch: int, seq: int, *, training: bool = True, dtype: str = "float32",
          shared: dict | None = None, tf32: bool = False) -> GPT:
    """Plan, allocate and record a model: the one call the trainer and sampler make.
    `dtype`: "float32", "bf16" (a GPU with bf16 only) or "float64" (numpy)."""
    arch = arch_of(cfg, lib)
    if dtype == "bf16":
        bf16.plan_dtype("bf16", lib.backend)
    plan = plan_model(arch, batch, seq, training=training, dtype=dtype,
                      workspace=lib.workspace_elements)
    check_fits(plan, lib.backend, shared)
    return GPT(arch, lib, Memory(plan, lib.backend.xp, shared=shared), batch, seq, tf32=tf32)
