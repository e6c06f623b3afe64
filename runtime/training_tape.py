"""The training tape, recorded from the model graph (runtime/graph.py) over a GPT's
planned buffers: graph nodes become tape nodes (runtime/tape.py), a linear of several
outputs one GEMM per output (dense outputs, one gradient each). A value that is a part
of another (q, k, v of qkv) is a view of its root's buffer, its gradient a view of the
root's gradient.

Backward order decides how each gradient lands: the first node in backward order to put
a gradient into a value writes it, every later one adds (a parameter's first writer
writes on a step's first micro-step only, and adds on the later ones). The values a
residual add joins count as one, so the stream's gradient `d.x` is written by the final
norm and added to by every block's norms: the add's backward is that fan-in, with
nothing to compute. The tied token table's gradient is written by the LM head and added
to by the embedding.
"""
from __future__ import annotations

from eulergen.runtime.graph import parameter_names
from eulergen.runtime.tape import Add, Embedding, Grad, Linear, Op


def record_training(model) -> None:
    """Record a GPT's (runtime/model.py) forward pass on its tape, with the backward
    wiring of every node when it trains."""
    _Recorder(model).record()


class _Recorder:
    """One recording: which value each name means, which gradients are written so far."""

    def __init__(self, model):
        self.model, self.g = model, model.graph
        self.kept = self.g.kept()
        self.in_block = set(self.g.order(self.g.block))
        self.joined: dict[tuple, tuple] = {}   # a value -> the one whose gradient it shares
        self.written: set = set()

    def record(self) -> None:
        steps = self.g.steps(self.model.arch.layers)
        for _, layer, node, _ in steps:
            if node.kind == "add":
                a, *rest = (self._root(self._key(layer, n)) for n in node.inputs + node.outputs)
                self.joined.update((r, a) for r in rest if r != a)
        built = [self._node(*step) for step in reversed(steps)]   # backward order
        for node in reversed(built):
            self.model.tape.record(node)

    # -- names ------------------------------------------------------------------------

    def _key(self, layer, name: str) -> tuple:
        """The value a node's name means: (block, name); a block's `next` is the next
        block's x (after the last block, x_final); outside the blocks the block is None."""
        if name == "next":
            return (layer + 1, "x") if layer + 1 < self.model.arch.layers else (None, "x_final")
        return (layer, name) if name in self.in_block else (None, name)

    def _root(self, key: tuple) -> tuple:
        while key in self.joined:
            key = self.joined[key]
        return key

    def _buf(self, layer, name: str):
        if self.g.values[name].part:
            return self.g.view(name, self._buf(layer, self.g.root(name)))
        block, name = self._key(layer, name)
        if block is None:
            return self.model.mem[name]
        if name in self.kept:
            return self.model.mem[f"h.{block}.{name}"]
        return self.model.mem[self.g.values[name].buffer]   # no backward reads it: shared

    def _rows(self, t):
        """A [B, T, …] activation as the [B·T, features] matrix a GEMM reads (a view)."""
        return t.reshape(self.model.batch * self.model.seq, -1)

    # -- gradients --------------------------------------------------------------------

    def _grad(self, key, buf, *, param: bool = False) -> Grad:
        first = key not in self.written
        self.written.add(key)
        if param:
            return Grad(buf, param=True) if first else Grad(buf, add=True)
        return Grad(buf, add=not first)

    def _dbuf(self, name: str):
        return self.g.view(name, self.model.mem[self.g.values[name].grad])

    def _dvalue(self, layer, name: str, *, rows=False) -> Grad:
        d = self._dbuf(name)
        return self._grad(self._root(self._key(layer, name)), self._rows(d) if rows else d)

    def _dparam(self, name: str, rows: slice = slice(None)) -> Grad:
        key = name if rows == slice(None) else (name, rows.start, rows.stop)
        return self._grad(key, self.model.grads[name][rows], param=True)

    # -- nodes ------------------------------------------------------------------------

    def _node(self, prefix: str, layer, node, part):
        m, P, tr = self.model.mem, self.model.params, self.model.training
        names = parameter_names(node, prefix, P)
        buf = lambda n: self._buf(layer, n)   # noqa: E731
        if node.kind == "add":
            return Add(*(buf(n) for n in node.inputs + node.outputs))
        if node.kind == "embedding":
            (ids,), (x,) = node.inputs, node.outputs
            positions = names[1] if len(names) > 1 else None
            return Embedding(node.op, buf(ids), P[names[0]], buf(x),
                             self._dbuf(x) if tr else None,
                             self._dparam(names[0]) if tr else None,
                             P[positions] if positions else None,
                             self._dparam(positions) if tr and positions else None)
        if node.kind == "linear":
            (x,), y = node.inputs, node.outputs[part]
            rows = self.g.row_blocks(node)[part]
            w, b = names[0], names[1] if len(names) > 1 else None
            bias, ones = (P[b][rows], m["ones"]) if b else (None, None)
            if not tr:
                return Linear(self._rows(buf(x)), P[w][rows], self._rows(buf(y)), None, None,
                              None, bias, None, ones)
            return Linear(self._rows(buf(x)), P[w][rows], self._rows(buf(y)),
                          self._rows(self._dbuf(y)), self._dvalue(layer, x, rows=True),
                          self._dparam(w, rows), bias, self._dparam(b, rows) if b else None,
                          ones)
        inputs = (*(buf(n) for n in node.inputs), *(P[n] for n in names))
        outputs = tuple(buf(n) for n in node.outputs)
        saved = tuple(buf(n) for n in node.saved)
        if not tr:
            return Op(node.op, inputs, outputs, (), (), node.params, saved=saved)
        douts = tuple(self._dbuf(n) for n in node.outputs if self.g.values[n].grad)
        dins = (*(self._dvalue(layer, n) for n in node.inputs),
                *(self._dparam(n) for n in names))
        return Op(node.op, inputs, outputs, douts, dins, node.params, saved=saved)
