"""Update ops: an optimizer's in-place step (adamw, lion, sgd_momentum, muon), no backward.
Inputs are `state` (read and written, float32), `grad` (read, in the storage dtype) or, in
an op with a matrix step, `work` (float32, written before it is read, never kept);
`update:` gives each state's new value, sequentially (a later formula reads an earlier
one's new value). The values that change between steps (a skip flag, the gradient scale,
the runtime params) come from a `control` array, not scalar arguments, so that a captured
step replays with new ones (templates/update.cu.j2).

A `matrix:` step (Muon) splits the step in three phases, one kernel each: `update:`, then
the work input over its Frobenius norm (`normalize`, the norm read from the device), then,
after the runtime's Newton-Schulz GEMMs, `apply:`. Their formulas may read the matrix's
`rows` and `cols`, kernel arguments of each launch (one a parameter).

`rest: <update op>` hands the parameters that are no Linear weight (the embeddings, the tied
head, the 1-D ones) to another update op (runtime/model/optimizer_plan.py): an op with a
matrix step needs one; lion names adamw (benchmarks/RESULTS.md, "Optimizers on the CPU
default")."""
from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import sympy as sp

from eulergen.errors import EulerError, suggest
from eulergen.generator import c_update, formula, ir, numpy_text
from eulergen.generator.emit import block
from eulergen.generator.gradcheck import EXTREMES, Row, rel_err
from eulergen.generator.kinds.base import OpKind
from eulergen.generator.numeric import compile_exprs
from eulergen.generator.opspec import Formula, identifier, role_inputs, symbol
from eulergen.generator.plan import CTYPE, update_launch
from eulergen.generator.stage_plan import OpPlan, entries, stage
from eulergen.signature import AUTOCAST, CONTROL, KernelSig, bf16_copy

SHAPE = ("rows", "cols")   # a matrix op's symbols: the parameter's shape
SUMSQ = "_sumsq"           # the normalize kernel's pointer to the work input's sum of squares
MAX_STEPS = 32             # Newton-Schulz iterations a matrix step may ask for


