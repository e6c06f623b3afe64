"""The GPT model over its memory plan (runtime/model/plan.py), its forward pass recorded on
a tape, for the shape runtime/model/arch.py checks against the ops it names.

Pre-norm blocks, x → x + attn(norm(x)) → x + mlp(norm(x)), with the norm, the
activation and the attention named by op (ModelConfig.norm / activation / attention),
so `--set model.activation=myact` swaps the generated kernels and nothing else. An
activation op with two inputs makes the MLP gated: c_fc's rows 0..F-1 feed its first
input, rows F..2F-1 its second. Token embedding tied to the LM head, learned positions
or RoPE (the `rope` op on q and k), grouped-query attention, final norm, cross-entropy
averaged over tokens. The graph is runtime/model/graph.py's (each residual add folded into the
norm after it, c_fc's bias into the activation: the ops' generated fused variants); the
parameters runtime/model/params.py's.

c_attn is one GEMM into `qkv` [B, T, H + 2·KVH, D] (bias included); q, k and v are views of
its heads, which RoPE (in place, one call over q and k where the rope op allows it) and
the attention kernels read through their strides; their gradients are the same views of
one `d.qkv`, so c_attn's backward is one GEMM for dx, one for dW and one for the bias. A
gated MLP's two inputs are two GEMMs over row blocks of c_fc.weight (dense: pointwise
kernels read them as flat arrays).
"""
from __future__ import annotations

import math

import numpy as np

from eulergen.errors import EulerError
from eulergen.runtime.engine import bf16
from eulergen.runtime.model.loss import loss_mean
from eulergen.runtime.model.arch import Arch, arch_of
from eulergen.runtime.model.memory import Memory, Plan, check_fits, upload
from eulergen.runtime.model.params import load_params, param_count, parameters
from eulergen.runtime.model.plan import plan_on
from eulergen.runtime.model.tape import Tape
from eulergen.runtime.model.training_tape import record_training

# the padded vocab rows' logit in bf16 storage, rounded once here, not at every step
_NEG_INF_BF16 = bf16.bits(-np.inf)


class GPT:
    """The model over one planned Memory, for a fixed batch and sequence length.

    `loss_and_grad()` runs forward, the fused cross-entropy (loss and dlogits in one pass)
    and the reversed tape, leaving the gradients in the grads arena; `loss()` runs forward
    and the loss only; `logits()` runs forward over the whole window.

    `master` are the weights a checkpoint holds and AdamW updates, `params` the ones the
    tape reads: the same arrays, except in a bf16 plan, where `params` is the bf16 copy
    (`params_bf16`) that `sync_weights()` rounds from the float32 master after every
    change. `autocast`: a bf16 plan in autocast precision (its `stream` arena: plan.py's
    Precision), whose norms and embedding read the master weights, its gradients float32."""

    def __init__(self, arch: Arch, lib, memory: Memory, batch: int, seq: int, *,
                 tf32: bool = False):
        self.arch, self.lib, self.mem = arch, lib, memory
        self.backend = lib.backend
        self.xp = lib.backend.xp
        self.batch, self.seq = batch, seq
        self.training = "grads" in memory.arenas
        self.bf16 = "params_bf16" in memory.arenas
        self.autocast = "stream" in memory.arenas
        self.bf16_grads = self.training and memory.arenas["grads"].dtype == np.uint16
        self.specs = parameters(arch)
        self.param_total = param_count(arch)
        self.master = {s.name: memory[s.name] for s in self.specs}
        self.params = self._views("params_bf16") if self.bf16 else self.master
        self.grads = self._views("grads") if self.training else {}
        if arch.bias:
            memory["ones"][...] = bf16.bits(1.0) if self.bf16 else 1
        self.set_accumulation(1)
        self.tape = Tape(self.backend, lib, memory["scratch"] if self.training else None,
                         memory["kernel_ws"] if "kernel_ws" in memory else None, tf32=tf32,
                         gemm_ws=memory["gemm_ws"] if "gemm_ws" in memory else None)
        self.graph = arch.graph
        record_training(self)

    def _views(self, arena: str) -> dict:
        """Each parameter's view into an arena laid out as params (grads, the bf16 copy)."""
        flat, plan = self.mem.arenas[arena], self.mem.plan
        return {s.name: flat[b.offset:b.offset + b.size].reshape(b.shape)
                for s in self.specs for b in (plan.buffer(s.name),)}

    # -- running it -------------------------------------------------------------------

    def set_accumulation(self, micro_steps: int, ranks: int = 1) -> None:
        """The loss is the mean over all tokens of all micro-steps of a step, of all `ranks`
        (whose gradients are then summed: PyTorch DDP's division before the all-reduce)."""
        self.mem["dloss"][...] = 1.0 / (self.batch * self.seq * micro_steps * ranks)

    def load_tokens(self, idx, targets=None) -> None:
        """Copy a [B, T] batch (host integers) into the planned token buffers, checked."""
        for name, ids in (("idx", idx), ("targets", targets)):
            if ids is not None:
                upload(self.mem[name], self.check_tokens(ids))

    def check_tokens(self, ids) -> np.ndarray:
        """Ids as an array, checked on the host (check_ids)."""
        return check_ids(np.asarray(ids), self.arch.vocab,
                         " (a dataset tokenized for another vocab?)")

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
        loss_mean(m["losses"], m["loss"])
        return m["loss"]

    def loss_and_grad(self, *, accumulate: bool = False, after=None):
        """Forward, loss and backward for the loaded batch. With `accumulate`, parameter
        gradients add to those already in the grads arena (a later micro-step). `after`:
        Tape.backward's hook."""
        m = self.mem
        self.tape.forward()
        self._mask_padding()
        self.lib.fused(self.arch.ops.loss, m["logits"], m["targets"].reshape(-1), m["dloss"],
                       out=(m["losses"], m["logits"]))
        loss_mean(m["losses"], m["loss"])
        self.tape.accumulating = accumulate
        self.tape.backward(after)
        return m["loss"]

    def grad_norm(self, out=None):
        """The global L2 norm of the gradients, written into `out` (a 1-element array, no
        host read: what a captured step does), or, without one, returned as a float. On
        the GPU cuBLAS's snrm2 into the float32 `out` (default: the planned `grad_norm`),
        on numpy the float64 norm of numpy's float32 dot. bf16 gradients: float32 norms of
        rows of the arena into the planned `grad_rows`, then snrm2 of those (cuBLAS has no
        bf16 norm with a float32 result)."""
        g = self.mem.arenas["grads"]
        if self.bf16_grads:
            rows = self.mem["grad_rows"]
            bf16.row_norms(g.reshape(rows.size, -1), rows)
            g = rows
        if self.backend.is_gpu:
            into = self.mem["grad_norm"] if out is None else out
            self.tape.blas.nrm2(g, into)
            return float(into[0]) if out is None else None
        norm = math.sqrt(float(np.dot(g, g)))
        if out is not None:
            out[0] = norm
        return norm if out is None else None

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


