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

In autocast precision (plan.py's Precision) the norms run their autocast kernels over the
float32 stream and its gradient, reading the master (float32) weights, as the embedding
does; a GEMM whose output joins the stream reads its gradient's bf16 copy, which the norm
before it in the backward writes beside the float32 gradient (none where no GEMM reads it
later: the stem's).
"""
from __future__ import annotations

from eulergen.runtime.model.tape import Embedding, Grad, Linear, Norm, Op
from eulergen.signature import AUTOCAST, bf16_copy


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
        self.copied: set = set()   # the norm steps whose backward writes a bf16 copy of dx

    def record(self) -> None:
        g = self.g
        steps = g.steps()
        for layer, node, _ in steps:
            if node.fusion == "add":   # x, branch and their sum
                a, *rest = (self._root(g.key(layer, n)) for n in node.inputs + node.outputs[:1])
                self.joined.update((r, a) for r in rest if r != a)
        read = False   # whether a GEMM later in the backward reads the copy (forward order)
        for layer, node, part in steps:
            if node.kind == "linear" and self._copy(node.outputs[part]) is not None:
                read = True
            elif node.kind == "norm" and read and self._copy(self._normed(node)) is not None:
                self.copied.add((layer, node, part))
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

    def _copy(self, name: str):
        """The bf16 copy of `name`'s gradient (plan.py: the autocast stream's), or None."""
        grad = self.g.values[name].grad
        copy = bf16_copy(grad) if grad else None
        return self.g.view(name, self.model.mem[copy]) if copy in self.model.mem else None

    @staticmethod
    def _normed(node) -> str:
        """The value a norm normalizes: x, or an add norm's sum."""
        return node.outputs[0] if node.fusion else node.inputs[0]

    def _dvalue(self, layer, name: str, *, rows=False) -> Grad:
        d = self._dbuf(name)
        return self._grad(self._root(self.g.key(layer, name)), self._rows(d) if rows else d)

    def _dparam(self, name: str, rows: slice = slice(None)) -> Grad:
        key = name if rows == slice(None) else (name, rows.start, rows.stop)
        return self._grad(key, self.model.grads[name][rows], param=True)

    # -- nodes ------------------------------------------------------------------------

    def _node(self, layer, node, part):
        m, P, tr, g = self.model.mem, self.model.params, self.model.training, self.g
        autocast = self.model.autocast
        W = self.model.master if autocast else P   # what the norms and the embedding read
        names = g.parameter_names(node, layer, P)
        buf = lambda n: self._buf(layer, n)   # noqa: E731
        if node.kind == "embedding":
            (ids,), (x,) = node.inputs, node.outputs
            positions = names[1] if len(names) > 1 else None
            return Embedding(node.op, buf(ids), W[names[0]], buf(x),
                             self._dbuf(x) if tr else None,
                             self._dparam(names[0]) if tr else None,
                             W[positions] if positions else None,
                             self._dparam(positions) if tr and positions else None)
        if node.kind == "linear":
            (x,), y = node.inputs, node.outputs[part]
            rows = g.row_blocks(node)[part]
            w, b = names[0], names[1] if len(names) > 1 else None
            bias, ones = (P[b][rows], m["ones"]) if b else (None, None)
            copy = self._copy(y)   # a GEMM reads the stream's gradient in bf16
            dy, dx, dw = ((self._rows(self._dbuf(y) if copy is None else copy),
                           self._dvalue(layer, x, rows=True),
                           self._dparam(w, rows)) if tr else (None, None, None))
            return Linear(self._rows(buf(x)), P[w][rows], self._rows(buf(y)), dy, dx, dw, bias,
                          self._dparam(b, rows) if tr and b else None, ones)
        outputs = tuple(buf(n) for n in node.outputs)
        if node.kind == "norm":
            x, branch = ((buf(n) for n in node.inputs) if node.fusion
                         else (buf(node.inputs[0]), None))
            grads = ((self._dbuf(node.outputs[-1]), self._dvalue(layer, self._normed(node)),
                      tuple(self._dparam(n) for n in names)) if tr else ())
            copy = self._copy(self._normed(node)) if (layer, node, part) in self.copied else None
            return Norm(node.op, x, branch, tuple(W[n] for n in names), outputs, node.params,
                        *grads, precision=AUTOCAST if autocast else "", copy=copy)
        # an activation with its linear's bias: each input's rows of it (Graph.bias_blocks)
        biases = [(names[0], rows) for rows in g.bias_blocks(node)] if node.bias and names else []
        inputs = (*(buf(n) for n in node.inputs), *(P[n][rows] for n, rows in biases))
        saved = tuple(buf(n) for n in node.saved)
        douts, dins = ((tuple(self._dbuf(n) for n in node.outputs if g.values[n].grad),
                        (*(self._dvalue(layer, n) for n in node.inputs),
                         *(self._dparam(n, rows) for n, rows in biases))) if tr else ((), ()))
        return Op(node.op, inputs, outputs, douts, dins, node.params, saved=saved,
                  fusion="bias" if biases else "")