class Update(OpKind):
    name = "update"
    template = templates = "update.cu.j2"
    keys = frozenset({"inputs", "update", "matrix", "apply", "rest"})
    required = ("inputs", "update")

    def read_operands(self, doc, data, names):
        inputs = role_inputs(doc, data, self.name, ("state", "grad", "work"), names)
        if "matrix" in data:
            for s in SHAPE:
                names.add(s, None, "matrix")
        elif any(i.role == "work" for i in inputs):
            raise doc.error("a work input is a matrix step's operand: this op has no `matrix:`",
                            "inputs", next(i.name for i in inputs if i.role == "work"))
        return {"inputs": inputs}

    def read_formulas(self, doc, data, names, fields):
        roles = {i.name: i.role for i in fields["inputs"]}
        out = {"update": _assignments(doc, data, "update", names,
                                      {n for n, r in roles.items() if r != "grad"})}
        if "matrix" in data:
            out["matrix"] = _matrix(doc, data, roles, out["update"])
            if "apply" not in data:
                raise doc.error("a matrix step needs `apply:` (the weight's update after it)",
                                "matrix")
            out["apply"] = _assignments(doc, data, "apply", names,
                                        {n for n, r in roles.items() if r == "state"})
        elif "apply" in data:
            raise doc.error("`apply:` follows a matrix step: this op has no `matrix:`", "apply")
        if "rest" in data:
            out["rest"] = identifier(doc, data["rest"], "rest")
            if out["rest"] == data.get("name"):
                raise doc.error(f"{out['rest']!r} is this op: `rest:` names another update op, "
                                "the one of the parameters that are no Linear weight", "rest")
        elif "matrix" in data:
            raise doc.error("a matrix step needs `rest:` (the update op of the parameters that "
                            "are no matrices: the embeddings, the head, the 1-D ones)", "matrix")
        return out

    def derive(self, spec, temps):
        updated = frozenset(f.name for f in spec.update)
        step = temps.code([(f.name, f.expr) for f in spec.update], fixed=updated)
        inputs = tuple(ir.Operand(i.name, i.role, differentiable=False) for i in spec.inputs)
        results = dict.fromkeys(f.name for f in spec.update + spec.apply)
        outputs = tuple(ir.Operand(n, dict((i.name, i.role) for i in inputs)[n],
                                   differentiable=False) for n in results)
        mx = spec.matrix
        if mx is None:
            return ir.UpdateDerived(step=step, rest=spec.rest), inputs, outputs
        x = symbol(mx.orthogonalize)
        normalize = temps.code([(x.name, x / (sp.sqrt(symbol(SUMSQ)) + mx.eps))],
                               fixed=frozenset({x.name}))
        applied = frozenset(f.name for f in spec.apply)
        apply = temps.code([(f.name, f.expr) for f in spec.apply], fixed=applied)
        return ir.UpdateDerived(step=step, matrix=mx, normalize=normalize, apply=apply,
                                rest=spec.rest), inputs, outputs

    def check(self, spec, derived, mod):
        return _check(spec, mod)

    def plan(self, op) -> OpPlan:
        """State is float32 in every variant; grads are the storage dtype, scaled by the
        control's grad_scale as they are read. The bf16 variant of a phase that updates the
        weight also writes its bf16 copy (a null pointer: none), and so does its autocast
        one, of float32 grads (a bf16 model's, as torch.autocast keeps them)."""
        for o in op.inputs:
            if o.role not in ("state", "grad", "work"):
                raise EulerError(f"update op input {o.name!r} has role {o.role!r} (expected "
                                 "'state', 'grad' or 'work')", file=op.where.file,
                                 line=op.where.line, key="inputs")
        state = [o.name for o in op.inputs if o.role != "grad"]
        body: ir.UpdateDerived = op.body
        for key, code in (("update", body.step), ("apply", body.apply)):
            for r in code.names if code is not None else ():
                if r not in state:
                    raise EulerError(f"update result {r!r} is not a state input",
                                     file=op.where.file, line=op.where.line, key=f"{key}.{r}")
        if not any(o.role == "state" for o in op.inputs):
            raise EulerError("an update op needs a state input (the weight it updates)",
                             file=op.where.file, line=op.where.line, key="inputs")
        w = weight(op)
        copy = bf16_copy(w)
        taken = {o.name for o in op.inputs} | {p.name for p in op.params}
        # a phase's numpy function names each result's array _<result>: no input `sumsq`
        reserved = (*CONTROL, "control", copy) + ((SUMSQ[1:],) if body.matrix else ())
        for name in reserved:
            if name in taken:
                raise EulerError(f"{name!r} names the update kernels' own argument; rename the "
                                 "input or param", file=op.where.file, line=op.where.line,
                                 key="inputs" if name in {o.name for o in op.inputs} else "params")
        fixed = tuple((p, "float") for p in _fixed(op))

        def args(code: ir.Code):
            def of(dt, copied: bool = False):
                pointers = tuple((o.name, f"const {CTYPE[dt]}*" if o.role == "grad" else "float*")
                                 for o in _operands(op, code))
                if (dt == "bf16" or copied) and w in code.names:
                    pointers += ((copy, f"{CTYPE['bf16']}*"),)
                return pointers + (("control", "const float*"),) + fixed + (("n", "long long"),)
            return of
        slots = control(op)

        def phase(code: ir.Code, part: str = ""):
            used = _operands(op, code)
            st = stage(op, "step", [o.name for o in used],
                       [o.name for o in used if o.name in code.names], args(code),
                       update_launch, part=part, control=slots)
            if w not in code.names:
                return st
            # vectors of the copy's width: its stores are whole 16-byte ones
            autocast = KernelSig(f"{st.name}_{AUTOCAST}_f32", args(code)("f32", True), "f32",
                                 "step", update_launch("bf16"), part=part, control=slots,
                                 precision=AUTOCAST)
            return replace(st, sigs=st.sigs + (autocast,))
        stages = [phase(body.step)]
        if body.matrix is not None:
            x = body.matrix.orthogonalize
            stages += [
                stage(op, "step", [x, SUMSQ], [x], lambda dt: (
                    (x, "float*"), (SUMSQ, "const float*"), ("control", "const float*"),
                    ("n", "long long")), update_launch, part="normalize", control=slots),
                phase(body.apply, "apply")]
        return OpPlan(tuple(stages))

    def render(self, op, plan: OpPlan, header):
        body: ir.UpdateDerived = op.body
        w = weight(op)
        slots = plan.stages[0].sigs[0].control
        codes = {"step": body.step, "normalize": body.normalize, "apply": body.apply}
        phases = []
        for st in plan.stages:
            code = codes[st.label]
            normalize = st.label == "normalize"
            operands = [o for o in op.inputs if o.name in st.loads]
            phases.append(dict(
                label=st.label, operands=operands,
                scaled=any(o.role == "grad" for o in operands),
                scalars=[SUMSQ] if normalize else [],
                params=[] if normalize else _fixed(op),
                runtime=[(n, i) for i, n in enumerate(slots)
                         if n not in CONTROL and n in code.uses],
                bf16_copy=w in code.names and not normalize,   # not `copy`: a dict's method
                code=block(code, declare=False),
                entries=[dict(e, impl_args=_impl_args(e["sig"], bf16_copy(w),
                                                      w in code.names and not normalize))
                         for e in entries(st)]))
        source = self.render_template(
            header=header, op=op.name, weight=w, skip_slot=slots.index("skip"),
            scale_slot=slots.index("grad_scale"), phases=phases, matrix=body.matrix)
        return ir.RenderedCuda(source, plan.sigs)

    def numpy_source(self, op):
        body: ir.UpdateDerived = op.body
        ins = [o.name for o in op.inputs]
        slots = control(op)
        fixed = tuple(p for p in op.params if p.default is not None)
        shape = SHAPE if body.matrix is not None else ()
        functions = _numpy_phase("step", ins, slots, fixed, shape, body.step, op.inputs, [
            '    """In place and sequential: a later update reads the new value of an earlier one.',
            "    `control`: the values of CONTROL (a skip flag, the factor the grads are scaled",
            '    by, the runtime params), as the CUDA kernels read them."""'])
        constants = [f"CONTROL = {slots!r}"]
        if body.matrix is not None:
            mx = body.matrix
            x = mx.orthogonalize
            functions += ["", ""] + _numpy_phase(
                "normalize", [x, SUMSQ], slots, (), (), body.normalize, (),
                [f'    """{x} over its Frobenius norm (the root of {SUMSQ}[0]), before the '
                 'Newton-Schulz GEMMs."""'])
            functions += ["", ""] + _numpy_phase(
                "apply", ins, slots, fixed, shape, body.apply, (),
                [f'    """After the matrix step: {", ".join(body.apply.names)} from {x} '
                 'orthogonalised."""'])
            constants.append(f"MATRIX = {_settings(mx)!r}")
        return numpy_text.module(op, functions, grads=False, constants=tuple(constants),
                                 support=())

    def manifest(self, op) -> dict:
        """The rest op, and a matrix step's settings, as the runtime runs it between the
        phases' kernels."""
        mx, out = op.body.matrix, {}
        if op.body.rest is not None:
            out["rest"] = op.body.rest
        if mx is not None:
            out["matrix"] = {**_settings(mx), "coefficients": list(mx.coefficients)}
        return out

    def c_source(self, op, header):
        """step over n elements (generator/c_update.py); None for an op with a matrix step
        (its Newton-Schulz GEMMs are the runtime's)."""
        if op.body.matrix is not None:
            return None
        return c_update.step(op, header, control(op), _fixed(op))


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


