"""Pointwise ops: outputs elementwise in the inputs (gelu, silu, swiglu(a, b), relu²), every
operand of one shape. `d input = Σ d out · ∂out/∂input` per input, CSE'd; a spec may give a
backward of its own (`backward:`), checked against the derived one. One kernel a stage over
the flat operands (templates/pointwise.cu.j2), the `bias` variant (generator/fuse.py): the
op of x + b over rows, its bias gradients summed through partial rows and a reduce; and, for
an op of one input and one output, the `gemv` variant: the decoder's few-row GEMM
(generator/kinds/gemv.py's kernels, their body included) with the op's forward as its
epilogue."""
from __future__ import annotations

import itertools

import numpy as np

from eulergen import TEMPLATES_DIR
from eulergen.errors import EulerError, suggest
from eulergen.generator import c_text, formula, fuse, ir, numpy_text
from eulergen.generator.differentiate import jvp
from eulergen.generator.emit import block, param_names
from eulergen.generator.gradcheck import EPS, EXTREMES, as_tuple, check_gradients, roundoff_floor
from eulergen.generator.kinds.base import OpKind
from eulergen.generator.numeric import compile_exprs, random_inputs
from eulergen.generator.opspec import Formula, Input, formulas, symbol
from eulergen.generator.plan import (DTYPES, GEMV_BODY, GEMV_LAUNCHES, WGRAD_REDUCE_LAUNCH,
                                     arithmetic_light, bias_launch, gemv_args,
                                     pointwise_launch, reduce_args)
from eulergen.generator.stage_plan import (OpPlan, StagePlan, entries, floats, pointers, ptrs,
                                           stage, title)
from eulergen.signature import CFunction, KernelSig, variant_name

BIAS, GEMV = "bias", "gemv"


