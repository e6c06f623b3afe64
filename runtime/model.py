"""The GPT model: its parameters, its memory plan, and its forward pass recorded on a tape.

Pre-norm blocks, x → x + attn(norm(x)) → x + mlp(norm(x)), with the norm, the
activation and the attention named by op (ModelConfig.norm / activation / attention),
so `--set model.activation=myact` swaps the generated kernels and nothing else. An
activation op with two inputs makes the MLP gated: c_fc's rows 0..F-1 feed its first
input, rows F..2F-1 its second. Token embedding tied to the LM head, learned positions
or RoPE (the `rope` op on q and k), grouped-query attention, final norm, cross-entropy
averaged over tokens.

Parameters are named and shaped as in torch (nn.Linear: weight [out, in]), so a state
dict moves between eulergen, checkpoints and benchmarks/torch_gpt.py unchanged.

Every GEMM writes into its own contiguous buffer (q, k and v are three GEMMs over row
blocks of c_attn.weight; a gated MLP's two inputs are two GEMMs) so that every op a
generated kernel sees is dense.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from eulergen.errors import EulerError
from eulergen.runtime.attention import head_dims
from eulergen.runtime.cuda_ops import workspace_elements
from eulergen.runtime.memory import Memory, Plan, Planner, check_fits, upload
from eulergen.runtime.tape import Add, Embedding, Grad, Linear, Op, Tape, cublas_nrm2

# norm-op weight inputs are named `weight`, then `bias`, as torch names them
_NORM_PARAM_NAMES = ("weight", "bias")
VOCAB_MULTIPLE = 64


def padded_vocab(vocab_size: int) -> int:
    """Rows of the token embedding and the tied LM head: the tokenizer's vocab rounded up
    to a multiple of 64 (50257 -> 50304, 256 stays), so the head's GEMM and the logits
    rows are aligned. Padded ids never occur in data (the loaders refuse ids past
    model.vocab_size) and the sampler never draws them."""
    return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    init: str   # 'normal' | 'residual' (normal scaled by 1/sqrt(2·layers)) | 'ones' | 'zeros'

    @property
    def decay(self) -> bool:
        """AdamW decays matrices only (GPT-2 / nanoGPT): not biases, not norm weights."""
        return len(self.shape) >= 2


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
    norm: str
    norm_weights: tuple[str, ...]     # 'weight'[, 'bias'] per norm, from the op's weight inputs
    norm_params: dict
    activation: str
    attention: str
    rope_params: dict
    # the manifest entries of the norm and attention ops: their backward kernels' float32
    # workspace (weight-gradient partials, attention's row dots) is sized from their plans
    norm_op: object = field(default=None, compare=False, repr=False)
    attention_op: object = field(default=None, compare=False, repr=False)
    embedding_op: object = field(default=None, compare=False, repr=False)

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
    """Check a ModelConfig against the ops it names; EulerError names the key at fault."""
    d, H, KVH = cfg.hidden_dim, cfg.num_heads, cfg.num_kv_heads
    if d % H:
        raise EulerError(f"hidden_dim {d} is not divisible by num_heads {H}", key="model.num_heads")
    if H % KVH:
        raise EulerError(f"num_heads {H} is not divisible by num_kv_heads {KVH}",
                         key="model.num_kv_heads")
    if cfg.num_layers < 1:
        raise EulerError(f"num_layers {cfg.num_layers}: need at least one block",
                         key="model.num_layers")
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
    attention = _need_op(lib, cfg.attention, "model.attention", ("attention",))
    if lib.backend.is_gpu:
        _check_head_dim(attention, d, H)
    if cfg.positions not in ("learned", "rope"):
        raise EulerError(f"positions {cfg.positions!r}: expected 'learned' or 'rope'",
                         key="model.positions")
    rope_params = {}
    if cfg.positions == "rope":
        rope = _need_op(lib, "rope", "model.positions", ("pair",))
        rope_params = _op_params(rope, {"base": float(cfg.rope_base)})
        if (d // H) % 2:
            raise EulerError(f"rope needs an even head dim, got {d // H}", key="model.hidden_dim")
    return Arch(d=d, layers=cfg.num_layers, heads=H, kv_heads=KVH, head_dim=d // H,
                vocab=cfg.vocab_size, max_seq=cfg.max_seq_len, ffn=cfg.mlp_hidden,
                gated=len(act.inputs) == 2, rope=cfg.positions == "rope", bias=bool(cfg.bias),
                norm=cfg.norm, norm_weights=_NORM_PARAM_NAMES[:len(weights)],
                norm_params=_op_params(norm, {"eps": float(cfg.norm_eps)}),
                activation=cfg.activation, attention=cfg.attention, rope_params=rope_params,
                norm_op=norm, attention_op=attention,
                embedding_op=_need_op(lib, "embedding", "model", ("embedding",)))


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


def parameters(a: Arch) -> list[ParamSpec]:
    """Every parameter in model order, named as torch names them."""
    ps = [ParamSpec("wte.weight", (a.vocab_rows, a.d), "normal")]
    if not a.rope:
        ps.append(ParamSpec("wpe.weight", (a.max_seq, a.d), "normal"))

    def norm(prefix):
        return [ParamSpec(f"{prefix}.{w}", (a.d,), "ones" if w == "weight" else "zeros")
                for w in a.norm_weights]

    def linear(prefix, out, inp, init="normal"):
        ps = [ParamSpec(f"{prefix}.weight", (out, inp), init)]
        return ps + ([ParamSpec(f"{prefix}.bias", (out,), "zeros")] if a.bias else [])

    fc_rows = 2 * a.ffn if a.gated else a.ffn
    for layer in range(a.layers):
        h = f"h.{layer}"
        ps += norm(f"{h}.ln_1")
        ps += linear(f"{h}.attn.c_attn", a.q_dim + 2 * a.kv_dim, a.d)
        ps += linear(f"{h}.attn.c_proj", a.d, a.q_dim, "residual")
        ps += norm(f"{h}.ln_2")
        ps += linear(f"{h}.mlp.c_fc", fc_rows, a.d)
        ps += linear(f"{h}.mlp.c_proj", a.d, a.ffn, "residual")
    return ps + norm("ln_f")


def param_count(a: Arch) -> int:
    return sum(math.prod(p.shape) for p in parameters(a))


def plan_params(p: Planner, a: Arch, dtype: str) -> None:
    """The params arena, the same for every model of an Arch (so a sampler can read the
    weights of the training model it sits beside): decayed matrices first, then the rest,
    so AdamW runs as two launches over two ranges."""
    specs = parameters(a)
    for spec in [s for s in specs if s.decay] + [s for s in specs if not s.decay]:
        p.add("params", spec.name, spec.shape, dtype)


def plan_model(a: Arch, batch: int, seq: int, *, training: bool = True,
               dtype: str = "float32") -> Plan:
    """Lay out parameters, (gradients, AdamW state,) activations and workspace."""
    if seq > a.max_seq:
        raise EulerError(f"seq_len {seq} exceeds the model's max_seq_len {a.max_seq}",
                         key="training.seq_len")
    B, T, N, d, F = batch, seq, batch * seq, a.d, a.ffn
    p = Planner()
    plan_params(p, a, dtype)
    total = p.plan().arena("params").size
    if training:
        # same layout as params: a parameter's gradient / moments sit at its offset
        for arena in ("grads", "adam_m", "adam_v"):
            p.add(arena, arena, (total,), dtype)

    for layer in range(a.layers):
        h = f"h.{layer}"
        p.add("activations", f"{h}.x", (B, T, d), dtype)
        p.add("activations", f"{h}.ln_1", (B, T, d), dtype)
        p.add("activations", f"{h}.q", (B, T, a.heads, a.head_dim), dtype)
        p.add("activations", f"{h}.k", (B, T, a.kv_heads, a.head_dim), dtype)
        p.add("activations", f"{h}.v", (B, T, a.kv_heads, a.head_dim), dtype)
        if a.rope:
            p.add("activations", f"{h}.q_rope", (B, T, a.heads, a.head_dim), dtype)
            p.add("activations", f"{h}.k_rope", (B, T, a.kv_heads, a.head_dim), dtype)
        p.add("activations", f"{h}.attn", (B, T, a.heads, a.head_dim), dtype)
        p.add("activations", f"{h}.lse", (B, a.heads, T), dtype)
        p.add("activations", f"{h}.x_mid", (B, T, d), dtype)
        p.add("activations", f"{h}.ln_2", (B, T, d), dtype)
        for name in (("fc_a", "fc_b") if a.gated else ("fc",)):
            p.add("activations", f"{h}.{name}", (B, T, F), dtype)
        p.add("activations", f"{h}.act", (B, T, F), dtype)
    p.add("activations", "x_final", (B, T, d), dtype)
    p.add("activations", "ln_f", (B, T, d), dtype)
    p.add("activations", "logits", (N, a.vocab_rows), dtype)   # the fused cross-entropy
    p.add("activations", "losses", (N,), dtype)            # overwrites it with dlogits
    p.add("activations", "loss", (1,), dtype)

    p.add("workspace", "proj", (B, T, d), dtype)        # a branch's output before its residual add
    p.add("workspace", "dloss", (N,), dtype)            # d(mean loss)/d(row loss), constant
    if a.bias:
        p.add("workspace", "ones", (1, N), dtype)       # bias gradients as a GEMM: 1ᵀ·dy
    if training:
        p.add("workspace", "d.x", (B, T, d), dtype)     # residual stream: shared by every block
        p.add("workspace", "d.ln", (B, T, d), dtype)
        for name, heads in (("q", a.heads), ("k", a.kv_heads), ("v", a.kv_heads)):
            p.add("workspace", f"d.{name}", (B, T, heads, a.head_dim), dtype)
        if a.rope:
            p.add("workspace", "d.q_rope", (B, T, a.heads, a.head_dim), dtype)
            p.add("workspace", "d.k_rope", (B, T, a.kv_heads, a.head_dim), dtype)
        p.add("workspace", "d.attn", (B, T, a.heads, a.head_dim), dtype)
        for name in (("fc_a", "fc_b") if a.gated else ("fc",)):
            p.add("workspace", f"d.{name}", (B, T, F), dtype)
        p.add("workspace", "d.act", (B, T, F), dtype)
        # gradients that are added rather than written (a norm's dx into the stream, and
        # its weights on later micro-steps) pass through here: dx plus two weight rows
        p.add("workspace", "scratch", (N * d + 2 * d,), dtype)
        # float32 workspace of the generated backward kernels, reused call after call
        # (one stream: a call's kernels have read it before the next call writes it)
        kernel_ws = max(workspace_elements(a.norm_op, "backward", (B, T, d)),
                        workspace_elements(a.attention_op, "backward",
                                           (B, T, a.heads, a.head_dim)),
                        workspace_elements(a.embedding_op, "backward", (B, T),
                                           table_rows=a.vocab_rows))
        if kernel_ws:
            p.add("kernels", "kernel_ws", (kernel_ws,), "float32")
    p.add("tokens", "idx", (B, T), "int32")
    p.add("tokens", "targets", (B, T), "int32")
    return p.plan()


class GPT:
    """The model over one planned Memory, for a fixed batch and sequence length.

    `loss_and_grad()` runs forward, the fused cross-entropy (loss and dlogits in one pass)
    and the reversed tape, leaving the gradients in the grads arena; `loss()` runs forward
    and the loss only; `logits()` runs forward over the whole window."""

    def __init__(self, arch: Arch, lib, memory: Memory, batch: int, seq: int, *,
                 tf32: bool = False):
        self.arch, self.lib, self.mem = arch, lib, memory
        self.backend = lib.backend
        self.xp = lib.backend.xp
        self.batch, self.seq = batch, seq
        self.training = "grads" in memory.arenas
        self.specs = parameters(arch)
        self.param_total = param_count(arch)
        plan = memory.plan
        self.params = {s.name: memory[s.name] for s in self.specs}
        self.grads = {}
        if self.training:
            flat = memory.arenas["grads"]
            for s in self.specs:
                b = plan.buffer(s.name)
                self.grads[s.name] = flat[b.offset:b.offset + b.size].reshape(b.shape)
        if arch.bias:
            memory["ones"][...] = 1
        self.set_accumulation(1)
        self.tape = Tape(self.backend, lib, memory["scratch"] if self.training else None,
                         memory["kernel_ws"] if "kernel_ws" in memory else None, tf32=tf32)
        self._record()

    # -- the graph --------------------------------------------------------------------

    def _rows(self, t):
        """A [B, T, …] activation as the [B·T, features] matrix a GEMM reads (a view)."""
        return t.reshape(self.batch * self.seq, -1)

    def _g(self, name: str, *, add=False, param=False) -> Grad | None:
        """A gradient destination: a workspace buffer, or a parameter's gradient."""
        if not self.training:
            return None
        if param:
            return Grad(self.grads[name], add=add, param=True)
        return Grad(self.mem[name], add=add)

    def _norm(self, prefix: str, x, y, dx_add: bool) -> Op:
        a, m = self.arch, self.mem
        weights = [self.params[f"{prefix}.{w}"] for w in a.norm_weights]
        return Op(a.norm, (x, *weights), (y,), (m["d.ln"],) if self.training else (),
                  (self._g("d.x", add=dx_add), *[self._g(f"{prefix}.{w}", param=True)
                                                  for w in a.norm_weights]),
                  a.norm_params)

    def _linear(self, x, name: str, y, dy_name: str, dx_name: str | None, *, dx_add=False,
                rows: slice = slice(None)) -> Linear:
        """y = x @ W[rows].T (+ b[rows]) for parameter `name` (a row block of it for q/k/v)."""
        a, m, tr, flat = self.arch, self.mem, self.training, self._rows
        w = self.params[f"{name}.weight"][rows]
        b = self.params[f"{name}.bias"][rows] if a.bias else None
        dw = Grad(self.grads[f"{name}.weight"][rows], param=True) if tr else None
        db = Grad(self.grads[f"{name}.bias"][rows], param=True) if tr and a.bias else None
        dx = Grad(flat(m[dx_name]), add=dx_add) if tr and dx_name else None
        dy = flat(m[dy_name]) if tr else None
        return Linear(flat(x), w, flat(y), dy, dx, dw, b, db, m["ones"] if a.bias else None)

    def _record(self) -> None:
        a, m, tape, tr = self.arch, self.mem, self.tape, self.training
        tape.record(Embedding(m["idx"], self.params["wte.weight"], m["h.0.x"],
                              m["d.x"] if tr else None,
                              Grad(self.grads["wte.weight"], add=True) if tr else None,
                              None if a.rope else self.params["wpe.weight"],
                              None if a.rope or not tr else self._g("wpe.weight", param=True)))
        for layer in range(a.layers):
            h = f"h.{layer}"
            x = m[f"{h}.x"]
            x_next = m[f"h.{layer + 1}.x"] if layer + 1 < a.layers else m["x_final"]
            tape.record(self._norm(f"{h}.ln_1", x, m[f"{h}.ln_1"], dx_add=True))
            # q, k, v: three GEMMs; backward runs them v, k, q, so v writes d.ln first
            q_rows = slice(0, a.q_dim)
            k_rows = slice(a.q_dim, a.q_dim + a.kv_dim)
            v_rows = slice(a.q_dim + a.kv_dim, a.q_dim + 2 * a.kv_dim)
            for part, rows in (("q", q_rows), ("k", k_rows), ("v", v_rows)):
                tape.record(self._linear(m[f"{h}.ln_1"], f"{h}.attn.c_attn", m[f"{h}.{part}"],
                                         f"d.{part}", "d.ln", dx_add=part != "v", rows=rows))
            q, k = m[f"{h}.q"], m[f"{h}.k"]
            if a.rope:
                for part in ("q", "k"):
                    tape.record(Op("rope", (m[f"{h}.{part}"],), (m[f"{h}.{part}_rope"],),
                                   (m[f"d.{part}_rope"],) if tr else (),
                                   (self._g(f"d.{part}"),), a.rope_params))
                q, k = m[f"{h}.q_rope"], m[f"{h}.k_rope"]
            o, lse = m[f"{h}.attn"], m[f"{h}.lse"]
            dq, dk = ("d.q_rope", "d.k_rope") if a.rope else ("d.q", "d.k")
            tape.record(Op(a.attention, (q, k, m[f"{h}.v"]), (o, lse),
                           (m["d.attn"],) if tr else (),
                           (self._g(dq), self._g(dk), self._g("d.v")), {}, saved=(o, lse)))
            tape.record(self._linear(o, f"{h}.attn.c_proj", m["proj"], "d.x", "d.attn"))
            tape.record(Add(x, m["proj"], m[f"{h}.x_mid"]))
            tape.record(self._norm(f"{h}.ln_2", m[f"{h}.x_mid"], m[f"{h}.ln_2"], dx_add=True))
            if a.gated:
                F = a.ffn
                # backward runs b then a: b writes d.ln, a adds
                tape.record(self._linear(m[f"{h}.ln_2"], f"{h}.mlp.c_fc", m[f"{h}.fc_a"],
                                         "d.fc_a", "d.ln", dx_add=True, rows=slice(0, F)))
                tape.record(self._linear(m[f"{h}.ln_2"], f"{h}.mlp.c_fc", m[f"{h}.fc_b"],
                                         "d.fc_b", "d.ln", rows=slice(F, 2 * F)))
                act_in, d_act_in = (m[f"{h}.fc_a"], m[f"{h}.fc_b"]), ("d.fc_a", "d.fc_b")
            else:
                tape.record(self._linear(m[f"{h}.ln_2"], f"{h}.mlp.c_fc", m[f"{h}.fc"],
                                         "d.fc", "d.ln"))
                act_in, d_act_in = (m[f"{h}.fc"],), ("d.fc",)
            tape.record(Op(a.activation, act_in, (m[f"{h}.act"],), (m["d.act"],) if tr else (),
                           tuple(self._g(n) for n in d_act_in), {}))
            tape.record(self._linear(m[f"{h}.act"], f"{h}.mlp.c_proj", m["proj"], "d.x", "d.act"))
            tape.record(Add(m[f"{h}.x_mid"], m["proj"], x_next))
        tape.record(self._norm("ln_f", m["x_final"], m["ln_f"], dx_add=False))
        # tied LM head; its gradient arrives as dlogits written over the logits
        tape.record(Linear(self._rows(m["ln_f"]), self.params["wte.weight"], m["logits"],
                           m["logits"] if tr else None,
                           Grad(self._rows(m["d.ln"])) if tr else None,
                           self._g("wte.weight", param=True)))

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

    def loss(self):
        """Mean cross-entropy of the loaded batch, as a 1-element device array."""
        m = self.mem
        self.tape.forward()
        self.lib.forward("cross_entropy", m["logits"], m["targets"].reshape(-1),
                         out=(m["losses"],))
        self.xp.mean(m["losses"], keepdims=True, out=m["loss"])
        return m["loss"]

    def loss_and_grad(self, *, accumulate: bool = False):
        """Forward, loss and backward for the loaded batch. With `accumulate`, parameter
        gradients add to those already in the grads arena (a later micro-step)."""
        m = self.mem
        self.tape.forward()
        self.lib.fused("cross_entropy", m["logits"], m["targets"].reshape(-1), m["dloss"],
                       out=(m["losses"], m["logits"]))
        self.xp.mean(m["losses"], keepdims=True, out=m["loss"])
        self.tape.accumulating = accumulate
        self.tape.backward()
        return m["loss"]

    def grad_norm(self) -> float:
        """The global L2 norm of the gradients, read to the host. On the GPU it is cuBLAS's
        snrm2 straight into a host scalar: `cupy.dot(g, g)` would allocate a temporary the
        size of every gradient (CuPy multiplies, then sums), outside the plan."""
        g = self.mem.arenas["grads"]
        if self.backend.is_gpu:
            return cublas_nrm2(g)
        return math.sqrt(float(np.dot(g, g)))

    # -- weights ----------------------------------------------------------------------

    def init_weights(self, seed: int) -> None:
        """GPT-2's init: N(0, 0.02), residual projections N(0, 0.02/sqrt(2·layers)), biases
        zero, norm weights one. One generator per run, parameters drawn in model order."""
        rng = np.random.Generator(np.random.PCG64(seed))
        std = {"normal": 0.02, "residual": 0.02 / math.sqrt(2 * self.arch.layers)}
        for s in self.specs:
            view = self.params[s.name]
            if s.init in std:
                host = rng.standard_normal(s.shape, dtype=np.float64) * std[s.init]
            else:
                host = np.full(s.shape, 1.0 if s.init == "ones" else 0.0)
            upload(view, host)

    def state_dict(self) -> dict:
        """Parameter name -> host array (a copy), in model order."""
        return {s.name: self.backend.asnumpy(self.params[s.name]).copy() for s in self.specs}

    def load_state_dict(self, state: dict) -> None:
        load_params(self.params, state)


