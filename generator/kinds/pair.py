"""Pair ops: indexed pointwise over pairs (RoPE). Over a [B, T, H, D] operand, element k
pairs with k + D/2: input x gives the symbols x0 and x1, each output y the two formulas
[y0, y1]; index symbols name the position, the pair index, the head dim (and the head) by
role. The backward is the transpose of the local Jacobian. A kernel a stage loops over the
tokens and tables what does not vary over the heads (templates/pair.cu.j2)."""
from __future__ import annotations

import numpy as np

from eulergen.errors import EulerError, suggest
from eulergen.generator import c_text, formula, ir, numpy_text
from eulergen.generator.differentiate import jvp
from eulergen.generator.emit import block, param_names
from eulergen.generator.gradcheck import EXTREMES, check_gradients, each_element, loss_roundoff
from eulergen.generator.hoist import hoist, row_constant_names
from eulergen.generator.kinds.base import OpKind
from eulergen.generator.opspec import Formula, identifier, role_inputs, symbol
from eulergen.generator.plan import pair_launch
from eulergen.generator.stage_plan import OpPlan, entries, floats, pointers, ptrs, stage, title
from eulergen.signature import CFunction

# What each index role is at a pair (b, t, h, k) of a [B, T, H, D] tensor, as
# templates/pair.cu.j2 names it, and in the numpy module.
INDEX = {"position": "t_ + pos0_", "pair": "k_", "head_dim": "D_", "head": "h_"}
_NUMPY_INDEX = {"position": "(pos0 + np.arange(shape[1])).reshape(1, -1, 1, 1)",
                "head": "np.arange(shape[2]).reshape(1, 1, -1, 1)",
                "pair": "np.arange(half)",
                "head_dim": "shape[-1]"}
# ... and in the C function's loops (generator/c_text.py)
_C_INDEX = {"position": "(float)(t_ + pos0)", "pair": "(float)k_", "head_dim": "(float)D",
            "head": "(float)h_"}
# Roles that differ between the heads of one (token, k): what reads them is not tabled.
_PER_HEAD = {"head"}


