"""The KV-cache inference graph: a forward-only model that keeps every layer's keys and
values, so that a new token costs one position's work instead of the whole window's.

    dec = build_decoder(cfg.model, lib, batch=B, seq=S)   # S ≤ model.max_seq_len
    logits = dec.prefill(ids)        # host ids [B, Tp]: the cache filled from position 0
    logits = dec.decode(next_ids)    # host ids [B] (or [B, 1]): one position more
    # logits: the device array [B, vocab_rows] of the last position

A step over Tq new tokens at absolute positions pos0 … pos0+Tq-1 makes the training
graph's op library calls at Tq rows: the embedding (learned positions from wpe[pos0]),
then per block the norm, one GEMM over all of c_attn.weight (q, k and v are strided
views of its output: fewer launches than training's three dense GEMMs, which the
backward wants), rope on q and k at pos0, k and v copied into the cache at pos0, the new
queries' attention over the cache through `lib.decode`, c_proj and the residual add, the
norm, the MLP GEMMs, the activation, c_proj and the add. The final norm and the tied head
run on the last position only: sampling reads nothing else.

Steps run eagerly. At batch 1 a GPT-2 124M step is ~200 small launches and host-bound
(~4 ms on an H200, benchmarks/sample.py); replaying the position-independent runs of the
decode tape as CUDA graphs would cut that, but CuPy 14.2 refuses cuBLAS calls during
stream capture (NotImplementedError, seen on the H200), so that needs a GEMM path
outside CuPy's wrapper first.

The cache holds `seq` positions. A step that would write past them crops: the decoder
keeps the last seq // 2 tokens it holds (with the new ones) and prefills them again, so
positions restart at 0 and the model never sees more than `seq` tokens, as in training.
"""
from __future__ import annotations

from math import prod

import numpy as np

from eulergen.errors import EulerError
from eulergen.runtime.memory import Memory, Plan, Planner, check_fits, upload
from eulergen.runtime.model import arch_of, load_params, parameters, plan_params
from eulergen.runtime.tape import Add, Linear, Op, Tape


def plan_decoder(a, batch: int, seq: int, *, dtype: str = "float32") -> Plan:
    """Parameters (the training layout), the KV cache ([B, seq, KVH, D] k and v per
    layer), one block's activations at up to B·seq rows (blocks run one after another and
    keep nothing), the last position's logits, and the token ids."""
    if seq > a.max_seq:
        raise EulerError(f"sampling context {seq} exceeds the model's max_seq_len {a.max_seq}",
                         key="training.seq_len")
    B, T, d, F = batch, seq, a.d, a.ffn
    p = Planner()
    plan_params(p, a, dtype)
    for layer in range(a.layers):
        for part in ("k", "v"):
            p.add("kv_cache", f"h.{layer}.{part}_cache", (B, T, a.kv_heads, a.head_dim), dtype)
    p.add("activations", "x", (B, T, d), dtype)        # the residual stream, added in place
    p.add("activations", "ln", (B, T, d), dtype)
    # q, k and v from one GEMM over all of c_attn: heads [q…, k…, v…] of head_dim each
    p.add("activations", "qkv", (B, T, a.heads + 2 * a.kv_heads, a.head_dim), dtype)
    if a.rope:
        p.add("activations", "q_rope", (B, T, a.heads, a.head_dim), dtype)
        p.add("activations", "k_rope", (B, T, a.kv_heads, a.head_dim), dtype)
    p.add("activations", "attn", (B, T, a.heads, a.head_dim), dtype)
    p.add("activations", "proj", (B, T, d), dtype)
    for name in (("fc_a", "fc_b") if a.gated else ("fc",)):
        p.add("activations", name, (B, T, F), dtype)
    p.add("activations", "act", (B, T, F), dtype)
    p.add("activations", "last", (B, d), dtype)        # the last position's stream
    p.add("activations", "ln_f", (B, d), dtype)
    p.add("activations", "logits", (B, a.vocab_rows), dtype)
    p.add("tokens", "idx", (B, T), "int32")
    return p.plan()


class Cursor:
    """The first position of the step being run: the nodes that depend on it (embedding,
    rope, cache writes, attention) read it at run time, so one recorded decode tape serves
    every position."""

    def __init__(self):
        self.pos0 = 0