class Pointwise(OpKind):
    name = "pointwise"
    template = templates = "pointwise.cu.j2"
    keys = frozenset({"inputs", "outputs", "kink", "backward"})
    required = ("inputs", "outputs")

    def template_files(self):
        """Its template and the gemv kernels' body, which the `gemv` variant includes."""
        return [self.folder / self.template, TEMPLATES_DIR / GEMV_BODY]

    # ---- spec -----------------------------------------------------------------------------

    def read_operands(self, doc, data, names):
        raw = data.get("inputs")
        if not isinstance(raw, list) or not raw:
            raise doc.error("a pointwise op lists its inputs: inputs: [x] or [a, b]", "inputs")
        for n, name in enumerate(raw):
            names.add(name, None, "inputs", n)
        return {"inputs": tuple(Input(name, "elem") for name in raw)}

    def read_formulas(self, doc, data, names, fields):
        outputs = formulas(doc, data, "outputs", names)
        if "backward" not in data:
            return {"outputs": outputs}
        # Explicit gradients: formulas over the inputs, params and d<output>. The backward
        # recomputes from the inputs: output values are not among its arguments.
        table = {k: v for k, v in names.table.items() if k not in {o.name for o in outputs}}
        table |= {f"d{o.name}": symbol(f"d{o.name}") for o in outputs}
        known = {i.name for i in fields["inputs"]}
        backward = []
        for name, text in doc.mapping(data["backward"], "backward").items():
            if name not in known:
                raise doc.error(f"not an input{suggest(str(name), known)}", "backward", name)
            where = doc.where("backward", name)
            backward.append(Formula(f"d{name}", formula.parse(text, table, where), where))
        return {"outputs": outputs, "backward": tuple(backward)}

    # ---- derive and check -----------------------------------------------------------------

    def derive(self, spec, temps):
        forward = temps.code([(o.name, o.expr) for o in spec.outputs])
        grads = {f"d{i.name}": jvp(spec, spec.outputs, symbol(i.name)) for i in spec.inputs}
        for f in spec.backward:
            _check_override(spec, f, grads[f.name])
            grads[f.name] = f.expr
        backward = temps.code(list(grads.items()))
        inputs = tuple(ir.Operand(i.name, "elem") for i in spec.inputs)
        outputs = tuple(ir.Operand(o.name, "elem") for o in spec.outputs)
        return ir.PointwiseDerived(forward=forward, backward=backward), inputs, outputs

    def check(self, spec, derived, mod):
        return check_gradients(spec, mod, _Layout(spec))

    def fusions(self, op):
        variant = fuse.bias_variant(op)
        return {BIAS: (variant, variant)}

    # ---- plan and render ------------------------------------------------------------------

    def plan(self, op) -> OpPlan:
        body: ir.PointwiseDerived = op.body
        ins = [o.name for o in op.inputs]
        outs = [o.name for o in op.outputs]
        grads = [f"d{o.name}" for o in op.inputs if o.differentiable]
        # The backward reads the inputs, any forward output it chose to reuse, and d<out>.
        bwd_reads = ins + [o for o in outs if o in body.backward.uses] + [f"d{o}" for o in outs]
        stages = [("forward", ins, outs, body.forward)]
        if grads:
            stages.append(("backward", bwd_reads, grads, body.backward))
        planned = []
        for call, loads, stores, code in stages:
            light = arithmetic_light(code)
            planned.append(stage(
                op, call, loads, stores,
                lambda dt: pointers(dt, loads, stores) + floats(op) + (("n", "long long"),),
                lambda dt: pointwise_launch(dt, len(loads), light)))
        return OpPlan(tuple(planned), _bias_stages(fuse.bias_variant(op)), _gemv_stage(op))

    def render(self, op, plan: OpPlan, header):
        body: ir.PointwiseDerived = op.body
        fused = fuse.bias_variant(op).body
        code = {"forward": body.forward, "backward": body.backward,
                variant_name("forward", BIAS): fused.forward,
                variant_name("backward", BIAS): fused.backward}

        def kernel(st: StagePlan) -> dict:
            return {"impl": st.name, "title": title(st.label, st.loads, st.stores + st.partials),
                    "loads": st.loads, "stores": st.stores, "ptrs": ptrs(st.loads, st.stores),
                    "code": block(code[st.label]), "entries": entries(st), "biases": st.biases,
                    "rows": [a for a in st.loads if a not in st.biases], "partials": st.partials}
        reduce = next((st for st in plan.bias if st.sigs[0].part == "reduce"), None)
        # the gemv variant's epilogue: the code of the forward kernel and of the bias
        # variant's (the pair it stands for), each returning the output
        epilogue = plan.gemv and {
            "body": GEMV_BODY, "name": plan.gemv.name, "input": op.inputs[0].name,
            "bias": fuse.bias_name(op.inputs[0].name), "output": op.outputs[0].name,
            "code": block(body.forward), "bias_code": block(fused.forward),
            "entries": entries(plan.gemv)}
        source = self.render_template(
            header=header, op=op.name, kernels=[kernel(st) for st in plan.stages],
            bias_kernels=[kernel(st) for st in plan.bias if st is not reduce],
            reduce=reduce and {"entries": entries(reduce)}, gemv=epilogue,
            params=param_names(op))
        return ir.RenderedCuda(source, plan.sigs)

    # ---- numpy ----------------------------------------------------------------------------

    def numpy_source(self, op):
        """forward and backward, then the bias variant's: forward_bias and backward_bias,
        whose bias gradients are summed over every row."""
        return numpy_text.module(op, [*_numpy_pair(op, ""), "", "",
                                      *_numpy_pair(fuse.bias_variant(op), f"_{BIAS}")])

    # ---- C ----------------------------------------------------------------------------------

    def c_source(self, op, header):
        """forward over n elements; forward_bias, the bias variant's, over [rows, cols] inputs
        and [cols] biases."""
        fused = fuse.bias_variant(op)
        outs = [o.name for o in op.outputs]
        sizes = {"": (("n", "long long"),), BIAS: (("rows", "long long"), ("cols", "int"))}
        text, fns = [], []
        for fusion, d in (("", op), (BIAS, fused)):
            ins = [o.name for o in d.inputs]
            fn = CFunction(f"{op.name}_{variant_name('forward', fusion)}",
                           c_text.pointers(d, ins, outs) + c_text.floats(op) + sizes[fusion],
                           "forward", fusion)
            order = ins + [p.name for p in op.params]
            stem = f"{op.name}_{fusion}_" if fusion else f"{op.name}_"
            code = d.body.forward
            for o in outs:
                text += c_text.element(op, stem + o, code, o, order)
            at = {o.name: f"{o.name}[{'c_' if o.role == 'bias' else 'i_'}]" for o in d.inputs}
            loop = (["  for (long long i_ = 0; i_ < n; ++i_) {"] if not fusion else
                    ["  for (long long r_ = 0; r_ < rows; ++r_)",
                     "    for (int c_ = 0; c_ < cols; ++c_) {",
                     "      const long long i_ = r_ * cols + c_;"])
            pad = "    " if not fusion else "      "
            # every output computed before any is stored: outputs may alias inputs
            values = [f"{pad}const float {o}_ = {c_text.call(stem + o, code, o, order, at)};"
                      for o in outs]
            text += [c_text.opening(fn), *loop, *values,
                     *(f"{pad}{o}[i_] = {o}_;" for o in outs), "  " * (2 - (not fusion)) + "}",
                     "}", ""]
            fns.append(fn)
        about = (f"{op.name}: pointwise over every element; its bias variant, of x + b for "
                 "inputs [rows, cols] and biases [cols].")
        return ir.RenderedC(c_text.source(header, about, text), tuple(fns))

    def c_train_source(self, op, header):
        """backward over n elements (the inputs and d<outputs> in, d<inputs> out); the bias
        variant's backward_bias over [rows, cols], a bias's gradient the column sums of its
        input's, added row after row (numpy's order)."""
        fused = fuse.bias_variant(op)
        douts = [f"d{o.name}" for o in op.outputs]
        text, fns = [], []
        for fusion, d in (("", op), (BIAS, fused)):
            ins = [o.name for o in d.inputs]
            code = d.body.backward
            grads = [f"d{o.name}" for o in op.inputs if f"d{o.name}" in code.names]
            biases = [f"d{o.name}" for o in d.inputs if o.role == "bias"
                      and f"d{o.name}" in code.names]
            sizes = (("rows", "long long"), ("cols", "int")) if fusion else (("n", "long long"),)
            fn = CFunction(f"{op.name}_{variant_name('backward', fusion)}",
                           c_text.pointers(d, ins + douts, grads + biases) + c_text.floats(op)
                           + sizes, "backward", fusion)
            order = ins + douts + [p.name for p in op.params]
            stem = f"{op.name}_{fusion}_" if fusion else f"{op.name}_"
            for g in grads:
                text += c_text.element(op, stem + g, code, g, order)
            at = {n: f"{n}[c_]" if n.startswith("_bias_") else f"{n}[i_]" for n in ins + douts}
            values = [f"const float {g}_ = {c_text.call(stem + g, code, g, order, at)};"
                      for g in grads]
            stores = [f"{g}[i_] = {g}_;" for g in grads]
            # fuse.bias_variant: a bias's gradient is its input's, d_bias_x = dx
            sums = [f"{b}[c_] += {code.result(b)}_;" for b in biases]
            loop = (["  for (long long i_ = 0; i_ < n; ++i_) {",
                     *(f"    {line}" for line in values + stores), "  }"] if not fusion else
                    [*(f"  for (int c_ = 0; c_ < cols; ++c_) {b}[c_] = 0.0f;" for b in biases),
                     "  for (long long r_ = 0; r_ < rows; ++r_)",
                     "    for (int c_ = 0; c_ < cols; ++c_) {",
                     "      const long long i_ = r_ * cols + c_;",
                     *(f"      {line}" for line in values + stores + sums), "    }"])
            text += [c_text.opening(fn), *loop, "}", ""]
            fns.append(fn)
        about = (f"{op.name}: the backward of a pointwise op over every element; its bias "
                 "variant's, of x + b for inputs [rows, cols] and biases [cols].")
        return ir.RenderedC(c_text.source(header, about, text), tuple(fns))


