"""The KV-cache inference graph: a forward-only model that keeps every layer's keys and
values, so that a new token costs one position's work instead of the whole window's.

    dec = build_decoder(cfg.model, lib, batch=B, seq=S)   # S ≤ model.max_seq_len
    logits = dec.prefill(ids)        # host ids [B, Tp]: the cache filled from position 0
    logits = dec.decode(next_ids)    # host ids [B] (or [B, 1]): one position more
    # logits: the device array [B, vocab_rows] of the last position

A step over Tq new tokens at absolute positions pos0 … pos0+Tq-1 makes the training
graph's op library calls at Tq rows (both are built from runtime/graph.py): the
embedding (learned positions from wpe[pos0]) and the first norm, then per block one GEMM
over all of c_attn.weight (q, k and v are strided
views of its output: fewer launches than training's three dense GEMMs, which the
backward wants), rope on q and k at pos0, k and v copied into the cache at pos0, the new
queries' attention over the cache through `lib.decode`, c_proj, the residual add with
the norm, the MLP GEMMs, the activation (with c_fc's bias), c_proj and the add with the
next norm (after the last block, the final one). The tied head runs on the last position
only: sampling reads nothing else.

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
from eulergen.runtime.graph import fused_shape, model_graph
from eulergen.runtime.model import arch_of
from eulergen.runtime.params import load_params, parameters, plan_params
from eulergen.runtime.tape import Linear, Norm, Op, Tape


def plan_decoder(a, batch: int, seq: int, *, dtype: str = "float32") -> Plan:
    """Parameters (the training layout), the KV cache ([B, seq, KVH, D] k and v per
    layer), one block's activations at up to B·seq rows (blocks run one after another and
    keep nothing: each value in its graph.py slot), the last position's norm and logits,
    and the token ids."""
    if seq > a.max_seq:
        raise EulerError(f"sampling context {seq} exceeds the model's max_seq_len {a.max_seq}",
                         key="training.seq_len")
    B, T = batch, seq
    g = model_graph(a)
    p = Planner()
    plan_params(p, a, dtype)
    attention = next(n for n in g.block if n.kind == "attention")
    for layer in range(a.layers):
        for part, name in zip(("k", "v"), attention.inputs[1:]):
            p.add("kv_cache", f"h.{layer}.{part}_cache", g.values[name].shape((B, T)), dtype)
    for buffer, shape in _block_buffers(g, (B, T)).items():
        p.add("activations", buffer, shape, dtype)
    for name in g.order(g.head):       # at the last position only: [B, …]
        p.add("activations", name, g.values[name].shape((B,)), dtype)
    p.add("tokens", "idx", (B, T), "int32")
    return p.plan()


def _block_slots(g) -> dict[str, str]:
    """Each block value the decoder makes -> its buffer: its slot, or the `fused` buffer
    of a linear's outputs. Attention through lib.decode makes o alone (lse is for a
    backward)."""
    slots = {}
    for node in g.block:
        outputs = node.outputs[:1] if node.kind == "attention" else node.outputs
        for name in node.inputs + outputs:
            fused = node.fused and name in node.outputs
            slots.setdefault(name, node.fused if fused else g.values[name].buffer)
    return slots


def _block_buffers(g, lead) -> dict[str, tuple]:
    """The shape of each buffer of _block_slots at leading dims `lead`, in order of first use."""
    fused = {n.fused: fused_shape([g.values[o].shape(lead) for o in n.outputs])
             for n in g.block if n.fused}
    shapes = {}
    for name, buffer in _block_slots(g).items():
        shapes.setdefault(buffer, fused.get(buffer) or g.values[name].shape(lead))
    return shapes


class Cursor:
    """The first position of the step being run: the nodes that depend on it (embedding,
    rope, cache writes, attention) read it at run time, so one recorded decode tape serves
    every position."""

    def __init__(self):
        self.pos0 = 0


class Embed:
    """x = wte[ids] (+ wpe[pos0 … pos0+Tq-1]): the embedding op with wpe's rows from pos0."""

    def __init__(self, op, ids, wte, wpe, out, cursor: Cursor):
        self.op, self.ids, self.wte, self.wpe, self.out = op, ids, wte, wpe, out
        self.cursor = cursor

    def forward(self, tape: Tape) -> None:
        p, T = self.cursor.pos0, self.ids.shape[1]
        wpe = None if self.wpe is None else self.wpe[p:p + T]
        tape.lib.forward(self.op, self.ids, self.wte, wpe, out=(self.out,))