class Embed:
    """x = wte[ids] (+ wpe[pos0 … pos0+Tq-1]): the embedding op with wpe's rows from pos0."""

    def __init__(self, ids, wte, wpe, out, cursor: Cursor):
        self.ids, self.wte, self.wpe, self.out, self.cursor = ids, wte, wpe, out, cursor

    def forward(self, tape: Tape) -> None:
        p, T = self.cursor.pos0, self.ids.shape[1]
        wpe = None if self.wpe is None else self.wpe[p:p + T]
        tape.lib.forward("embedding", self.ids, self.wte, wpe, out=(self.out,))


class Rope:
    """y = rope(x) with the first row at absolute position pos0."""

    def __init__(self, x, y, params: dict, cursor: Cursor):
        self.x, self.y, self.params, self.cursor = x, y, params, cursor

    def forward(self, tape: Tape) -> None:
        tape.lib.forward("rope", self.x, out=(self.y,), pos0=self.cursor.pos0, **self.params)


class Attend:
    """k and v written into the cache at pos0, then o = attention of the new queries over
    cache positions 0 … pos0+Tq-1 (lib.decode: the op's score, mask and params)."""

    def __init__(self, op: str, q, k, v, k_cache, v_cache, o, cursor: Cursor):
        self.op, self.q, self.k, self.v, self.o = op, q, k, v, o
        self.k_cache, self.v_cache, self.cursor = k_cache, v_cache, cursor

    def forward(self, tape: Tape) -> None:
        p, T = self.cursor.pos0, self.q.shape[1]
        self.k_cache[:, p:p + T] = self.k
        self.v_cache[:, p:p + T] = self.v
        tape.lib.decode(self.op, self.q, self.k_cache, self.v_cache, p, out=self.o)


class TakeLast:
    """out [B, d] = x[:, -1]: the only position the head and the sampler need."""

    def __init__(self, x, out):
        self.x, self.out = x, out

    def forward(self, tape: Tape) -> None:
        self.out[...] = self.x[:, -1]


