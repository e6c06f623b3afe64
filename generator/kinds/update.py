"""Update ops: an optimizer's in-place step (adamw, lion), no backward. Inputs are `state`
(read and written, float32) or `grad` (read, in the storage dtype); `update:` gives each
state's new value, sequentially (a later formula reads an earlier one's new value). The
values that change between steps (a skip flag, the gradient scale, the runtime params) come
from a `control` array, not scalar arguments, so that a captured step replays with new ones
(templates/update.cu.j2)."""
from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np

from eulergen.errors import EulerError, suggest
from eulergen.generator import formula, ir, numpy_text
from eulergen.generator.emit import block
from eulergen.generator.gradcheck import EXTREMES, Row, rel_err
from eulergen.generator.kinds.base import OpKind
from eulergen.generator.numeric import compile_exprs
from eulergen.generator.opspec import Formula, role_inputs
from eulergen.generator.plan import CTYPE, update_launch
from eulergen.generator.stage_plan import OpPlan, entries, stage
from eulergen.signature import AUTOCAST, CONTROL, KernelSig, bf16_copy


class Update(OpKind):
    name = "update"
    template = templates = "update.cu.j2"
    keys = frozenset({"inputs", "update"})
    required = ("inputs", "update")

    def read_operands(self, doc, data, names):
        return {"inputs": role_inputs(doc, data, self.name, ("state", "grad"), names)}

    def read_formulas(self, doc, data, names, fields):
        states = {i.name for i in fields["inputs"] if i.role == "state"}
        out = []
        for name, text in doc.mapping(data.get("update"), "update").items():
            if name not in states:
                raise doc.error(f"only state inputs can be updated{suggest(str(name), states)}",
                                "update", name)
            where = doc.where("update", name)
            out.append(Formula(name, formula.parse(text, names.table, where), where))
        if not out:
            raise doc.error("at least one entry is required", "update")
        return {"update": tuple(out)}

    def derive(self, spec, temps):
        updated = frozenset(f.name for f in spec.update)
        step = temps.code([(f.name, f.expr) for f in spec.update], fixed=updated)
        inputs = tuple(ir.Operand(i.name, i.role, differentiable=False) for i in spec.inputs)
        outputs = tuple(ir.Operand(f.name, "state", differentiable=False) for f in spec.update)
        return ir.UpdateDerived(step=step), inputs, outputs

    def check(self, spec, derived, mod):
        return _check(spec, mod)

    def plan(self, op) -> OpPlan:
        """State is float32 in every variant; grads are the storage dtype, scaled by the
        control's grad_scale as they are read. The bf16 variant also writes the weight's bf16
        copy (a null pointer: none), and so does the autocast one, of float32 grads (a bf16
        model whose gradients are float32, as torch.autocast's are)."""
        for o in op.inputs:
            if o.role not in ("state", "grad"):
                raise EulerError(f"update op input {o.name!r} has role {o.role!r} (expected "
                                 "'state' or 'grad')", file=op.where.file, line=op.where.line,
                                 key="inputs")
        state = [o.name for o in op.inputs if o.role == "state"]
        for r in op.body.step.names:
            if r not in state:
                raise EulerError(f"update result {r!r} is not a state input", file=op.where.file,
                                 line=op.where.line, key=f"update.{r}")
        if not state:
            raise EulerError("an update op needs a state input (the weight it updates)",
                             file=op.where.file, line=op.where.line, key="inputs")
        copy = bf16_copy(weight(op))
        taken = {o.name for o in op.inputs} | {p.name for p in op.params}
        for name in (*CONTROL, "control", copy):
            if name in taken:
                raise EulerError(f"{name!r} names the update kernels' own argument; rename the "
                                 "input or param", file=op.where.file, line=op.where.line,
                                 key="inputs" if name in {o.name for o in op.inputs} else "params")
        fixed = tuple((p.name, "float") for p in op.params if p.default is not None)

        def args(dt, copied: bool = False):
            pointers = tuple((o.name, f"const {CTYPE[dt]}*" if o.role == "grad" else "float*")
                             for o in op.inputs)
            if dt == "bf16" or copied:
                pointers += ((copy, f"{CTYPE['bf16']}*"),)
            return pointers + (("control", "const float*"),) + fixed + (("n", "long long"),)
        st = stage(op, "step", [o.name for o in op.inputs], state, args, update_launch,
                   control=control(op))
        # vectors of the copy's width: its stores are whole 16-byte ones
        autocast = KernelSig(f"{st.name}_{AUTOCAST}_f32", args("f32", True), "f32", "step",
                             update_launch("bf16"), control=control(op), precision=AUTOCAST)
        return OpPlan((replace(st, sigs=st.sigs + (autocast,)),))

    def render(self, op, plan: OpPlan, header):
        body: ir.UpdateDerived = op.body
        (st,) = plan.stages
        slots, w = st.sigs[0].control, weight(op)
        points = [dict(e, impl_args=_impl_args(e["sig"], bf16_copy(w))) for e in entries(st)]
        source = self.render_template(
            header=header, op=op.name, operands=list(op.inputs),
            params=[p.name for p in op.params if p.default is not None], weight=w,
            skip_slot=slots.index("skip"), scale_slot=slots.index("grad_scale"),
            runtime=[(n, i) for i, n in enumerate(slots) if n not in CONTROL],
            code=block(body.step, declare=False), entries=points)
        return ir.RenderedCuda(source, plan.sigs)

    def numpy_source(self, op):
        body: ir.UpdateDerived = op.body
        ins = [o.name for o in op.inputs]
        updated = [a.name for a in body.step.results]
        slots = control(op)
        fixed = tuple(p for p in op.params if p.default is not None)
        step = [numpy_text.signature("step", ins + ["control"], fixed),
                '    """In place and sequential: a later update reads the new value of an earlier one.',
                "    `control`: the values of CONTROL (a skip flag, the factor the grads are scaled",
                '    by, the runtime params), as the CUDA kernels read them."""',
                f"    {', '.join(slots)} = (float(c) for c in control)",
                "    if skip:",
                "        return"]
        step += [f"    {o.name} = {o.name}*grad_scale" for o in op.inputs if o.role == "grad"]
        step += [f"    {', '.join('_' + n for n in updated)} = {', '.join(updated)}"]
        step += numpy_text.code(body.step)
        step += [f"    _{n}[...] = {n}" for n in updated]
        return numpy_text.module(op, step, grads=False, constants=(f"CONTROL = {slots!r}",),
                                 support=())


