"""The training tape, recorded from the model graph (runtime/model/graph.py) over a GPT's
planned buffers: graph nodes become tape nodes (runtime/model/tape.py), a linear of several
outputs one GEMM per output (dense outputs, one gradient each). A value that is a part
of another (q, k, v of qkv) is a view of its root's buffer, its gradient a view of the
root's gradient.

Backward order decides how each gradient lands: the first node in backward order to put
a gradient into a value writes it, every later one adds (a parameter's first writer
writes on a step's first micro-step only, and adds on the later ones). The values a
residual add joins (an `add` norm's inputs and its sum) count as one, so the stream's
gradient `d.x` is written by the last block's closing norm and added to by every other
norm, in its own backward pass (tape.Norm): the add's backward is that fan-in. The tied
token table's gradient is written by the LM head and added to by the embedding.
"""
from __future__ import annotations

from eulergen.runtime.model.tape import Embedding, Grad, Linear, Norm, Op


def record_training(model) -> None:
    """Record a GPT's (runtime/model/gpt.py) forward pass on its tape, with the backward
    wiring of every node when it trains."""
    _Recorder(model).record()


class _Recorder:
    """One recording: which value each name means, which gradients are written so far."""

    def __init__(self, model):
        self.model, self.g = model, model.graph
        self.kept = self.g.kept()
        self.joined: dict[tuple, tuple] = {}   # a value -> the one whose gradient it shares
        self.written: set = set()

    def record(self) -> None:
        g = self.g
        steps = g.steps()
        for layer, node, _ in steps:
            if node.fusion == "add":   # x, branch and their sum
                a, *rest = (self._root(g.key(layer, n)) for n in node.inputs + node.outputs[:1])
                self.joined.update((r, a) for r in rest if r != a)
        built = [self._node(*step) for step in reversed(steps)]   # backward order
        for node in reversed(built):
            self.model.tape.record(node)

    # -- names ------------------------------------------------------------------------

    def _root(self, key: tuple) -> tuple:
        while key in self.joined:
            key = self.joined[key]
        return key

    def _buf(self, layer, name: str):
        if self.g.values[name].part:
            return self.g.view(name, self._buf(layer, self.g.root(name)))
        block, name = self.g.key(layer, name)
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
        return self._grad(self._root(self.g.key(layer, name)), self._rows(d) if rows else d)

    def _dparam(self, name: str, rows: slice = slice(None)) -> Grad:
        key = name if rows == slice(None) else (name, rows.start, rows.stop)
        return self._grad(key, self.model.grads[name][rows], param=True)

    # -- nodes ------------------------------------------------------------------------

    def _node(self, layer, node, part):
        m, P, tr, g = self.model.mem, self.model.params, self.model.training, self.g
        names = g.parameter_names(node, layer, P)
        buf = lambda n: self._buf(layer, n)   # noqa: E731
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
            rows = g.row_blocks(node)[part]
            w, b = names[0], names[1] if len(names) > 1 else None
            bias, ones = (P[b][rows], m["ones"]) if b else (None, None)
            dy, dx, dw = ((self._rows(self._dbuf(y)), self._dvalue(layer, x, rows=True),
                           self._dparam(w, rows)) if tr else (None, None, None))
            return Linear(self._rows(buf(x)), P[w][rows], self._rows(buf(y)), dy, dx, dw, bias,
                          self._dparam(b, rows) if tr and b else None, ones)
        outputs = tuple(buf(n) for n in node.outputs)
        if node.kind == "norm":
            x, branch = ((buf(n) for n in node.inputs) if node.fusion
                         else (buf(node.inputs[0]), None))
            normed = node.outputs[0] if node.fusion else node.inputs[0]   # what it normalizes
            grads = ((self._dbuf(node.outputs[-1]), self._dvalue(layer, normed),
                      tuple(self._dparam(n) for n in names)) if tr else ())
            return Norm(node.op, x, branch, tuple(P[n] for n in names), outputs, node.params,
                        *grads)
        # an activation with its linear's bias: each input's rows of it (Graph.bias_blocks)
        biases = [(names[0], rows) for rows in g.bias_blocks(node)] if node.bias and names else []
        inputs = (*(buf(n) for n in node.inputs), *(P[n][rows] for n, rows in biases))
        saved = tuple(buf(n) for n in node.saved)
        douts, dins = ((tuple(self._dbuf(n) for n in node.outputs if g.values[n].grad),
                        (*(self._dvalue(layer, n) for n in node.inputs),
                         *(self._dparam(n, rows) for n, rows in biases))) if tr else ((), ()))
        return Op(node.op, inputs, outputs, douts, dins, node.params, saved=saved,
                  fusion="bias" if biases else "")
