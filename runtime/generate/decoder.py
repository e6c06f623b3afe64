"""The KV-cache inference graph: a forward-only model that keeps every layer's keys and
values, so that a new token costs one position's work instead of the whole window's.

    dec = build_decoder(arch, lib, batch=B, seq=S, dtype="bf16")   # S ≤ arch.max_seq
    logits = dec.prefill(ids)        # host ids [B, Tp]: the cache filled from position 0
    logits = dec.decode(next_ids)    # host ids [B] (or [B, 1]): one position more
    logits = dec.step()              # the id the device input holds (a tail drew it)
    # logits: the device array [B, vocab_rows] (float32 in bf16 too) of the last position

A run of R new rows at positions pos0 … makes the training graph's op library calls at R
rows (both are built from runtime/model/graph.py): the embedding (wte[ids], and wpe gathered at
the device-held positions by the same op) and the first norm, then per block one GEMM
over all of c_attn.weight (q, k and v are strided views of its output: graph.py's parts
of qkv), rope on q and k at pos0, the new queries' attention over the cache (`lib.decode`,
which also writes the run's k and v into the cache rows pos0 …: no launch of its own; its
split planned for `seq` keys so that its grid is the same at every position; a run of
several rows from position 0, a prefill, takes training's flash forward over its own
keys instead and scatters k and v into the cache beside it), c_proj, the
residual add with the norm, the MLP GEMMs, the activation (with c_fc's bias), c_proj and the
add with the next norm (after the last block, the final one). The tied head runs on the last real row's final
norm only; a one-row step then advances the device positions, and `tail` (the sampler's
draw) runs last.

On a GPU with EULERGEN_GEMV on, a run whose c_fc GEMM the gemv kernels take (one or two
rows in all: runtime/engine/gemv.py's `takes`) runs c_fc, its bias and the activation as one
kernel, y = act(x·wᵀ + b), where the activation has that variant (`fuses`: an op of one
input; a gated one keeps its own kernel): one kernel a layer fewer, with the pair's bits (the
activation reads the float32 sum rounded as the storage holds it, then adds the bias, as the
op's bias variant does after the plain GEMM).

On a GPU, a multi-row run pads to a bucket (a power of two from MIN_BUCKET, or seq)
so that a few shapes serve every prompt, and each shape (its rows, and whether it starts
at position 0) is captured as a CUDA graph at
its second run (the first compiles and warms up), replayed after that with its live
values (pos0, the draw's step) written in (runtime/engine/cuda_graph.py): a decode step is then
one graph launch, no host sync. Pad rows sit after the real ones: a causal mask keeps
them out of the real rows' attention, and the cache rows they write are overwritten
before they are read.

The cache holds `seq` positions. A run that would write past them crops: the decoder
keeps the last seq // 2 tokens it holds (with the new ones: the device keeps the held
ids, `held`) and prefills them again, so positions restart at 0 and the model never sees
more than `seq` tokens, as in training.
"""
from __future__ import annotations

import sys
from math import prod
from typing import Callable

import numpy as np

from eulergen import env
from eulergen.errors import EulerError
from eulergen.runtime.engine import bf16
from eulergen.runtime.engine.backend import sm_count
from eulergen.runtime.engine.gemm import gemm_for
from eulergen.runtime.engine.gemv import SmallRows, fuses, takes
from eulergen.runtime.generate.decode_nodes import (Advance, Attend, Embed, LinearAct, Rope,
                                                    Scatter, TakeLast)
from eulergen.runtime.model.memory import Memory, Plan, Planner, check_fits, upload
from eulergen.runtime.model.gpt import check_ids
from eulergen.runtime.model.params import load_params, parameters, plan_params
from eulergen.runtime.model.plan import Precision
from eulergen.runtime.model.tape import Linear, Norm, Op, Tape

MIN_BUCKET = 16        # rows: the smallest padded multi-row run
DRAWN = 32             # columns of `drawn`: the draws a sampler keeps before reading them