class Decoder:
    """The model over one planned Memory with a KV cache, for a fixed batch and context."""

    def __init__(self, arch, lib, memory: Memory, batch: int, seq: int, *, tf32: bool = False):
        self.arch, self.lib, self.mem = arch, lib, memory
        self.backend = lib.backend
        self.batch, self.seq = batch, seq
        self.params = {s.name: memory[s.name] for s in parameters(arch)}
        self.cursor = Cursor()
        self.tf32 = tf32
        self.length = 0                                  # cache positions holding tokens
        self.tokens = np.zeros((batch, seq), np.int64)   # those tokens: a crop prefills them
        self._decode_tape = self._record(1)
        self.logits = memory["logits"]

    # -- the graph at Tq rows ---------------------------------------------------------

    def _at(self, name: str, rows: int):
        """The first `rows` positions of a [B, seq, …] buffer as a dense [B, rows, …] view."""
        full = self.mem[name]
        shape = (self.batch, rows) + tuple(full.shape[2:])
        return full.reshape(-1)[:prod(shape)].reshape(shape)

    def _record(self, rows: int) -> Tape:
        a, m, P, cur = self.arch, self.mem, self.params, self.cursor
        tape = Tape(self.backend, self.lib, None, tf32=self.tf32)
        at = self._at

        def flat(t):
            return t.reshape(self.batch * rows, -1)

        def linear(x, name, y, row_block=slice(None)):
            b = P[f"{name}.bias"][row_block] if a.bias else None
            tape.record(Linear(flat(x), P[f"{name}.weight"][row_block], flat(y),
                               None, None, None, b))

        def norm(prefix, x, y):
            tape.record(Op(a.norm, (x, *[P[f"{prefix}.{w}"] for w in a.norm_weights]), (y,),
                           (), (), a.norm_params))

        x, ln, proj, qkv = at("x", rows), at("ln", rows), at("proj", rows), at("qkv", rows)
        tape.record(Embed(at("idx", rows), P["wte.weight"],
                          None if a.rope else P["wpe.weight"], x, cur))
        H, KVH = a.heads, a.kv_heads
        for layer in range(a.layers):
            h = f"h.{layer}"
            norm(f"{h}.ln_1", x, ln)
            linear(ln, f"{h}.attn.c_attn", qkv)
            q, k, v = qkv[:, :, :H], qkv[:, :, H:H + KVH], qkv[:, :, H + KVH:]   # strided views
            if a.rope:
                q_rope, k_rope = at("q_rope", rows), at("k_rope", rows)
                tape.record(Rope(q, q_rope, a.rope_params, cur))
                tape.record(Rope(k, k_rope, a.rope_params, cur))
                q, k = q_rope, k_rope
            o = at("attn", rows)
            tape.record(Attend(a.attention, q, k, v, m[f"{h}.k_cache"], m[f"{h}.v_cache"], o,
                               cur))
            linear(o, f"{h}.attn.c_proj", proj)
            tape.record(Add(x, proj, x))
            norm(f"{h}.ln_2", x, ln)
            if a.gated:
                fc = (at("fc_a", rows), at("fc_b", rows))
                linear(ln, f"{h}.mlp.c_fc", fc[0], slice(0, a.ffn))
                linear(ln, f"{h}.mlp.c_fc", fc[1], slice(a.ffn, 2 * a.ffn))
            else:
                fc = (at("fc", rows),)
                linear(ln, f"{h}.mlp.c_fc", fc[0])
            act = at("act", rows)
            tape.record(Op(a.activation, fc, (act,), (), (), {}))
            linear(act, f"{h}.mlp.c_proj", proj)
            tape.record(Add(x, proj, x))
        tape.record(TakeLast(x, m["last"]))
        norm("ln_f", m["last"], m["ln_f"])
        tape.record(Linear(m["ln_f"], P["wte.weight"], m["logits"], None, None, None))
        return tape

    # -- running it -------------------------------------------------------------------

    def prefill(self, ids):
        """Empty the cache and run `ids` [B, Tp] (host ints, Tp ≤ seq) from position 0;
        the device logits [B, vocab_rows] of position Tp-1."""
        ids = self._check(ids)
        if ids.shape[1] > self.seq:
            raise EulerError(f"{ids.shape[1]} tokens do not fit the decoder's context of "
                             f"{self.seq}", key="prompt")
        self.length = 0
        return self._run(ids)

    def decode(self, ids):
        """One more position: ids [B] or [B, 1] (host ints) appended to the cache, cropping
        first when it is full (module docstring)."""
        return self.append(np.asarray(ids).reshape(self.batch, 1))

    def append(self, ids):
        """`ids` [B, Tq] (host ints) at the next positions; when they do not fit, the last
        seq // 2 tokens held (the new ones included) are prefilled again."""
        ids = self._check(ids)
        if self.length + ids.shape[1] > self.seq:
            held = np.concatenate([self.tokens[:, :self.length], ids], axis=1)
            return self.prefill(held[:, -(self.seq // 2):])
        return self._run(ids)

    def _check(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.ndim != 2 or ids.shape[0] != self.batch or ids.shape[1] == 0:
            raise EulerError(f"token ids of shape {ids.shape}: the decoder wants "
                             f"[{self.batch}, ≥ 1]", key="prompt")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.arch.vocab:
            raise EulerError(f"token id {hi if hi >= self.arch.vocab else lo} is outside the "
                             f"model's vocabulary of {self.arch.vocab}", key="model.vocab_size")
        return ids

    def _run(self, ids: np.ndarray):
        rows, pos0 = ids.shape[1], self.length
        upload(self._at("idx", rows), ids)
        self.cursor.pos0 = pos0
        (self._decode_tape if rows == 1 else self._record(rows)).forward()
        self.tokens[:, pos0:pos0 + rows] = ids
        self.length = pos0 + rows
        return self.logits

    def load_state_dict(self, state: dict) -> None:
        load_params(self.params, state)


def build_decoder(cfg, lib, batch: int, seq: int, *, dtype: str = "float32",
                  params=None, tf32: bool = False) -> Decoder:
    """Plan, allocate and record a KV-cache model; `params` is an existing params arena to
    read the weights from (a training model's: nothing is copied)."""
    arch = arch_of(cfg, lib)
    plan = plan_decoder(arch, batch, seq, dtype=dtype)
    shared = {"params": params} if params is not None else None
    check_fits(plan, lib.backend, shared)
    return Decoder(arch, lib, Memory(plan, lib.backend.xp, shared=shared), batch, seq,
                   tf32=tf32)
