"""Row ops: map → reduce → map over the last axis (rmsnorm, layernorm, softmax,
cross-entropy). Inputs are `row` (an element of the row), `weight` (shared across rows, one
a column) or `index` (one integer a row); `i` is the element index and `N` the row length;
the row's reductions are declared under `reduce:`, the maxima that only stabilise under
`stabilizers:`. Derived by reverse mode over the reductions (generator/derive_row.py),
planned by generator/plan_row.py and row_schedule.py and printed through
templates/row.cu.j2; a norm-shaped op has the `add` fusion (generator/fuse.py)."""
from __future__ import annotations

import numpy as np

from eulergen.errors import suggest
from eulergen.generator import c_row, c_text, formula, fuse, ir, numpy_text
from eulergen.generator.derive_row import derive_row
from eulergen.generator.gradcheck import (EXTREMES, check_gradients, each_element,
                                          loss_roundoff)
from eulergen.generator.kinds.base import OpKind
from eulergen.generator.opspec import Reduction, formulas, role_inputs
from eulergen.generator.plan_row import RowPlan, plan_row
from eulergen.signature import variant_name

ADD = "add"
ROLES = c_row.ROLES

# One row reduction over the last axis, in the numpy modules.
_REDUCE = '''\
def _reduce(op, term, shape):
    """One row reduction over the last axis, kept as [..., 1] to broadcast against rows."""
    term = np.broadcast_to(term, shape)
    if op == "max":
        return np.max(term, axis=-1, keepdims=True)
    total = np.sum(term, axis=-1, keepdims=True)
    return total / shape[-1] if op == "mean" else total
'''


class Row(OpKind):
    name = "row"
    template = templates = "row.cu.j2"
    keys = frozenset({"inputs", "reduce", "stabilizers", "outputs", "kink"})
    required = ("inputs", "outputs")
    symbols = ("i", "N")

    def read_operands(self, doc, data, names):
        return {"inputs": role_inputs(doc, data, self.name, ROLES, names)}

    def read_formulas(self, doc, data, names, fields):
        reductions, stabilizers = _reductions(doc, data, names)
        return {"reductions": reductions, "stabilizers": stabilizers,
                "outputs": formulas(doc, data, "outputs", names)}

    def derive(self, spec, temps):
        return derive_row(spec, temps)

    def check(self, spec, derived, mod):
        return check_gradients(spec, mod, _Layout(spec))

    def fusions(self, op):
        variants = fuse.add_variants(op)
        return {ADD: variants} if variants else {}

    def plan(self, op) -> RowPlan:
        return plan_row(op)

    def render(self, op, plan: RowPlan, header):
        """Every choice is the plan's; the template prints it."""
        source = self.render_template(header=header, plan=plan, rescale_from=ir.RESCALE_FROM,
                                      rescale_to=ir.RESCALE_TO)
        return ir.RenderedCuda(source, plan.signatures)

    def numpy_source(self, op):
        """forward and backward, then the `add` fusion's where the op has it: forward_add,
        add_forward's forward, and backward_add, add_backward's backward."""
        functions = [*_forward(op, "forward"), "", "", *_backward(op, "backward")]
        fused = fuse.add_variants(op)
        if fused:
            functions += ["", "", *_forward(fused[0], variant_name("forward", ADD)), "", "",
                          *_backward(fused[1], variant_name("backward", ADD))]
        return numpy_text.module(op, functions, support=(*numpy_text.LAYOUT, _REDUCE))

    def c_source(self, op, header):
        """forward, and the `add` fusion's forward_add where the op has it."""
        about = (f"{op.name}: a row op over rows [rows, cols]: its reductions a sweep of the "
                 "row each, then its outputs per element (or per row).")
        return _c_file(op, header, about, c_row.forward, 0)

    def c_train_source(self, op, header):
        """backward, and the `add` fusion's backward_add where the op has it."""
        about = (f"{op.name}: the backward of a row op over rows [rows, cols]: per row the "
                 "forward's reductions, the sums their adjoints read, the adjoints, then each "
                 "element's gradients; a weight's gradient summed over the rows in order.")
        return _c_file(op, header, about, c_row.backward, 1)


KIND = Row()


def _c_file(op, header: str, about: str, function, stage: int) -> ir.RenderedC:
    """The C file of `function` (c_row.forward or backward) of the op and of its `add`
    fusion's variant where it has one (`stage`: 0 forward, 1 backward)."""
    fused = fuse.add_variants(op)
    elements = c_row.Elements(op)
    text, fns = [], []
    for fusion, d in [("", op)] + ([(ADD, fused[stage])] if fused else []):
        fn_text, fn = function(op, d, fusion, elements)
        text += fn_text
        fns.append(fn)
    return ir.RenderedC(c_text.source(header, about, text), tuple(fns))


