"""forward.c and backward.c of `eulergen export-c --train`: the numpy trainer's training tape
(runtime/model/training_tape.py) as C, node by node in its order, over its memory plan.

The tape is recorded by the trainer's own code over a GPT allocated on numpy for the run's
batch, so each array a node holds is a view of one of the plan's arenas: in C it is the
macro of the planned buffer it lies in (plan.h, `Buffers`) plus an offset, its strides
where the op's C function takes them. Each node writes or adds each gradient as its tape
Grad says: a parameter's gradient adds on a step's later micro-steps (the C `accumulate`),
and a gradient that adds is computed into the planned scratch and added after, as
tape.targets and tape.land do. A GEMM is train_cpu.h's eg_matmul, called as
the tape calls numpy's (runtime/engine/gemm.py's NumpyGemm); a generated op is a call of
its C function (generated/c/<op>.c, <op>.train.c) by the signature its manifest entry
records, its arguments bound by name. The loss, around the tape, is GPT.loss_and_grad's:
the padded vocab rows -inf, the cross-entropy forward and its backward writing dlogits
over the logits, the mean of the token losses.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from eulergen.runtime.interop.c_model import Call, bound, wrapped
from eulergen.runtime.model.tape import Embedding, Linear, Norm, Op

_PARAM_ARENAS = ("params", "grads")   # the params layout, each


def macro(buffer: str, arena: str = "params") -> str:
    """The C name of a planned buffer (training.h): `h.0.qkv` -> H_0_QKV; a parameter's
    gradient D_ and its name."""
    name = re.sub(r"[^A-Za-z0-9]", "_", buffer).upper()
    return f"D_{name}" if arena == "grads" else name


class Buffers:
    """A GPT's memory as C: the arena and offset of each array the tape holds, as the
    macro of its planned buffer plus an offset."""

    def __init__(self, model):
        self.plan = model.mem.plan
        self.arenas = dict(model.mem.arenas)
        self.params = sorted((b.offset, b) for b in self.plan.buffers if b.arena == "params")

    def locate(self, a) -> tuple[str, int]:
        for name, arena in self.arenas.items():
            at = (a.__array_interface__["data"][0] - arena.ctypes.data) // arena.itemsize
            if 0 <= at < arena.size:
                return name, at
        raise AssertionError("an array of the tape outside the plan's arenas")

    def ptr(self, a, dense: bool = True) -> str:
        """`a` as C: its buffer's macro plus an offset; `dense`: refused unless a C-ordered
        array (what the GEMMs and the pointwise and row functions take)."""
        if dense and not a.flags.c_contiguous:
            raise AssertionError(f"a strided {a.shape} array where C takes a dense one")
        arena, at = self.locate(a)
        layout = self.params if arena in _PARAM_ARENAS else [
            (b.offset, b) for b in self.plan.buffers if b.arena == arena]
        offset, buf = max(((o, b) for o, b in layout if o <= at), key=lambda ob: ob[0])
        name = macro(buf.name, "grads" if arena == "grads" else "params")
        return name + (f" + {at - offset}" if at > offset else "")

    @staticmethod
    def strides(a, prefix: str) -> dict:
        """The (batch, token, head) strides of a [B, T, H, D] view, by the C names."""
        return {f"{prefix}_{s}": a.strides[n] // a.itemsize for n, s in enumerate(("sb", "st", "sh"))}


@dataclass(frozen=True)
class Target:
    """Where a call puts one gradient, in C: `target` (its buffer, or the scratch it is
    computed into) and the line that adds the scratch in after, if any."""
    target: str
    land: list


class Printer:
    """The forward and backward lines of each tape node, the op calls recorded (`calls`,
    for train_ops.h)."""

    def __init__(self, model):
        self.model, self.a = model, model.arch
        self.buf = Buffers(model)
        self.calls: list[Call] = []
        self.scratch = model.mem["scratch"]

    # -- calls and gradients ---------------------------------------------------------

    def call(self, op, fn, values: dict) -> list[str]:
        return bound(op, fn, values, "  ", self.calls)

    def adds(self, g) -> str:
        """C of whether a tape Grad adds: always, never, or on later micro-steps."""
        return "1" if g.add else "accumulate" if g.param else "0"

    def grads(self, grads, dense: bool = True) -> list[Target]:
        """Where a call writes each tape Grad: its buffer, or, where it adds, a view of the
        scratch that is added to the buffer after (each at its own place: a parameter's
        adds on some micro-steps only). `dense`: as Buffers.ptr (one that adds always is)."""
        out, at = [], 0
        for g in grads:
            adds = self.adds(g)
            if adds == "0":
                out.append(Target(self.buf.ptr(g.buf, dense), []))
                continue
            n = g.buf.size
            if at + n > self.scratch.size:
                raise AssertionError("the scratch workspace is smaller than its gradients")
            scratch = self.buf.ptr(self.scratch[at:at + n])
            add = f"eg_add({self.buf.ptr(g.buf)}, {scratch}, {n});"
            if adds == "1":
                out.append(Target(scratch, [f"  {add}"]))
            else:
                out.append(Target(f"accumulate ? {scratch} : {self.buf.ptr(g.buf)}",
                                [f"  if (accumulate) {add}"]))
            at += n
        return out

    @staticmethod
    def params(op, node) -> dict:
        given = {**op.params, **node.params}
        return {n: float(v) for n, v in given.items()}

    # -- the nodes ---------------------------------------------------------------------

    def forward(self, step, node) -> list[str]:
        return [self._comment(step, node)] + getattr(
            self, f"_{type(node).__name__.lower()}_fwd")(node, step[1])

    def backward(self, step, node) -> list[str]:
        return [self._comment(step, node)] + getattr(
            self, f"_{type(node).__name__.lower()}_bwd")(node, step[1])

    @staticmethod
    def _comment(step, node) -> str:
        """What a node reads and writes, by the graph's names."""
        _, n, part = step
        what = n.kind + (f" {n.op.name}" if n.op is not None else f" {', '.join(n.weights)}")
        outputs = n.outputs if part is None else (n.outputs[part],)
        fused = (f" (the {n.fusion} fused)" if n.fusion else
                 " (+ c_fc's bias)" if getattr(node, "fusion", "") == "bias" else "")
        return f"  /* {', '.join(n.inputs)} -> {what}{fused} -> {', '.join(outputs)} */"

    def _gemm(self, a, b, c, ta: bool, tb: bool, add: str) -> list[str]:
        """c [m, n] (+)= op(a) [m, k] · op(b) [k, n], as NumpyGemm's call."""
        m, n = c.shape
        k = a.shape[0] if ta else a.shape[1]
        return wrapped("eg_matmul", [self.buf.ptr(a), self.buf.ptr(b), self.buf.ptr(c), str(m),
                                     str(n), str(k), str(int(ta)), str(int(tb)), add], "  ")

    def _linear_fwd(self, node: Linear, gnode) -> list[str]:
        lines = self._gemm(node.x, node.w, node.y, False, True, "0")
        if node.b is not None:
            lines.append(f"  eg_add_rows({self.buf.ptr(node.y)}, {self.buf.ptr(node.b)}, "
                         f"{node.y.shape[0]}, {node.y.shape[1]});")
        return lines

    def _linear_bwd(self, node: Linear, gnode) -> list[str]:
        lines = []
        if node.dx is not None:
            lines += self._gemm(node.dy, node.w, node.dx.buf, False, False, self.adds(node.dx))
        lines += self._gemm(node.dy, node.x, node.dw.buf, True, False, self.adds(node.dw))
        if node.db is not None:
            lines += self._gemm(node.ones, node.dy, node.db.buf.reshape(1, -1), False, False,
                                self.adds(node.db))
        return lines

    def _embedding_fwd(self, node: Embedding, gnode) -> list[str]:
        op = node.op
        return self.call(op, op.c_function("forward"), {
            "ids": self.buf.ptr(node.ids), "wte": self.buf.ptr(node.table),
            "wpe": "NULL" if node.positions is None else self.buf.ptr(node.positions),
            "out": self.buf.ptr(node.out), "BT": node.ids.size, "T": node.ids.shape[-1],
            "C": node.table.shape[1], "V": node.table.shape[0]})

    def _embedding_bwd(self, node: Embedding, gnode) -> list[str]:
        op, dpos = node.op, node.dpositions
        return self.call(op, op.c_function("backward"), {
            "ids": self.buf.ptr(node.ids), "dout": self.buf.ptr(node.dout),
            "dwte": self.buf.ptr(node.dtable.buf),
            "dwpe": "NULL" if dpos is None else self.buf.ptr(dpos.buf),
            "BT": node.ids.size, "T": node.ids.shape[-1], "C": node.table.shape[1],
            "V": node.table.shape[0], "P": 0 if dpos is None else dpos.buf.shape[0],
            "add_wte": self.adds(node.dtable), "add_wpe": "0" if dpos is None else self.adds(dpos)})

    def _rows_of(self, a) -> dict:
        return {"rows": a.size // a.shape[-1], "cols": a.shape[-1]}

    def _norm_fwd(self, node: Norm, gnode) -> list[str]:
        op, fusion = node.op, "add" if node.branch is not None else ""
        side = op.fusions[fusion].forward if fusion else op
        arrays = [node.x] + ([node.branch] if fusion else []) + list(node.weights)
        values = {o.name: self.buf.ptr(a) for o, a in zip(side.inputs, arrays)}
        values |= {o.name: self.buf.ptr(a) for o, a in zip(side.outputs, node.outputs)}
        return self.call(op, op.c_function("forward", fusion),
                         {**values, **self.params(op, node), **self._rows_of(node.x)})

    def _norm_bwd(self, node: Norm, gnode) -> list[str]:
        op = node.op
        fusion = "add" if self.adds(node.dx) == "1" else ""
        side = op.fusions[fusion].backward if fusion else op
        weights = self.grads(node.dweights)
        values = {o.name: self.buf.ptr(a) for o, a in zip(side.inputs, (node.row, *node.weights))}
        douts = [f"d{o.name}" for o in side.outputs]
        dx = self.buf.ptr(node.dx.buf)
        values |= dict(zip(douts, [self.buf.ptr(node.dy)] + ([dx] if fusion else [])))
        values |= dict(zip((f"d{n}" for n in side.grads), [dx] + [w.target for w in weights]))
        return (self.call(op, op.c_function("backward", fusion),
                          {**values, **self.params(op, node), **self._rows_of(node.row)})
                + [line for w in weights for line in w.land])

    def _op_fwd(self, node: Op, gnode) -> list[str]:
        return getattr(self, f"_{gnode.kind}_fwd")(node)

    def _op_bwd(self, node: Op, gnode) -> list[str]:
        return getattr(self, f"_{gnode.kind}_bwd")(node)

    def _activation_fwd(self, node: Op) -> list[str]:
        op, fusion = node.op, node.fusion
        side = op.fusions[fusion].forward if fusion else op
        values = {o.name: self.buf.ptr(a) for o, a in zip(side.inputs, node.inputs)}
        values |= {o.name: self.buf.ptr(a) for o, a in zip(side.outputs, node.outputs)}
        x = node.inputs[0]
        sizes = self._rows_of(x) if fusion else {"n": x.size}
        return self.call(op, op.c_function("forward", fusion),
                         {**values, **self.params(op, node), **sizes})

    def _activation_bwd(self, node: Op) -> list[str]:
        op, fusion = node.op, node.fusion
        side = op.fusions[fusion].backward if fusion else op
        grads = self.grads(node.dins)
        values = {o.name: self.buf.ptr(a) for o, a in zip(side.inputs, node.inputs)}
        values |= {f"d{o.name}": self.buf.ptr(a) for o, a in zip(side.outputs, node.douts)}
        values |= {f"d{n}": g.target for n, g in zip(side.grads, grads)}
        x = node.inputs[0]
        sizes = self._rows_of(x) if fusion else {"n": x.size}
        return (self.call(op, op.c_function("backward", fusion),
                          {**values, **self.params(op, node), **sizes})
                + [line for g in grads for line in g.land])

    def _strided(self, name: str, a) -> dict:
        return {name: self.buf.ptr(a, dense=False), **self.buf.strides(a, name)}

    def _attention_sizes(self, q, k) -> dict:
        B, T, H, D = q.shape
        return {"batch": B, "T": T, "n_heads": H, "n_kv_heads": k.shape[2], "head_dim": D}

    def _attention_fwd(self, node: Op) -> list[str]:
        op, (q, k, v), (o, lse) = node.op, node.inputs, node.outputs
        values = {**self._strided("q", q), **self._strided("k", k), **self._strided("v", v),
                  **self._strided("o", o), "lse": self.buf.ptr(lse)}
        return self.call(op, op.c_function("forward"), {
            **values, **self._attention_sizes(q, k), **self.params(op, node)})

    def _attention_bwd(self, node: Op) -> list[str]:
        op, (q, k, v), (o, lse) = node.op, node.inputs, node.saved
        if any(g.land for g in self.grads(node.dins, dense=False)):
            raise AssertionError("attention's gradients are their buffers' first writers")
        dq, dk, dv = (g.buf for g in node.dins)
        (dout,) = node.douts
        values = {**self._strided("q", q), **self._strided("k", k), **self._strided("v", v),
                  **self._strided("o", o), "lse": self.buf.ptr(lse),
                  **self._strided("dout", dout), **self._strided("dq", dq),
                  **self._strided("dk", dk), **self._strided("dv", dv)}
        return self.call(op, op.c_function("backward"), {
            **values, **self._attention_sizes(q, k), **self.params(op, node)})

    def _rope_values(self, x, y, xn: str, yn: str) -> dict:
        B, T, H, D = x.shape
        return {**self._strided(xn, x), **self._strided(yn, y), "B": B, "T": T, "H": H,
                "D": D, "pos0": 0}

    def _rope_fwd(self, node: Op) -> list[str]:
        op, ((x,), (y,)) = node.op, (node.inputs, node.outputs)
        return self.call(op, op.c_function("forward"), {
            **self._rope_values(x, y, op.inputs[0].name, op.outputs[0].name),
            **self.params(op, node)})

    def _rope_bwd(self, node: Op) -> list[str]:
        op, (x,), (dy,) = node.op, node.inputs, node.douts
        if any(g.land for g in self.grads(node.dins, dense=False)):
            raise AssertionError("rope's gradient is its buffer's first writer")
        (dx,) = (g.buf for g in node.dins)
        xn, yn = op.inputs[0].name, op.outputs[0].name
        values = {**self._rope_values(dy, dx, f"d{yn}", f"d{xn}"), **self._strided(xn, x)}
        return self.call(op, op.c_function("backward"), {**values, **self.params(op, node)})

    # -- the loss ----------------------------------------------------------------------

    def loss_forward(self) -> list[str]:
        m, a = self.model.mem, self.a
        op = a.ops.loss
        logits = m["logits"]
        lines = ["  /* the loss: each token's cross-entropy (padded vocab rows -inf), their mean */"]
        if a.vocab_rows > a.vocab:
            lines.append(f"  eg_fill_columns({self.buf.ptr(logits)}, {logits.shape[0]}, "
                         f"{logits.shape[1]}, {a.vocab}, -INFINITY);")
        (x, target), (loss,) = op.inputs, op.outputs
        values = {x.name: self.buf.ptr(logits), target.name: self.buf.ptr(m["targets"]),
                  loss.name: self.buf.ptr(m["losses"])}
        lines += self.call(op, op.c_function("forward"), {**values, **self._rows_of(logits)})
        return lines + [f"  return eg_mean({self.buf.ptr(m['losses'])}, {m['losses'].size});"]

    def loss_backward(self) -> list[str]:
        m, op = self.model.mem, self.a.ops.loss
        logits = m["logits"]
        (x, target), (loss,) = op.inputs, op.outputs
        values = {x.name: self.buf.ptr(logits), target.name: self.buf.ptr(m["targets"]),
                  f"d{loss.name}": self.buf.ptr(m["dloss"]), f"d{x.name}": self.buf.ptr(logits)}
        return (["  /* the loss's: dlogits written over the logits */"]
                + self.call(op, op.c_function("backward"), {**values, **self._rows_of(logits)}))


def tape_text(model) -> tuple[list[str], list[str], list[Call]]:
    """(forward's body, backward's body, the op calls) of a GPT's tape: its nodes beside
    the graph's steps, which the tape records one a node, in the same order."""
    p = Printer(model)
    steps, nodes = model.graph.steps(), model.tape.nodes
    if len(steps) != len(nodes):
        raise AssertionError("the tape's nodes are not the graph's steps")
    forward, backward = [], p.loss_backward()
    layer = None
    for step, node in zip(steps, nodes):
        if step[0] != layer:
            layer = step[0]
            forward.append(f"  /* {_part(layer)} */")
        forward += p.forward(step, node)
    forward += p.loss_forward()
    layer = None
    for step, node in reversed(list(zip(steps, nodes))):
        if step[0] != layer:
            layer = step[0]
            backward.append(f"  /* {_part(layer)} */")
        backward += p.backward(step, node)
    return forward, backward, p.calls


def _part(layer) -> str:
    return "the stem" if layer == -1 else "the head" if layer is None else f"block {layer}"


def arena_sizes(model) -> dict[str, tuple[str, int]]:
    """Each arena of a GPT's plan: its C type and elements."""
    return {a.name: ("int" if a.dtype == "int32" else "float", a.size)
            for a in model.mem.plan.arenas}


def buffer_macros(model) -> list[tuple[str, str, str]]:
    """(macro, C expression of `m`'s arenas, what it is) of every planned buffer, and of
    each parameter's gradient."""
    out = []
    for b in model.mem.plan.buffers:
        if b.arena in _PARAM_ARENAS[1:]:
            continue
        out.append((macro(b.name), f"(m->{b.arena} + {b.offset})",
                    f"{b.name} [{', '.join(map(str, b.shape))}]"))
        if b.arena == "params":
            out.append((macro(b.name, "grads"), f"(m->grads + {b.offset})", "its gradient"))
    names = [n for n, _, _ in out]
    if len(set(names)) != len(names):
        raise AssertionError("two planned buffers of one C name")
    return out
