"""A row op's C (generated/c/<op>.c and <op>.train.c: docs/internals.md, "Generated C"): its
forward and its backward, each a loop over rows [rows, cols] that sweeps a row once for
each pass of reductions (the derived forward's, then the backward's adjoint sums), forms
the row's scalars, then computes and stores each element's values. The row kind's
(generator/kinds/row.py).

Outputs may alias inputs (forward_add's _stream may be x; the fused cross-entropy's dx is
its x; backward_add's dx is d_stream): a sweep reads before any output of its row is
stored, and an element's values are all computed before any is stored. A weight's gradient
is the sum over the rows of its per-element term, added row after row from row 0 (numpy's
order for a sum over the leading axis).
"""
from __future__ import annotations

from eulergen.generator import c_text, ir
from eulergen.signature import CFunction, variant_name

ROLES = ("row", "weight", "index")
_C_START = {"sum": "0.0f", "mean": "0.0f", "max": "-INFINITY"}


def _roles(d: ir.DerivedOp) -> dict[str, list[str]]:
    return {r: [o.name for o in d.inputs if o.role == r] for r in ROLES}


def _sizes() -> tuple[tuple[str, str], ...]:
    return (("rows", "long long"), ("cols", "int"))


def _sweeps(passes, named, order: list[str], at: dict, elements: Elements) -> list[str]:
    """The loop lines of `passes` within a row: a sweep of the row each, forming its
    reductions (a mean divided by the row's length after). `named(result)`: its element
    function's candidate names (Elements)."""
    loop = []
    for p in passes:
        for name, how in p.ops:
            loop.append(f"    float {name} = {_C_START[how]};")
        loop.append("    for (int c_ = 0; c_ < cols; ++c_) {")
        for name, how in p.ops:
            term = elements.call(named(name), p.body, name, order, at)
            loop.append(f"      {name} = fmaxf({name}, {term});" if how == "max" else
                        f"      {name} += {term};")
        loop.append("    }")
        loop += [f"    {name} /= (float)cols;" for name, how in p.ops if how == "mean"]
    return loop


class Elements:
    """The element functions of one file, each defined once, under the first of a call's
    candidate names that the file does not hold already with another formula: backward_add
    asks for the op's own name first, so it calls the op's passes and weight terms."""

    def __init__(self, op: ir.DerivedOp):
        self.op, self.text, self.known = op, [], {}

    def define(self, names: tuple[str, ...], code: ir.Code, result: str,
               order: list[str]) -> str:
        for name in names:
            lines = c_text.element(self.op, name, code, result, order)
            if self.known.get(name, lines) == lines:
                if name not in self.known:
                    self.known[name] = lines
                    self.text += lines
                return name
        raise AssertionError(f"{names[-1]}: two formulas of one name")

    def call(self, names, code, result, order, at) -> str:
        return c_text.call(self.define(names, code, result, order), code, result, order, at)


def _stem(op: ir.DerivedOp, fusion: str) -> str:
    return f"{op.name}_{fusion}_" if fusion else f"{op.name}_"