KIND = Pointwise()


def _check_override(spec, f, derived) -> None:
    """An explicit backward must agree with the derived one on the op's domain."""
    names = [i.name for i in spec.inputs] + ["d" + o.name for o in spec.outputs]
    names += [p.name for p in spec.params]
    fn = compile_exprs([f.expr, derived], names)
    rng = np.random.default_rng(0)
    values = random_inputs(spec, names, rng, 64)
    got, want = (np.broadcast_to(v, (64,)) for v in fn(**values))
    err = np.max(np.abs(got - want) / np.maximum(np.abs(want), 1.0))
    if not err < spec.tolerance:
        raise f.where.error(f"explicit backward disagrees with the derived one "
                            f"(max relative error {err:.2e} > {spec.tolerance:g})")


class _Layout:
    """`eulergen check`'s inputs: 64 values an input (generator/gradcheck.Layout)."""

    def __init__(self, spec):
        self.spec = spec
        self.inputs = spec.inputs

    def random(self, rng):
        return [rng.uniform(*self.spec.domain_of(i.name), 64) for i in self.inputs]

    def out_shapes(self, values):
        return [values[0].shape] * len(self.spec.outputs)

    def central_differences(self, mod, values, douts):
        # Elementwise: perturbing every element at once gives every partial at once.
        out = []
        for n, _ in enumerate(self.inputs):
            def at(delta):
                shifted = [v + delta if k == n else v for k, v in enumerate(values)]
                return as_tuple(mod.forward(*shifted))
            plus, minus = at(EPS), at(-EPS)
            out.append(sum(d * (p - m) / (2 * EPS) for p, m, d in zip(plus, minus, douts)))
        return out

    def roundoff(self, mod, values, douts):
        return roundoff_floor(as_tuple(mod.forward(*values)))

    def sweep(self):
        """Batches of float inputs covering every combination of extremes (for up to two
        inputs; more inputs get each extreme in turn against the rest held at 1)."""
        k = len(self.inputs)
        if k <= 2:
            combos = np.array(list(itertools.product(EXTREMES, repeat=k))).T
        else:
            combos = np.ones((k, len(EXTREMES) * k))
            for n in range(k):
                combos[n, n * len(EXTREMES):(n + 1) * len(EXTREMES)] = EXTREMES
        return [list(combos)]