def load_params(params: dict, state: dict) -> None:
    """Copy a state dict (name -> host array) into a model's parameter views. Every name
    and shape is checked before anything is written: a checkpoint of another architecture
    (or an unpadded vocab) is one error naming the tensor and both shapes, and the model
    keeps its weights."""
    missing = [name for name in params if name not in state]
    extra = sorted(set(state) - set(params))
    if missing or extra:
        what = f"missing {missing[0]!r}" if missing else f"unexpected {extra[0]!r}"
        raise EulerError(f"weights do not fit this model: {what}", key="model")
    for name, view in params.items():
        shape = tuple(np.shape(state[name]))
        if shape != tuple(view.shape):
            raise EulerError(f"{name} has shape {shape}, the model wants {tuple(view.shape)} "
                             "(a checkpoint of another architecture?)", key="model")
    for name, view in params.items():
        upload(view, state[name])


def ops_used(cfg) -> tuple[str, ...]:
    """The ops a run of this ModelConfig calls: what `eulergen train` builds before it starts."""
    return tuple(dict.fromkeys((cfg.norm, cfg.activation, cfg.attention, "cross_entropy", "adamw")
                               + (("rope",) if cfg.positions == "rope" else ())))


def build(cfg, lib, batch: int, seq: int, *, training: bool = True, dtype: str = "float32",
          shared: dict | None = None, tf32: bool = False) -> GPT:
    """Plan, allocate and record a model: the one call the trainer and sampler make."""
    arch = arch_of(cfg, lib)
    plan = plan_model(arch, batch, seq, training=training, dtype=dtype)
    check_fits(plan, lib.backend, shared)
    return GPT(arch, lib, Memory(plan, lib.backend.xp, shared=shared), batch, seq, tf32=tf32)