def forward(op: ir.DerivedOp, d: ir.DerivedOp, fusion: str,
            elements: Elements) -> tuple[list[str], CFunction]:
    """The C forward of `d` (the op or a fused variant's forward): per row, each pass's
    sweep forms its reductions, then each element's outputs are computed and stored, then
    the per-row outputs."""
    body: ir.RowDerived = d.body
    by_role = _roles(d)
    ins = by_role["row"] + by_role["weight"] + by_role["index"]
    elem = [o.name for o in d.outputs if o.role == "row"]
    per_row = [o.name for o in d.outputs if o.role != "row"]
    fn = CFunction(f"{op.name}_{variant_name('forward', fusion)}",
                   c_text.pointers(d, ins, elem + per_row) + c_text.floats(op) + _sizes(),
                   "forward", fusion)
    reductions = [name for p in body.passes for name, _ in p.ops]
    order = ins + reductions + ["i", "N"] + [p.name for p in op.params]
    at = {**{n: f"{n}[at_ + c_]" for n in by_role["row"]},
          **{n: f"{n}[c_]" for n in by_role["weight"]},
          **{n: f"(float){n}[r_]" for n in by_role["index"]}, "i": "(float)c_", "N": "(float)cols"}
    def named(result):
        return (_stem(op, fusion) + result.lstrip("_"),)
    at_first = len(elements.text)
    loop = ["  for (long long r_ = 0; r_ < rows; ++r_) {", "    const long long at_ = r_ * cols;",
            *_sweeps(body.passes, named, order, at, elements)]
    for code, names, store in ((body.elem_outputs, elem, "at_ + c_"),
                               (body.row_outputs, per_row, "r_")):
        if not names:
            continue
        pad = "      " if store != "r_" else "    "
        values = [f"{pad}const float {o}_ = {elements.call(named(o), code, o, order, at)};"
                  for o in names]
        stores = [f"{pad}{o}[{store}] = {o}_;" for o in names]
        loop += (["    for (int c_ = 0; c_ < cols; ++c_) {", *values, *stores, "    }"]
                 if store != "r_" else [*values, *stores])
    return elements.text[at_first:] + [c_text.opening(fn), *loop, "  }", "}", ""], fn


def backward(op: ir.DerivedOp, d: ir.DerivedOp, fusion: str,
             elements: Elements) -> tuple[list[str], CFunction]:
    """The C backward of `d` (the op, or its `add` fusion's backward, whose dx adds
    d_stream): per row, the forward's passes, then the adjoint sums' sweep, the reduction
    adjoints, then each element's input gradients (stored) and weight terms (added to the
    weights' gradients, zeroed first)."""
    body: ir.RowDerived = d.body
    by_role = _roles(d)
    ins = by_role["row"] + by_role["weight"] + by_role["index"]
    douts = [f"d{o.name}" for o in d.outputs]
    elem_douts = [f"d{o.name}" for o in d.outputs if o.role == "row"]
    grads = [f"d{n}" for n in by_role["row"] + by_role["weight"]]
    wgrads = [f"d{n}" for n in by_role["weight"]]
    fn = CFunction(f"{op.name}_{variant_name('backward', fusion)}",
                   c_text.pointers(d, ins + douts, grads) + c_text.floats(op) + _sizes(),
                   "backward", fusion)
    passes = body.passes + ((body.adjoint_pass,) if body.adjoint_pass else ())
    sums = [name for p in passes for name, _ in p.ops]
    adjoints = list(body.adjoints.names)
    order = ins + douts + sums + adjoints + ["i", "N"] + [p.name for p in op.params]
    at = {**{n: f"{n}[at_ + c_]" for n in by_role["row"] + elem_douts},
          **{n: f"{n}[c_]" for n in by_role["weight"]},
          **{n: f"(float){n}[r_]" for n in by_role["index"]},
          **{n: f"{n}[r_]" for n in douts if n not in elem_douts},
          "i": "(float)c_", "N": "(float)cols"}
    def named(result):
        return tuple(dict.fromkeys((_stem(op, "") + result.lstrip("_"),
                                    _stem(op, fusion) + result.lstrip("_"))))
    at_first = len(elements.text)
    loop = [*(f"  for (int c_ = 0; c_ < cols; ++c_) {g}[c_] = 0.0f;" for g in wgrads),
            "  for (long long r_ = 0; r_ < rows; ++r_) {", "    const long long at_ = r_ * cols;",
            *_sweeps(passes, named, order, at, elements),
            *(f"    const float {a} = {elements.call(named(a), body.adjoints, a, order, at)};"
              for a in adjoints),
            "    for (int c_ = 0; c_ < cols; ++c_) {",
            *(f"      const float {g}_ = {elements.call(named(g), body.elem_grads, g, order, at)};"
              for g in grads),
            *(f"      {g}[c_] += {g}_;" if g in wgrads else f"      {g}[at_ + c_] = {g}_;"
              for g in grads),
            "    }"]
    return elements.text[at_first:] + [c_text.opening(fn), *loop, "  }", "}", ""], fn