def _bias_stages(op: ir.DerivedOp) -> tuple[StagePlan, ...]:
    """The bias variant's stages: forward_bias and backward_bias over [rows, cols] operands
    and [cols] biases (plan.bias_launch), each an entry point for 16-byte access throughout
    and an `_unaligned` one for any; the backward's bias gradients as partial rows that
    reduce_bias sums in a fixed order."""
    body: ir.PointwiseDerived = op.body
    ins = [o.name for o in op.inputs]
    biases = tuple(o.name for o in op.inputs if o.role == "bias")
    outs = [o.name for o in op.outputs]
    grads = [f"d{o.name}" for o in op.inputs if f"d{o.name}" in body.backward.names]
    stages = [("forward", ins, outs, ())]
    if grads:
        partials = tuple(g for g in grads if g[1:] in biases)
        stages.append(("backward", ins + [f"d{o}" for o in outs],
                       [g for g in grads if g not in partials], partials))
    planned = []
    for call, loads, stores, partials in stages:
        label = variant_name(call, BIAS)
        args = {dt: pointers(dt, loads, stores)
                + tuple((f"{g}_partials", "float*") for g in partials)
                + floats(op) + (("rows", "long long"), ("cols", "int")) for dt in DTYPES}
        sigs = tuple(KernelSig(f"{op.name}_{label}{'' if aligned else '_unaligned'}_{dt}",
                               args[dt], dt, call, bias_launch(dt, call, aligned), fusion=BIAS)
                     for dt in DTYPES for aligned in (True, False))
        planned.append(StagePlan(f"{op.name}_{label}", label, tuple(loads), tuple(stores),
                                 sigs, biases, partials))
    if grads:
        planned.append(stage(op, "backward", ["partials"], ["dw"], reduce_args,
                             lambda dt: WGRAD_REDUCE_LAUNCH, part="reduce", fusion=BIAS))
    return tuple(planned)


def _gemv_stage(op: ir.DerivedOp) -> StagePlan | None:
    """The `gemv` variant, for an op that fuse.takes_gemv (else None): y = op(x·wᵀ + b) for
    up to each row bound of plan.GEMV_LAUNCHES, a kernel a bound and storage dtype (y in
    it), taking plan.gemv_args, then the op's params by their names; its impl the epilogue
    (the op's forward) that the gemv kernels' body applies."""
    if not fuse.takes_gemv(op):
        return None
    taken = {name for name, _ in gemv_args("f32")}
    clash = [p.name for p in op.params if p.name in taken]
    if clash:
        raise EulerError(f"param '{clash[0]}' is the name of an argument of the op's generated "
                         "gemv kernels (plan.gemv_args); rename it",
                         file=op.where.file, line=op.where.line, key=f"params.{clash[0]}")
    label = variant_name("forward", GEMV)
    name = f"{op.name}_{label}"
    return StagePlan(name, label, ("x", "w", "b"), ("y",), tuple(
        KernelSig(f"{name}_r{g.rows}_{dt}", gemv_args(dt) + floats(op), dt, "forward", g,
                  fusion=GEMV)
        for dt in DTYPES for g in GEMV_LAUNCHES))


def _numpy_pair(d: ir.DerivedOp, suffix: str) -> list[str]:
    """forward and backward of `d`, their names ending in `suffix`."""
    body: ir.PointwiseDerived = d.body
    ins = [o.name for o in d.inputs]
    douts = ["d" + o.name for o in d.outputs]
    out = [numpy_text.signature(f"forward{suffix}", ins, d.params, ("_out=None",)),
           *(f"    {a} = np.asarray({a})" for a in ins),
           f"    shape = np.broadcast_shapes({', '.join(a + '.shape' for a in ins)})",
           f"    dtype = _dtype({', '.join(ins)})",
           *numpy_text.body(numpy_text.code(body.forward)),
           numpy_text.returns([f"_fresh({o.name}, shape, dtype, _out, {n})"
                               for n, o in enumerate(d.outputs)]), "", ""]
    args = ins + douts
    grads = [f"_fresh(np.broadcast_to(d{o.name}, shape).reshape(-1, shape[-1]).sum(axis=0), "
             f"{o.name}.shape, dtype, _out, {n})" if o.role == "bias" else
             f"_fresh(d{o.name}, shape, dtype, _out, {n})" for n, o in enumerate(d.inputs)]
    out += [numpy_text.signature(f"backward{suffix}", args, d.params, ("_out=None",)),
            *(f"    {a} = np.asarray({a})" for a in args),
            f"    shape = np.broadcast_shapes({', '.join(a + '.shape' for a in args)})",
            f"    dtype = _dtype({', '.join(args)})",
            *numpy_text.body(numpy_text.code(body.backward)),
            numpy_text.returns(grads)]
    return out