def check_ids(ids: np.ndarray, vocab: int, hint: str = "") -> np.ndarray:
    """`ids`, refused where one is outside [0, vocab): an id past the table would index
    outside it, and the kernels would trap only at the next synchronisation. `hint`
    ends the message."""
    lo, hi = (int(ids.min()), int(ids.max())) if ids.size else (0, 0)
    if lo < 0 or hi >= vocab:
        raise EulerError(f"token id {hi if hi >= vocab else lo} is outside the model's "
                         f"vocabulary of {vocab}{hint}", key="model.vocab_size")
    return ids


def build(cfg, lib, batch: int, seq: int, *, training: bool = True, dtype: str = "float32",
          precision: str = "bf16", shared: dict | None = None, tf32: bool = False,
          buckets=None, recompute: str = "none", optimizer=None) -> GPT:
    """Resolve, plan, allocate and record a model from a ModelConfig (what evaluation and
    the tests make; a training run resolves its own once, runtime/train/resolve.py).
    `dtype`: "float32", "bf16" (a GPU with bf16 only) or "float64" (numpy); `precision`:
    training.precision (plan.py's Precision); `shared`: arenas allocated already
    (Memory's); `recompute`: training.recompute (runtime/model/recompute.py); `optimizer`: the
    UpdateOps whose state the plan holds (runtime/model/optimizer_plan.py; None: none)."""
    arch = arch_of(cfg, lib)
    if dtype == "bf16":
        bf16.plan_dtype("bf16", lib.backend)
    plan = plan_on(lib, arch, batch, seq, training=training, dtype=dtype, precision=precision,
                   buckets=buckets, recompute=recompute, optimizer=optimizer)
    return allocate(arch, lib, plan, batch, seq, shared=shared, tf32=tf32)


def allocate(arch: Arch, lib, plan: Plan, batch: int, seq: int, *,
             shared: dict | None = None, tf32: bool = False) -> GPT:
    """The GPT of a planned Arch: the plan checked against the GPU's free memory, then
    allocated (but the arenas in `shared`) and its tape recorded."""
    check_fits(plan, lib.backend, shared)
    return GPT(arch, lib, Memory(plan, lib.backend.xp, shared=shared), batch, seq, tf32=tf32)