def _fixed(op: ir.DerivedOp) -> list[str]:
    """The float arguments of the pointwise phases: the params with a default, then (a
    matrix op) the parameter's rows and cols."""
    return [p.name for p in op.params if p.default is not None] + \
        (list(SHAPE) if op.body.matrix is not None else [])


def _operands(op: ir.DerivedOp, code: ir.Code) -> list[ir.Operand]:
    """The inputs a phase reads or writes, in input order: what its kernel loads."""
    return [o for o in op.inputs if o.name in code.uses or o.name in code.names]


def _assignments(doc, data, key: str, names, targets: set) -> tuple[Formula, ...]:
    out = []
    for name, text in doc.mapping(data.get(key), key).items():
        if name not in targets:
            what = "state or work" if key == "update" else "state"
            raise doc.error(f"only {what} inputs can be assigned here"
                            f"{suggest(str(name), targets)}", key, name)
        where = doc.where(key, name)
        out.append(Formula(name, formula.parse(text, names.table, where), where))
    if not out:
        raise doc.error("at least one entry is required", key)
    return tuple(out)


def _settings(mx) -> dict:
    """A matrix step's settings as the numpy module and the manifest give them."""
    return dict(orthogonalize=mx.orthogonalize, steps=mx.steps, coefficients=mx.coefficients,
                eps=mx.eps)


def _matrix(doc, data, roles: dict, update) -> ir.MatrixStep:
    """`matrix: {orthogonalize: <work input update: writes>, steps, coefficients: [a, b, c],
    eps}`."""
    m = doc.mapping(data["matrix"], "matrix")
    allowed = ("orthogonalize", "steps", "coefficients", "eps")
    for key in m:
        if key == "rest":   # every update op's key, not the matrix step's
            raise doc.error("`rest:` is a key of the op, beside `matrix:`, not inside it",
                            "matrix", key)
        if key not in allowed:
            raise doc.error(f"unknown key{suggest(str(key), allowed)}", "matrix", key)
    if "orthogonalize" not in m:
        raise doc.error("missing required key 'orthogonalize'", "matrix")
    x = m["orthogonalize"]
    works = [n for n, r in roles.items() if r == "work"]
    if roles.get(x) != "work" or x not in {f.name for f in update}:
        raise doc.error(f"{x!r} is not a work input that `update:` writes"
                        f"{suggest(str(x), works)}", "matrix", "orthogonalize")
    steps = m.get("steps", 5)
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
        raise doc.error(f"expected an integer from 1 to {MAX_STEPS}, got {steps!r}",
                        "matrix", "steps")
    coefficients = m.get("coefficients", [3.4445, -4.7750, 2.0315])
    if not isinstance(coefficients, list) or len(coefficients) != 3:
        raise doc.error("expected the quintic's [a, b, c]: X <- aX + (bA + cA^2)X",
                        "matrix", "coefficients")
    eps = doc.number(m.get("eps", 1.0e-7), "matrix", "eps")
    if not eps > 0:
        raise doc.error(f"must be positive, got {eps}", "matrix", "eps")
    return ir.MatrixStep(x, steps, tuple(doc.number(c, "matrix", "coefficients", i)
                                         for i, c in enumerate(coefficients)), eps)