class Rope:
    """y = rope(x) with the first row at absolute position pos0."""

    def __init__(self, op, x, y, params: dict, cursor: Cursor):
        self.op, self.x, self.y, self.params, self.cursor = op, x, y, params, cursor

    def forward(self, tape: Tape) -> None:
        tape.lib.forward(self.op, self.x, out=(self.y,), pos0=self.cursor.pos0, **self.params)


class Attend:
    """k and v written into the cache at pos0, then o = attention of the new queries over
    cache positions 0 … pos0+Tq-1 (lib.decode: the op's score, mask and params)."""

    def __init__(self, op, q, k, v, k_cache, v_cache, o, cursor: Cursor):
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
        self.graph = model_graph(arch)
        self._decode_tape = self._record(1)
        self.logits = memory["logits"]

    # -- the graph at Tq rows ---------------------------------------------------------

    def _at(self, name: str, rows: int):
        """The first `rows` positions of a [B, seq, …] buffer as a dense [B, rows, …] view."""
        full = self.mem[name]
        shape = (self.batch, rows) + tuple(full.shape[2:])
        return full.reshape(-1)[:prod(shape)].reshape(shape)

    def _record(self, rows: int) -> Tape:
        """graph.py's stem and blocks at `rows` new positions of each sequence (1: the
        decode tape), then the head at the last position."""
        g, m = self.graph, self.mem
        tape = Tape(self.backend, self.lib, None, tf32=self.tf32)
        views, buffers = self._views(rows)
        for node in g.stem:
            self._node(tape, node, -1, views, buffers, rows)
        for layer in range(self.arch.layers):
            for node in g.block:
                self._node(tape, node, layer, views, buffers, rows)
        head = {name: m[name] for name in g.order(g.head)}
        for value, (_, name) in g.handoff.items():
            if name in head:   # what the head reads of the last block, at the last position
                tape.record(TakeLast(views[value], head[name]))
        for node in g.head:
            self._node(tape, node, None, head, {}, 1)
        return tape

    def _views(self, rows: int) -> tuple[dict, dict]:
        """Each block value at `rows` positions -> its array, and each buffer -> its array:
        a fused linear's outputs are strided views of its buffer (q, k, v of qkv)."""
        g, slots = self.graph, _block_slots(self.graph)
        buffers = {b: self._at(b, rows) for b in dict.fromkeys(slots.values())}
        views = {name: buffers[b] for name, b in slots.items()}
        for node in g.block:
            if node.fused:
                at = 0
                for name in node.outputs:
                    heads = g.values[name].shape((1, 1))[2]
                    views[name] = buffers[node.fused][:, :, at:at + heads]
                    at += heads
        views["idx"] = self._at("idx", rows)
        return views, buffers

    def _node(self, tape: Tape, node, layer, views: dict, buffers: dict, rows: int):
        """Record one graph node at `layer` (graph.Graph.key), forward only, over `views`;
        `rows` positions a sequence."""
        P, cur = self.params, self.cursor
        names = self.graph.parameter_names(node, layer, P)
        if node.kind == "embedding":
            (ids,), (x,) = node.inputs, node.outputs
            tape.record(Embed(node.op, views[ids], P[names[0]],
                              P[names[1]] if len(names) > 1 else None, views[x], cur))
        elif node.kind == "linear":
            def flat(t):
                return t.reshape(self.batch * rows, -1)
            w, b = names[0], names[1] if len(names) > 1 else None
            outputs = ([(buffers[node.fused], slice(None))] if node.fused else
                       zip((views[n] for n in node.outputs), self.graph.row_blocks(node)))
            for y, block in outputs:
                tape.record(Linear(flat(views[node.inputs[0]]), P[w][block], flat(y), None,
                                   None, None, P[b][block] if b else None))
        elif node.kind == "rope":
            tape.record(Rope(node.op, views[node.inputs[0]], views[node.outputs[0]],
                             node.params, cur))
        elif node.kind == "attention":
            q, k, v = (views[n] for n in node.inputs)
            tape.record(Attend(node.op, q, k, v, self.mem[f"h.{layer}.k_cache"],
                               self.mem[f"h.{layer}.v_cache"], views[node.outputs[0]], cur))
        elif node.kind == "norm":
            x, branch = (views[n] for n in node.inputs) if node.fusion else (views[node.inputs[0]], None)
            tape.record(Norm(node.op, x, branch, tuple(P[n] for n in names),
                             tuple(views[n] for n in node.outputs), node.params))
        else:   # the activation, with its linear's bias where the model has one
            biases = tuple(P[names[0]][rows] for rows in self.graph.bias_blocks(node)) \
                if node.bias and names else ()
            tape.record(Op(node.op, (*(views[n] for n in node.inputs), *biases),
                           tuple(views[n] for n in node.outputs), (), (), node.params,
                           fusion="bias" if biases else ""))

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
