"""Fused variants of an op, made from its derived form: every op of the right shape gets
them, a user's too, and the runtime picks them from the manifest (its `fusions`, and the
kernels' `fusion`).

- `add`, for a row op with one row input and per-element outputs (a norm): the residual
  add folded in. Its forward reads the stream x and a branch, writes their sum (the stream
  the model keeps) and the op's outputs of that sum in one pass; its backward is the op's
  at the sum, with the stream's incoming gradient added to dx in the same pass. They are
  two ops: `add_forward` (inputs x, _branch, weights; outputs _stream, then the op's) and
  `add_backward` (the op with the extra output _stream = x, whose backward reads d_stream).
- `bias`, for a pointwise op: each input x [rows, F] gets a bias _bias_x [F] broadcast over
  rows, and the op reads x + _bias_x; the backward also writes each bias's gradient, the
  column sums of dx (plan_ops: partial sums a block, then a fixed-order reduce).
- `gemv`, for a pointwise op of one input and one output (`takes_gemv`): the op as the
  epilogue of the decoder's GEMM of a few rows, y = f(x·wᵀ + b), with the bits of the pair
  it stands for: the float32 sum read as the storage holds it, then the code of the op's
  forward (no bias) or of its bias variant, unchanged, printed into kernels beside the op's
  (generator/kinds/pointwise.py); forward only, and no `fusions` entry: no op call runs it,
  runtime/engine/gemv.py launches its kernels.

`add` and `bias` are substitutions into the derived code, not a second derivation: the
fused kernels compute the op's own expressions, and add_backward's weight-gradient terms
are the op's, so its split backward shares the op's column kernel.
"""
from __future__ import annotations

import functools
from dataclasses import replace

from eulergen.errors import EulerError
from eulergen.generator import ir
from eulergen.generator.opspec import symbol

BRANCH, STREAM = "_branch", "_stream"   # add: names no spec can declare (a leading _)


def bias_name(x: str) -> str:
    return f"_bias_{x}"


def _substituted(code: ir.Code, subs: dict) -> ir.Code:
    return ir.Code(tuple(ir.Assign(a.name, a.expr.xreplace(subs)) for a in code.temps),
                   tuple(ir.Assign(a.name, a.expr.xreplace(subs)) for a in code.results))


def _refuse_clashes(op: ir.DerivedOp, made: list[str]) -> None:
    taken = {o.name for o in op.inputs + op.outputs} | {p.name for p in op.params}
    taken |= {f"d{o.name}" for o in op.inputs + op.outputs}
    clash = sorted(taken & set(made))
    if clash:
        raise EulerError(f"'{clash[0]}' is the name of an operand of a generated fused variant; "
                         "rename it", file=op.where.file, line=op.where.line)


def takes_add(op: ir.DerivedOp) -> bool:
    """Whether an op takes the `add` fusion: a row op (its body a RowDerived) with one
    differentiable row input, no index input, every output per element."""
    rows = [o for o in op.inputs if o.role == "row"]
    return (isinstance(op.body, ir.RowDerived) and len(rows) == 1 and rows[0].differentiable
            and all(o.role in ("row", "weight") for o in op.inputs)
            and all(o.role == "row" for o in op.outputs))


def takes_gemv(op: ir.DerivedOp) -> bool:
    """Whether an op takes the `gemv` fusion: a pointwise op (its body a PointwiseDerived)
    of one input and one output (not a gated one: the GEMM writes one value a column)."""
    return (isinstance(op.body, ir.PointwiseDerived) and len(op.inputs) == 1
            and len(op.outputs) == 1)


# Cached: build, plan, render and the numpy module each ask for an op's variants, which a
# DerivedOp (frozen, hashable) determines; a refused clash is raised again on every call.
@functools.cache
def add_variants(op: ir.DerivedOp) -> tuple[ir.DerivedOp, ir.DerivedOp] | None:
    """(add_forward, add_backward) of a row op that takes_add, else None."""
    if not takes_add(op):
        return None
    _refuse_clashes(op, [BRANCH, STREAM, f"d{STREAM}"])
    body: ir.RowDerived = op.body
    (x,) = (o.name for o in op.inputs if o.role == "row")
    stream = symbol(x) + symbol(BRANCH)
    subs = {symbol(x): stream}
    elem = _substituted(body.elem_outputs, subs)
    nothing = ir.Code((), ())
    forward_body = ir.RowDerived(
        passes=tuple(ir.Pass(p.ops, _substituted(p.body, subs)) for p in body.passes),
        stabilizers=body.stabilizers,
        elem_outputs=ir.Code(elem.temps, (ir.Assign(STREAM, stream),) + elem.results),
        row_outputs=body.row_outputs, adjoint_pass=None, adjoints=nothing, elem_grads=nothing,
        online=tuple(replace(s, term=_substituted(s.term, subs)) for s in body.online))
    # the forward variant has no backward of its own: add_backward is its backward
    inputs = [replace(o, differentiable=False) for o in op.inputs]
    at = next(n for n, o in enumerate(inputs) if o.role == "row") + 1
    forward = replace(op, inputs=tuple(inputs[:at] + [ir.Operand(BRANCH, "row", False)]
                                       + inputs[at:]),
                      outputs=(ir.Operand(STREAM, "row", False),) + op.outputs,
                      body=forward_body)
    grads = body.elem_grads
    dx = symbol(f"d{x}")
    backward_body = replace(body, elem_outputs=ir.Code(
        body.elem_outputs.temps, body.elem_outputs.results + (ir.Assign(STREAM, symbol(x)),)),
        elem_grads=ir.Code(grads.temps, tuple(
            ir.Assign(a.name, a.expr + symbol(f"d{STREAM}")) if a.name == dx.name else a
            for a in grads.results)))
    backward = replace(op, outputs=op.outputs + (ir.Operand(STREAM, "row"),), body=backward_body)
    return forward, backward


@functools.cache
def bias_variant(op: ir.DerivedOp) -> ir.DerivedOp | None:
    """The `bias` variant of a pointwise op (inputs x…, then _bias_x…, role 'bias'), or
    None for an op whose body is not a PointwiseDerived."""
    if not isinstance(op.body, ir.PointwiseDerived):
        return None
    names = [o.name for o in op.inputs]
    biases = [bias_name(x) for x in names]
    _refuse_clashes(op, biases + [f"d{b}" for b in biases])
    subs = {symbol(x): symbol(x) + symbol(b) for x, b in zip(names, biases)}
    body: ir.PointwiseDerived = op.body
    backward = _substituted(body.backward, subs)
    grads = tuple(ir.Assign(f"d{b}", symbol(f"d{x}")) for x, b in zip(names, biases)
                  if f"d{x}" in backward.names)
    return replace(op, inputs=op.inputs + tuple(ir.Operand(b, "bias") for b in biases),
                   body=ir.PointwiseDerived(forward=_substituted(body.forward, subs),
                                            backward=ir.Code(backward.temps,
                                                             backward.results + grads)))