def _reductions(doc, data: dict, names):
    out = []
    for name, text in doc.mapping(data.get("reduce"), "reduce").items():
        where = doc.where("reduce", name)
        op, expr = formula.parse_reduction(text, names.table, where)
        names.add(name, None, "reduce", name)
        out.append(Reduction(name, op, expr, where))
    declared = {r.name: r for r in out}
    raw = data.get("stabilizers") or []
    if not isinstance(raw, list):
        raise doc.error("expected a list of reduction names: [m]", "stabilizers")
    for n, name in enumerate(raw):
        if name not in declared:
            raise doc.error(f"not a reduction{suggest(str(name), declared)}", "stabilizers", n)
        if declared[name].op != "max":
            raise doc.error(f"'{name}' is a {declared[name].op}(); only max() reductions can "
                            "be stabilizers", "stabilizers", n)
    for r in out:
        if r.op == "max" and r.name not in raw:
            raise r.where.error("a max() reduction that is not a stabilizer is not supported "
                                "(its gradient would go to the arg-max); list it under "
                                "`stabilizers:` if it only stabilises")
    return tuple(out), tuple(raw)


class _Layout:
    """`eulergen check`'s inputs: 2 x 3 rows of 7 (generator/gradcheck.Layout)."""
    ROWS, N = (2, 3), 7

    def __init__(self, spec):
        self.spec = spec
        self.inputs = spec.inputs

    def random(self, rng):
        out = []
        for i in self.inputs:
            if i.role == "index":
                out.append(rng.integers(0, self.N, self.ROWS))
            else:
                shape = self.ROWS + (self.N,) if i.role == "row" else (self.N,)
                out.append(rng.uniform(*self.spec.domain_of(i.name), shape))
        return out

    def out_shapes(self, values):
        shape = values[0].shape
        elem = {i.name for i in self.spec.inputs if i.role in ("row", "weight")} | {"i"}
        return [shape if {s.name for s in o.expr.free_symbols} & elem else shape[:-1]
                for o in self.spec.outputs]

    def central_differences(self, mod, values, douts):
        return each_element(mod, values, douts, [i.role != "index" for i in self.inputs])

    def roundoff(self, mod, values, douts):
        return loss_roundoff(mod, values, douts)

    def sweep(self):
        """Rows of one extreme each, and one row holding all of them; weights at each
        extreme in turn; index 0."""
        n = len(EXTREMES)
        rows = np.concatenate([np.repeat(np.array(EXTREMES)[:, None], n, axis=1),
                               np.array(EXTREMES)[None, :]])
        batches = []
        for w in (1.0,) + EXTREMES:
            batch = []
            for i in self.inputs:
                if i.role == "row":
                    batch.append(rows)
                elif i.role == "weight":
                    batch.append(np.full(n, w))
                else:
                    batch.append(np.zeros(rows.shape[0], np.int64))
            batches.append(batch)
        return batches


# ---- the numpy module ------------------------------------------------------------------

def _prologue(d: ir.DerivedOp) -> list[str]:
    """Bind the row layout: row inputs [..., N], weights [N], index inputs [...] → [..., 1]."""
    rows = [o.name for o in d.inputs if o.role == "row"]
    floats = [o.name for o in d.inputs if o.role != "index"]
    lines = [f"    {o.name} = np.asarray({o.name})" + ("[..., None]" if o.role == "index" else "")
             for o in d.inputs]
    lines += [f"    shape = {rows[0]}.shape",
              "    N = shape[-1]",
              "    i = np.arange(N)",
              f"    dtype = _dtype({', '.join(floats)})"]
    return lines


def _passes(passes: tuple[ir.Pass, ...]) -> list[str]:
    out = []
    for p in passes:
        out += numpy_text.code(p.body)
        out += [f"    {name} = _reduce({op!r}, {name}, shape)" for name, op in p.ops]
    return out


def _forward(d: ir.DerivedOp, name: str) -> list[str]:
    body: ir.RowDerived = d.body
    results = []
    for n, o in enumerate(d.outputs):
        if o.role == "row":
            results.append(f"_fresh({o.name}, shape, dtype, _out, {n})")
        else:
            results.append(f"_fresh(np.broadcast_to({o.name}, shape[:-1] + (1,))[..., 0], "
                           f"shape[:-1], dtype, _out, {n})")
    return [numpy_text.signature(name, [o.name for o in d.inputs], d.params, ("_out=None",)),
            *numpy_text.body([*_prologue(d), *_passes(body.passes),
                              *numpy_text.code(body.elem_outputs),
                              *numpy_text.code(body.row_outputs)]),
            numpy_text.returns(results)]


def _backward(d: ir.DerivedOp, name: str) -> list[str]:
    body: ir.RowDerived = d.body
    ins = [o.name for o in d.inputs]
    douts = ["d" + o.name for o in d.outputs]
    lines = _prologue(d)
    lines += [f"    d{o.name} = np.asarray(d{o.name})" +
              ("[..., None]" if o.role == "scalar" else "") for o in d.outputs]
    lines += _passes(body.passes)
    if body.adjoint_pass is not None:
        lines += _passes((body.adjoint_pass,))
    lines += numpy_text.code(body.adjoints) + numpy_text.code(body.elem_grads)
    out = [numpy_text.signature(name, ins + douts, d.params, ("_out=None",)),
           *numpy_text.body(lines)]
    grads = []
    for o in d.inputs:
        n = len(grads)
        if o.role == "row":
            grads.append(f"_fresh(d{o.name}, shape, dtype, _out, {n})")
        elif o.role == "weight":  # shared across rows: the sum over every row
            grads.append(f"_fresh(np.broadcast_to(d{o.name}, shape).reshape(-1, N).sum(axis=0), "
                         f"(N,), dtype, _out, {n})")
    out.append(numpy_text.returns(grads))
    return out