def plan_decoder(a, batch: int, seq: int, *, dtype: str = "float32", sms: int = 0) -> Plan:
    """Parameters (the training layout, in `dtype`), the KV cache ([B, seq, KVH, D] k and v
    per layer), one block's activations at up to B·seq rows (blocks run one after another
    and keep nothing: each value in its graph.py slot; attention's lse, which a prefill's
    flash forward writes, in float32), the last position's final norm,
    its logits (float32 in bf16), the token ids, their positions and the ids the cache
    holds, the sampler's `drawn` ids; on a GPU of `sms` SMs (0: none) the decode's split
    workspace and cuBLAS's."""
    if seq > a.max_seq:
        raise EulerError(f"sampling context {seq} exceeds the model's max_seq_len {a.max_seq}",
                         key="training.seq_len")
    B, T = batch, seq
    g = a.graph
    p = Planner()
    plan_params(p, a, dtype)
    attention = next(n for n in g.block if n.kind == "attention")
    for layer in range(a.layers):
        for part, name in zip(("k", "v"), attention.inputs[1:]):
            p.add("kv_cache", f"h.{layer}.{part}_cache", g.values[name].shape((B, T)), dtype)
    wide = Precision(dtype).master      # per-row values (lse) and logits: as training's
    for buffer, value in _block_buffers(g).items():
        if value.per_row and wide != dtype:
            p.add("stats", buffer, value.shape((B, T)), wide)
        else:
            p.add("activations", buffer, value.shape((B, T)), dtype)
    if not a.rope:
        p.add("activations", "pos_emb", (B, T, a.d), dtype)
    if a.bias and dtype == "bf16":
        p.add("activations", "ones", (1, B * T), dtype)      # a bias as the GEMM 1·b
    logits = g.head[-1].outputs[-1]
    for name in g.order(g.head):       # at the last position only: [B, …]
        arena, kind = ("logits", wide) if name == logits else ("activations", dtype)
        p.add(arena, name, g.values[name].shape((B,)), kind)
    for name in ("idx", "positions", "held"):
        p.add("tokens", name, (B, T), "int32")
    p.add("tokens", "last_row", (1,), "int32")
    p.add("tokens", "drawn", (B, DRAWN), "int32")
    if sms:
        from eulergen.runtime.engine.attention import decode_workspace_bound
        from eulergen.runtime.engine.cublas import WORKSPACE_BYTES
        records, cells = decode_workspace_bound(a.ops.attention, a.head_dim, sms)
        p.add("workspace", "decode_part", (records,), "float32")
        p.add("tokens", "decode_counts", (cells,), "int32")
        p.add("gemm", "gemm_ws", (WORKSPACE_BYTES,), "uint8")
    return p.plan()


def _block_slots(g) -> dict[str, str]:
    """Each block value the decoder makes -> its buffer: its slot, or its root's (a part
    of qkv). Attention's lse is the prefill's flash forward's (a decode writes o alone)."""
    slots = {}
    for node in g.block:
        for name in node.inputs + node.outputs:
            slots.setdefault(name, g.values[g.root(name)].buffer)
    return slots


def _block_buffers(g) -> dict:
    """Each buffer of _block_slots -> the value that sizes it (its first user's root), in
    order of first use."""
    values = {}
    for name, buffer in _block_slots(g).items():
        values.setdefault(buffer, g.values[g.root(name)])
    return values


