"""An update op's C (generated/c/<op>.c, for `eulergen export-c --train`): its step over n
elements, with the float32 kernel's parameters (the control array among them). Each
formula is an element function, called in order on the element's locals, so a later one
reads the new value of an earlier one, as in the kernels (templates/update.cu.j2). The
update kind's (generator/kinds/update.py), for an op without a matrix step."""
from __future__ import annotations

from eulergen.generator import c_text, ir
from eulergen.signature import CONTROL, CFunction


def step(op: ir.DerivedOp, header: str, slots: tuple[str, ...],
         fixed: list[str]) -> ir.RenderedC:
    """The file of `op`'s step: `slots` its control array's (the kind's `control`), `fixed`
    its float parameters (the params with a default)."""
    body: ir.UpdateDerived = op.body
    fn = CFunction(f"{op.name}_step", tuple(
        (o.name, "const float*" if o.role == "grad" else "float*") for o in op.inputs)
        + (("control", "const float*"),) + tuple((n, "float") for n in fixed)
        + (("n", "long long"),), "step")
    ins = [o.name for o in op.inputs]
    order = ins + [p.name for p in op.params]
    at = {n: f"{n}_" for n in ins}
    text = [line for a in body.step.results
            for line in c_text.element(op, f"{op.name}_{a.name}", body.step, a.name, order)]
    text += [c_text.opening(fn),
             f"  if (control[{slots.index('skip')}] != 0.0f) return;   /* skipped */",
             f"  const float grad_scale_ = control[{slots.index('grad_scale')}];",
             *(f"  const float {n} = control[{i}];" for i, n in enumerate(slots)
               if n not in CONTROL),
             "  for (long long i_ = 0; i_ < n; ++i_) {",
             *(f"    const float {o.name}_ = {o.name}[i_] * grad_scale_;"
               for o in op.inputs if o.role == "grad"),
             *(f"    float {o.name}_ = {o.name}[i_];" for o in op.inputs if o.role == "state"),
             *(f"    {a.name}_ = "
               f"{c_text.call(f'{op.name}_{a.name}', body.step, a.name, order, at)};"
               for a in body.step.results),
             *(f"    {a.name}[i_] = {a.name}_;" for a in body.step.results),
             "  }", "}", ""]
    about = (f"{op.name}: an optimizer's step in place over n elements, its formulas in "
             "order (a later one reads the new value of an earlier one); the values that "
             "change from step to step come from `control`, as the kernels read them: a "
             "non-zero skip slot leaves everything as it was, the grads are scaled by the "
             "grad_scale slot, the runtime params follow.")
    return ir.RenderedC(c_text.source(header, about, text), (fn,))