class Pair(OpKind):
    name = "pair"
    template = templates = "pair.cu.j2"
    keys = frozenset({"inputs", "index", "outputs", "kink"})
    required = ("inputs", "index", "outputs")

    def read_operands(self, doc, data, names):
        def declare(name):   # x0 = x[..., k], x1 = x[..., k + D/2]
            identifier(doc, name, "inputs", name)
            names.add(name + "0", None, "inputs", name)
            names.add(name + "1", None, "inputs", name)
        return {"inputs": role_inputs(doc, data, self.name, ("pair",), names, declare),
                "index": _index(doc, data, names)}

    def read_formulas(self, doc, data, names, fields):
        out = []
        for name, pair in doc.mapping(data.get("outputs"), "outputs").items():
            identifier(doc, name, "outputs", name)
            if not isinstance(pair, list) or len(pair) != 2:
                raise doc.error("a pair output is [first, second]: the values at k and k + D/2",
                                "outputs", name)
            for n, text in enumerate(pair):
                where = doc.where("outputs", name, n)
                out.append(Formula(f"{name}{n}", formula.parse(text, names.table, where), where))
        return {"outputs": tuple(out)}

    def derive(self, spec, temps):
        forward = temps.code([(o.name, o.expr) for o in spec.outputs])
        grads = []
        for i in spec.inputs:
            for half in "01":
                grads.append((f"d{i.name}{half}", jvp(spec, spec.outputs, symbol(i.name + half))))
        backward = temps.code(grads)
        out_names = dict.fromkeys(o.name[:-1] for o in spec.outputs)
        inputs = tuple(ir.Operand(i.name, "pair") for i in spec.inputs)
        outputs = tuple(ir.Operand(n, "pair") for n in out_names)
        return (ir.PairDerived(index=spec.index, forward=forward, backward=backward), inputs,
                outputs)

    def check(self, spec, derived, mod):
        return check_gradients(spec, mod, _Layout(spec))

    def manifest(self, op):
        return {"index": dict(op.body.index)}   # index symbol -> role: does it vary over heads

    def plan(self, op) -> OpPlan:
        body: ir.PairDerived = op.body
        for o in op.inputs + op.outputs:
            if o.role != "pair":
                raise EulerError(f"pair op operand {o.name!r} has role {o.role!r} (only 'pair' "
                                 "operands are supported)", file=op.where.file,
                                 line=op.where.line, key="inputs")
        for name, role in body.index:
            if role not in INDEX:
                raise EulerError(f"index {name!r} has unknown role {role!r} (expected one of "
                                 f"{', '.join(INDEX)})", file=op.where.file,
                                 line=op.where.line, key="index")
        ins = [o.name for o in op.inputs]
        outs = [o.name for o in op.outputs]
        uses = body.backward.uses
        reads = [n for n in ins + outs if {f"{n}0", f"{n}1"} & uses] + [f"d{o}" for o in outs]
        grads = [f"d{o.name}" for o in op.inputs if o.differentiable]

        def args(loads, stores):
            def of(dt):
                strided = ()
                for name, ctype in pointers(dt, loads, stores):
                    strided += ((name, ctype), (f"{name}_sb", "long long"),
                                (f"{name}_st", "long long"), (f"{name}_sh", "long long"))
                return strided + floats(op) + tuple((n, "int") for n in ("B", "T", "H", "D", "pos0"))
            return of
        stages = [stage(op, "forward", ins, outs, args(ins, outs), pair_launch)]
        if grads:
            stages.append(stage(op, "backward", reads, grads, args(reads, grads), pair_launch))
        return OpPlan(tuple(stages))

    def render(self, op, plan: OpPlan, header):
        body: ir.PairDerived = op.body
        code = {"forward": body.forward, "backward": body.backward}
        kernels = [dict(kernel_values(st.name, st.label, list(st.loads), list(st.stores),
                                      code[st.label], body.index), entries=entries(st))
                   for st in plan.stages]
        source = self.render_template(header=header, op=op.name, kernels=kernels,
                                      params=param_names(op),
                                      table_pairs=plan.stages[0].sigs[0].geometry.table_pairs)
        return ir.RenderedCuda(source, plan.sigs)

    def numpy_source(self, op):
        body: ir.PairDerived = op.body
        ins = [o.name for o in op.inputs]
        outs = [o.name for o in op.outputs]
        # pos0: the position of the first row (KV-cache decoding), as the CUDA kernels take it
        functions = [numpy_text.signature("forward", ins, op.params, ("pos0=0", "_out=None")),
                     *_prologue(op, ins), *numpy_text.code(body.forward), *_results(outs), "", ""]
        args = ins + ["d" + n for n in outs]
        functions += [numpy_text.signature("backward", args, op.params, ("pos0=0", "_out=None")),
                      *_prologue(op, args), *numpy_text.code(body.backward),
                      *_results(["d" + n for n in ins])]
        return numpy_text.module(op, functions, support=(numpy_text.DTYPE, numpy_text.INTO))

    def c_source(self, op, header):
        """forward over [B, T, H, D] operands given by (batch, token, head) strides, as the
        CUDA kernels take them; y may be x."""
        ins = [o.name for o in op.inputs]
        text, fn = _c_stage(op, "forward", op.body.forward, ins, [o.name for o in op.outputs])
        about = (f"{op.name}: pairs (k, k + D/2) of the last axis of [B, T, H, D] operands; "
                 "the position is the token's index plus pos0 (the first row's, KV-cache "
                 "decoding).")
        return ir.RenderedC(c_text.source(header, about, text), (fn,))

    def c_train_source(self, op, header):
        """backward, as the CUDA kernels take it: the operands its code reads, then the
        d<outputs>, into the d<inputs>; dx may be dy (rope in place)."""
        body: ir.PairDerived = op.body
        reads = [n for n in [o.name for o in op.inputs + op.outputs]
                 if {f"{n}0", f"{n}1"} & body.backward.uses]
        text, fn = _c_stage(op, "backward", body.backward,
                            reads + [f"d{o.name}" for o in op.outputs],
                            [f"d{o.name}" for o in op.inputs if o.differentiable])
        about = (f"{op.name}: the backward of pairs (k, k + D/2) of the last axis of "
                 "[B, T, H, D] operands, the transpose of their rotation; the position is the "
                 "token's index plus pos0.")
        return ir.RenderedC(c_text.source(header, about, text), (fn,))


KIND = Pair()


def _c_stage(op: ir.DerivedOp, stage: str, code: ir.Code, ins: list[str],
             outs: list[str]) -> tuple[list[str], CFunction]:
    """One stage's element functions (a half of an output each) and its C function, which
    loops over (b, t, h) and the pairs k; every half is computed before any is stored."""
    body: ir.PairDerived = op.body

    def strided(names, ctype):
        return tuple(a for n in names for a in ((n, ctype), (f"{n}_sb", "long long"),
                                                (f"{n}_st", "long long"),
                                                (f"{n}_sh", "long long")))
    fn = CFunction(f"{op.name}_{stage}", strided(ins, "const float*")
                   + strided(outs, "float*") + c_text.floats(op)
                   + tuple((n, "int") for n in ("B", "T", "H", "D", "pos0")), stage)
    halves = [f"{n}{h}" for n in outs for h in "01"]
    order = [f"{n}{h}" for n in ins for h in "01"] + [n for n, _ in body.index]
    order += [p.name for p in op.params]
    at = {f"{n}{h}": f"{n}_at_[k_{' + half_' if h == '1' else ''}]" for n in ins for h in "01"}
    at |= {n: _C_INDEX[role] for n, role in body.index}
    text = [line for y in halves
            for line in c_text.element(op, f"{op.name}_{y}", code, y, order)]
    text += [c_text.opening(fn), "  const int half_ = D / 2;",
             "  for (int b_ = 0; b_ < B; ++b_)", "    for (int t_ = 0; t_ < T; ++t_)",
             "      for (int h_ = 0; h_ < H; ++h_) {",
             *(f"        {'const ' if n in ins else ''}float* {n}_at_ = {n} + b_ * {n}_sb"
               f" + t_ * {n}_st + h_ * {n}_sh;" for n in ins + outs),
             "        for (int k_ = 0; k_ < half_; ++k_) {",
             *(f"          const float {y}_ = {c_text.call(f'{op.name}_{y}', code, y, order, at)};"
               for y in halves),
             *(f"          {y[:-1]}_at_[k_{' + half_' if y[-1] == '1' else ''}] = {y}_;"
               for y in halves),
             "        }", "      }", "}", ""]
    return text, fn