def _impl_args(sig: KernelSig, copy: str, has_copy: bool) -> str:
    """What an entry point passes its device impl: its parameters, with the weight's bf16
    copy (a null pointer where the entry point has none) between the operands and control
    in a phase that writes the weight."""
    names = [n for n, _ in sig.args if n != copy]
    if not has_copy:
        return ", ".join(names)
    at = names.index("control")
    return ", ".join(names[:at] + [copy if copy in dict(sig.args) else "nullptr"] + names[at:])


def _numpy_phase(fname, ins, slots, fixed, shape, code, grads, doc) -> list[str]:
    """One phase of a numpy module: its formulas over the arrays in place, after the
    control's skip, the grads (`grads`: the inputs read as such) scaled as they are read."""
    updated = list(code.names)
    lines = [numpy_text.signature(fname, ins + ["control"], fixed, extra=shape), *doc,
             f"    {', '.join(slots)} = (float(c) for c in control)",
             "    if skip:",
             "        return"]
    lines += [f"    {o.name} = {o.name}*grad_scale" for o in grads if o.role == "grad"]
    lines += [f"    {', '.join('_' + n for n in updated)} = {', '.join(updated)}"]
    lines += numpy_text.code(code)
    lines += [f"    _{n}[...] = {n}" for n in updated]
    return lines


def _check(spec, mod) -> list[Row]:
    """Three steps of each phase of the generated module against the spec's formulas
    evaluated one by one in float64; then the float32 sweep of every state and grad."""
    rng = np.random.default_rng(0)
    names = [i.name for i in spec.inputs]
    params = {p.name: (p.default if p.default is not None else 1e-3) for p in spec.params}
    fixed = {p.name: p.default for p in spec.params if p.default is not None}
    phases = [("step", spec.update)]
    if spec.matrix is not None:   # a 4 x 16 matrix, 64 elements as the others
        fixed |= {"rows": 4.0, "cols": 16.0}
        phases.append(("apply", spec.apply))
    scalars = {k: v for k, v in fixed.items() if k in ("rows", "cols")}

    def control_of(p: dict) -> np.ndarray:
        """The module's control array (CONTROL: not skipped, grads unscaled, then the
        runtime params) for the param values p."""
        return np.array([{"skip": 0.0, "grad_scale": 1.0, **p}[c] for c in mod.CONTROL])
    rows = []
    for fname, update in phases:
        state = {n: rng.uniform(*spec.domain_of(n), 64) for n in names}
        ref = {n: v.copy() for n, v in state.items()}
        err = 0.0
        for step in (1, 2, 3):
            p = {**params, **({"step": float(step)} if "step" in params else {})}
            getattr(mod, fname)(*(state[n] for n in names), control_of(p), **fixed)
            for f in update:  # sequential: each formula reads the values updated so far
                fn = compile_exprs([f.expr], names + list(p) + list(scalars))
                ref[f.name] = np.broadcast_to(fn(**ref, **p, **scalars)[0], (64,)).copy()
            err = max(err, max(rel_err(state[f.name], ref[f.name]) for f in update))

        combos = np.array(list(itertools.product(EXTREMES, repeat=len(names)))).T
        vals64 = dict(zip(names, combos))
        vals32 = {n: v.astype(np.float32) for n, v in vals64.items()}
        p = control_of({**params, **({"step": 1.0} if "step" in params else {})})
        with np.errstate(all="ignore"):
            getattr(mod, fname)(*(vals64[n] for n in names), p, **fixed)
            getattr(mod, fname)(*(vals32[n] for n in names), p, **fixed)
        problems = None
        for f in update:
            hit = np.isfinite(vals64[f.name]) & ~np.isfinite(vals32[f.name])
            if hit.any():
                at = ", ".join(f"{n}={c:g}" for n, c in zip(names, combos[:, np.argmax(hit)]))
                problems = f"{f.name} non-finite at {at}"
                break
        ok = err < spec.tolerance and problems is None
        rows.append(Row(spec.name, fname, err, problems or "ok", ok))
    return rows