KIND = Update()


def control(op: ir.DerivedOp) -> tuple[str, ...]:
    """The slots of an update op's `control` array (float32 on the device), which its
    kernels and its numpy step read instead of scalar arguments (written on the device once
    a step, so that a captured step replays with new values): signature.CONTROL (skip and
    grad_scale), then the op's runtime params in spec order."""
    return CONTROL + tuple(p.name for p in op.params if p.default is None)


def weight(op: ir.DerivedOp) -> str:
    """The state input that is the model's weight: the first one. A bf16 plan's step also
    writes its bf16 copy (`<weight>_bf16`), the array the model's kernels read."""
    return next(o.name for o in op.inputs if o.role == "state")


def _impl_args(sig: KernelSig, copy: str) -> str:
    """What an entry point passes its device impl: its parameters, with the weight's bf16
    copy (a null pointer where the entry point has none) between the operands and control."""
    names = [n for n, _ in sig.args if n != copy]
    at = names.index("control")
    return ", ".join(names[:at] + [copy if copy in dict(sig.args) else "nullptr"] + names[at:])


def _check(spec, mod) -> list[Row]:
    """Three steps of the generated module against the spec's formulas evaluated one by
    one in float64; then the float32 sweep of every state and grad."""
    rng = np.random.default_rng(0)
    names = [i.name for i in spec.inputs]
    params = {p.name: (p.default if p.default is not None else 1e-3) for p in spec.params}
    fixed = {p.name: p.default for p in spec.params if p.default is not None}

    def control_of(p: dict) -> np.ndarray:
        """The module's control array (CONTROL: not skipped, grads unscaled, then the
        runtime params) for the param values p."""
        return np.array([{"skip": 0.0, "grad_scale": 1.0, **p}[c] for c in mod.CONTROL])
    state = {n: rng.uniform(*spec.domain_of(n), 64) for n in names}
    ref = {n: v.copy() for n, v in state.items()}
    err = 0.0
    for step in (1, 2, 3):
        p = {**params, **({"step": float(step)} if "step" in params else {})}
        mod.step(*(state[n] for n in names), control_of(p), **fixed)
        for f in spec.update:  # sequential: each formula reads the values updated so far
            fn = compile_exprs([f.expr], names + list(p))
            ref[f.name] = np.broadcast_to(fn(**ref, **p)[0], (64,)).copy()
        err = max(err, max(rel_err(state[f.name], ref[f.name]) for f in spec.update))

    combos = np.array(list(itertools.product(EXTREMES, repeat=len(names)))).T
    vals64 = dict(zip(names, combos))
    vals32 = {n: v.astype(np.float32) for n, v in vals64.items()}
    p = control_of({**params, **({"step": 1.0} if "step" in params else {})})
    with np.errstate(all="ignore"):
        mod.step(*(vals64[n] for n in names), p, **fixed)
        mod.step(*(vals32[n] for n in names), p, **fixed)
    problems = None
    for f in spec.update:
        hit = np.isfinite(vals64[f.name]) & ~np.isfinite(vals32[f.name])
        if hit.any():
            at = ", ".join(f"{n}={c:g}" for n, c in zip(names, combos[:, np.argmax(hit)]))
            problems = f"{f.name} non-finite at {at}"
            break
    ok = err < spec.tolerance and problems is None
    return [Row(spec.name, "step", err, problems or "ok", ok)]