def _index(doc, data: dict, names) -> tuple[tuple[str, str], ...]:
    out = []
    for name, role in doc.mapping(data.get("index"), "index").items():
        if role not in INDEX:
            raise doc.error(f"unknown index role {role!r} (expected one of "
                            f"{', '.join(INDEX)}){suggest(str(role), INDEX)}", "index", name)
        names.add(name, None, "index", name)
        out.append((name, role))
    roles = [r for _, r in out]
    for needed in ("pair", "head_dim"):
        if needed not in roles:
            raise doc.error(f"a pair op needs an index symbol with role '{needed}'", "index")
    if len(set(roles)) != len(roles):
        raise doc.error("each index role may be given once", "index")
    return tuple(out)


class _Layout:
    """`eulergen check`'s inputs: [1, 3, 2, 4] (generator/gradcheck.Layout)."""
    SHAPE = (1, 3, 2, 4)

    def __init__(self, spec):
        self.spec = spec
        self.inputs = spec.inputs

    def random(self, rng):
        return [rng.uniform(*self.spec.domain_of(i.name), self.SHAPE) for i in self.inputs]

    def out_shapes(self, values):
        names = dict.fromkeys(o.name[:-1] for o in self.spec.outputs)
        return [self.SHAPE] * len(names)

    def central_differences(self, mod, values, douts):
        return each_element(mod, values, douts, [True] * len(self.inputs))

    def roundoff(self, mod, values, douts):
        return loss_roundoff(mod, values, douts)

    def sweep(self):
        x = np.resize(np.array(EXTREMES), 5 * 2 * 8).reshape(1, 5, 2, 8)
        return [[x for _ in self.inputs]]


def kernel_values(kernel: str, label: str, loads: list[str], stores: list[str], code: ir.Code,
                  index: tuple[tuple[str, str], ...]) -> dict:
    """One pair kernel's template values. The code is split (generator/hoist.py) into the
    per-(token, k) table (cos θ, sin θ: index symbols and params only), which a block
    computes once for all its heads, and the per-element code, which reads the table's
    `cached` names and the loaded operands."""
    varying = {f"{a}{i}" for a in loads for i in (0, 1)}
    varying |= {n for n, role in index if role in _PER_HEAD}
    table, (elem,) = hoist([code], varying, row_constant_names("c"))
    table_b, elem_b = block(table), block(elem)
    values = lambda uses: [(n, INDEX[r]) for n, r in index if n in uses]  # noqa: E731
    return {"impl": kernel, "stage": label, "loads": loads, "stores": stores,
            "ptrs": ptrs(loads, stores), "title": title(label, loads, stores),
            "table": table_b, "table_index": values(table_b.uses),
            "cached": [n for n in table_b.results if n in elem_b.uses],
            "code": elem_b, "elem_index": values(elem_b.uses),
            "elem_reads_k": any(r == "pair" for n, r in index if n in elem_b.uses)}


def _prologue(d: ir.DerivedOp, arrays: list[str]) -> list[str]:
    body: ir.PairDerived = d.body
    lines = [f"    {a} = np.asarray({a})" for a in arrays]
    lines += [f"    shape = {arrays[0]}.shape",
              "    if len(shape) != 4 or shape[-1] % 2:",
              "        raise ValueError(f'expected [B, T, H, D] with D even, got {shape}')",
              "    half = shape[-1] // 2",
              f"    dtype = _dtype({', '.join(arrays)})"]
    lines += [f"    {a}0, {a}1 = {a}[..., :half], {a}[..., half:]" for a in arrays]
    lines += [f"    {name} = {_NUMPY_INDEX[role]}" for name, role in body.index]
    return lines


def _results(names: list[str]) -> list[str]:
    """Each result from its halves, into its array of `out` or a new one (both halves are
    computed before either is written: out may be the input, rope in place)."""
    lines = []
    for k, n in enumerate(names):
        lines += [f"    {n} = _into(_out, {k}, shape, dtype)",
                  f"    {n}[..., :half] = {n}0",
                  f"    {n}[..., half:] = {n}1"]
    return lines + [numpy_text.returns(names)]