class Decoder:
    """The model over one planned Memory with a KV cache, for a fixed batch and context.
    `live` holds the values a run reads when it runs (pos0; a sampler adds its own), `tail`
    a node run after the head (the sampler's draw), set before the first run."""

    def __init__(self, arch, lib, memory: Memory, batch: int, seq: int, *, tf32: bool = False,
                 graphs: bool | None = None, notify: Callable[[str], None] | None = None):
        self.arch, self.lib, self.mem = arch, lib, memory
        self.backend = lib.backend
        self.batch, self.seq = batch, seq
        self.params = {s.name: memory[s.name] for s in parameters(arch)}
        self.live = {"pos0": 0}
        self.tail = None
        self.length = 0                                  # cache positions holding tokens
        self.graph = arch.graph
        gpu = self.backend.is_gpu
        self.graphs = gpu if graphs is None else graphs and gpu
        self.notify = notify or (lambda m: print(m, file=sys.stderr))
        # the process's GEMM (cuBLASLt with the bias epilogues where it runs, as training's):
        # one for every bucket's tape, over the planned workspace, so it can be captured;
        # a step's GEMMs of a few rows go to the gemv kernels (EULERGEN_GEMV)
        self.gemm = gemm_for(self.backend, tf32, memory["gemm_ws"] if gpu else None)
        if gpu and env.get("EULERGEN_GEMV") == "on":
            self.gemm = SmallRows(self.gemm)
        if "ones" in memory:
            memory["ones"][...] = bf16.bits(1.0)
        self.logits = memory["logits"]
        self.next_ids = self._at("idx", 1)               # a one-row step's input
        self._tapes: dict[tuple, Tape] = {}              # (rows, prefill) -> its tape
        self._captured: dict[tuple, object] = {}         # (rows, prefill) -> cuda_graph.Graph
        self._ran: set[tuple] = set()

    # -- the graph at R rows ----------------------------------------------------------

    def _at(self, name: str, rows: int, shape: tuple | None = None):
        """The first `rows` positions of a [B, seq, …] buffer as a dense [B, rows, …] view
        (or as `shape`, a value's at those rows: lse's [B, H, rows])."""
        full = self.mem[name]
        shape = shape or (self.batch, rows) + tuple(full.shape[2:])
        return full.reshape(-1)[:prod(shape)].reshape(shape)

    def _tape(self, rows: int, prefill: bool = False) -> Tape:
        """The run of `rows` positions; `prefill`: of several rows from position 0."""
        key = rows, prefill
        if key not in self._tapes:
            self._tapes[key] = self._record(rows, prefill)
        return self._tapes[key]

    def _record(self, rows: int, prefill: bool) -> Tape:
        """The ids into `held`, graph.py's stem and blocks at `rows` new positions of each
        sequence (a linear and its activation as one node where _linear_act folds them), the
        head at the last real one, a one-row step's advance, the tail."""
        g, m = self.graph, self.mem
        tape = Tape(self.backend, self.lib, None, gemm=self.gemm)
        views = self._views(rows)
        tape.record(Scatter(views["idx"], views["positions"], m["held"]))
        for node in g.stem:
            self._node(tape, node, -1, views, rows)
        for layer in range(self.arch.layers):
            folded = None     # the activation the linear before it applies
            for node in g.block:
                if node is folded:
                    continue
                fused = self._linear_act(node, layer, views, rows)
                if fused is None:
                    self._node(tape, node, layer, views, rows, prefill)
                else:
                    folded, step = fused
                    tape.record(step)
        head = {name: m[name] for name in g.order(g.head)}
        last = None if rows == 1 else m["last_row"]
        for value, (_, name) in g.handoff.items():
            if name in head:   # what the head reads of the last block, at the last real row
                tape.record(TakeLast(views[value], head[name], last))
        for node in g.head:
            self._node(tape, node, None, head, 1)
        if rows == 1:
            tape.record(Advance(views["positions"]))
        if self.tail is not None:
            tape.record(self.tail)
        return tape

    def _views(self, rows: int) -> dict:
        """Each block value at `rows` positions -> its array: parts are strided views of
        their root's buffer (q, k, v of qkv)."""
        g, slots = self.graph, _block_slots(self.graph)
        buffers = {b: self._at(b, rows, value.shape((self.batch, rows)))
                   for b, value in _block_buffers(g).items()}
        views = {name: g.view(name, buffers[b]) for name, b in slots.items()}
        for name in ("idx", "positions"):
            views[name] = self._at(name, rows)
        return views

    def _flat(self, t, rows: int):
        """A [B, rows, …] view as the GEMMs take it: [B·rows, features]."""
        return t.reshape(self.batch * rows, -1)

    def _linear_act(self, node, layer, views: dict, rows: int):
        """(the activation, a LinearAct node of it and linear `node`): one kernel for both
        where the GEMM goes to the gemv kernels (the decoder's SmallRows, and `takes` these
        arrays), the activation reads the linear's one output and `fuses`, and each of its
        params has a value (one without is left to the op's own call, which names it); else
        None, and _node records the two."""
        g, P = self.graph, self.params
        if node.kind != "linear" or not isinstance(self.gemm, SmallRows):
            return None
        act = next((n for n in g.block if n.kind == "activation" and n.inputs == node.outputs),
                   None)
        if act is None or not fuses(act.op):
            return None
        params = {**act.op.params, **act.params}
        (w,) = g.parameter_names(node, layer, P)         # its bias is the activation's
        biases = g.parameter_names(act, layer, P)        # c_fc's bias, where the model has one
        b = P[biases[0]] if biases else None
        x, y = self._flat(views[node.inputs[0]], rows), self._flat(views[act.outputs[0]], rows)
        if None in params.values() or not takes(x, P[w], y, b):
            return None
        return act, LinearAct(x, P[w], b, y, act.op, params)

    def _node(self, tape: Tape, node, layer, views: dict, rows: int, prefill: bool = False):
        """Record one graph node at `layer` (graph.Graph.key), forward only, over `views`;
        `rows` positions a sequence (`prefill`: from position 0)."""
        P, m, live = self.params, self.mem, self.live
        names = self.graph.parameter_names(node, layer, P)
        if node.kind == "embedding":
            (ids,), (x,) = node.inputs, node.outputs
            wpe = P[names[1]] if len(names) > 1 else None
            pos_emb = None if wpe is None else self._at("pos_emb", rows)
            tape.record(Embed(node.op, views[ids], P[names[0]], views[x], wpe,
                              views["positions"], pos_emb))
        elif node.kind == "linear":
            w, b = names[0], names[1] if len(names) > 1 else None
            ones = m["ones"][:, :self.batch * rows] if "ones" in m else None
            for y, block in zip((views[n] for n in node.outputs), self.graph.row_blocks(node)):
                tape.record(Linear(self._flat(views[node.inputs[0]], rows), P[w][block],
                                   self._flat(y, rows), None, None, None,
                                   P[b][block] if b else None, ones=ones))
        elif node.kind == "rope":
            tape.record(Rope(node.op, views[node.inputs[0]], views[node.outputs[0]],
                             node.params, live))
        elif node.kind == "attention":
            q, k, v = (views[n] for n in node.inputs)
            caches = m[f"h.{layer}.k_cache"], m[f"h.{layer}.v_cache"]
            if prefill:   # the run's own keys are the whole cache: training's flash forward
                for new, cache in zip((k, v), caches):
                    tape.record(Scatter(new, views["positions"], cache))
                tape.record(Op(node.op, (q, k, v), tuple(views[n] for n in node.outputs),
                               (), (), node.params))
                return
            workspace = ((m["decode_part"], m["decode_counts"]) if "decode_part" in m
                         else None)
            tape.record(Attend(node.op, q, *caches, views[node.outputs[0]], live, self.seq,
                               workspace, (k, v)))
        elif node.kind == "norm":
            x, branch = ((views[n] for n in node.inputs) if node.fusion
                         else (views[node.inputs[0]], None))
            tape.record(Norm(node.op, x, branch, tuple(P[n] for n in names),
                             tuple(views[n] for n in node.outputs), node.params))
        else:   # the activation, with its linear's bias where the model has one
            biases = (tuple(P[names[0]][half] for half in self.graph.bias_blocks(node))
                      if node.bias and names else ())
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
            return self._crop(ids)
        return self._run(ids)

    def step(self):
        """One more position for the id the device input (`next_ids`) holds: what the tail
        drew. No host sync unless the cache is full (a crop reads the held ids)."""
        if self.length + 1 > self.seq:
            return self._crop(self.backend.asnumpy(self.next_ids))
        return self._run(None)

    def _crop(self, ids: np.ndarray):
        held = self.backend.asnumpy(self.mem["held"][:, :self.length])
        return self.prefill(np.concatenate([held, ids], axis=1)[:, -(self.seq // 2):])

    def _check(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.ndim != 2 or ids.shape[0] != self.batch or ids.shape[1] == 0:
            raise EulerError(f"token ids of shape {ids.shape}: the decoder wants "
                             f"[{self.batch}, ≥ 1]", key="prompt")
        return check_ids(ids, self.arch.vocab)

    def rows(self, tokens: int, pos0: int) -> int:
        """The rows a run of `tokens` at `pos0` takes: one; on a GPU a padded bucket (a
        power of two from MIN_BUCKET, at most seq) where it fits the cache; else exact."""
        if tokens == 1 or not self.backend.is_gpu:
            return tokens
        bucket = min(self.seq, max(MIN_BUCKET, 1 << (tokens - 1).bit_length()))
        return bucket if pos0 + bucket <= self.seq else tokens

    def _run(self, ids: np.ndarray | None):
        """A run of `ids` (host [B, T]; None: the one id next_ids holds) at the next
        positions."""
        B, pos0 = self.batch, self.length
        tokens = 1 if ids is None else ids.shape[1]
        rows = self.rows(tokens, pos0)
        if ids is not None:   # a step() finds its position where the last run left it
            upload(self._at("idx", rows), np.pad(ids, ((0, 0), (0, rows - tokens))))
            upload(self._at("positions", rows), np.tile(np.arange(pos0, pos0 + rows), (B, 1)))
            upload(self.mem["last_row"], [tokens - 1])
        self.live["pos0"] = pos0
        self._forward(rows, rows > 1 and pos0 == 0)
        self.length = pos0 + tokens
        if rows > 1:   # the next one-row step's position
            upload(self._at("positions", 1), np.full((B, 1), self.length))
        return self.logits

    def _forward(self, rows: int, prefill: bool) -> None:
        """The tape at `rows` (`prefill`: from position 0): eagerly on its first run, as a
        CUDA graph after that."""
        key = rows, prefill
        graph = self._captured.get(key)
        if graph is None and self.graphs and key in self._ran:
            from eulergen.runtime.engine.cuda_graph import Graph
            try:
                graph = self._captured[key] = Graph.capture(self._tape(*key).forward,
                                                            self.live)
            except Exception as err:   # a driver or cuBLAS that will not capture: run eagerly
                self.graphs = False
                self.notify(f"note: CUDA graphs are off for this decoder ({err})")
        if graph is not None:
            graph.launch(self.live)
            return
        self._ran.add(key)
        self._tape(*key).forward()

    def load_state_dict(self, state: dict) -> None:
        load_params(self.params, state)


def decode_sms(backend) -> int:
    """plan_decoder's `sms` for a decoder on `backend`: the GPU's SMs, 0 on numpy."""
    if not backend.is_gpu:
        return 0
    return sm_count()


def build_decoder(arch, lib, batch: int, seq: int, *, dtype: str = "float32",
                  params=None, tf32: bool = False, graphs: bool | None = None,
                  notify: Callable[[str], None] | None = None) -> Decoder:
    """Plan, allocate and make a KV-cache model of an Arch (runtime/model/arch.py arch_of);
    `params` is an existing params arena to read the weights from (a training model's:
    nothing is copied); `graphs`: capture CUDA graphs (default: on a GPU)."""
    if dtype == "bf16":
        bf16.plan_dtype("bf16", lib.backend)
    plan = plan_decoder(arch, batch, seq, dtype=dtype, sms=decode_sms(lib.backend))
    shared = {"params": params} if params is not None else None
    check_fits(plan, lib.backend, shared)
    return Decoder(arch, lib, Memory(plan, lib.backend.xp, shared=shared), batch, seq,
                   tf32=tf32, graphs=graphs, notify=notify)
