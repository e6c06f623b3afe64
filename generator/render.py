"""Rendering: a DerivedOp and its KernelPlan → the CUDA text of one op (`ir.RenderedCuda`).

Templates hold the scheduling; this module hands them finished lines from the CUDA
printer, the names each line reads (so a template declares only the locals a formula
uses), and the argument lists that also become the manifest's kernel signatures.
"""
from __future__ import annotations

from dataclasses import dataclass

from eulergen.errors import EulerError
from eulergen.generator import ir, plan as planner
from eulergen.generator.emit import block, dtype_values, param_names, render_template
from eulergen.generator.hoist import hoist, row_constant_names
from eulergen.generator.render_attention import render_attention
from eulergen.generator.render_row import render_row


def template_of(op: ir.DerivedOp) -> str:
    """The template file an op renders through, as headers and the manifest name it."""
    if op.kind == "attention":
        return "templates/attention.cu.j2"
    return f"templates/{planner.plan_op(op).template}"


@dataclass(frozen=True)
class Ptr:
    name: str
    const: str   # "const " or ""


def _ctype(dt: str, const: bool, storage: str = "T") -> str:
    base = planner.CTYPE[dt] if storage == "T" else storage
    return f"{'const ' if const else ''}{base}*"


def render_op(op: ir.DerivedOp, header_line: str) -> ir.RenderedCuda:
    """The .cu text of one op and its kernel signatures (the manifest's `kernels`)."""
    if op.kind == "attention":
        return render_attention(op)
    p = planner.plan_op(op)
    if op.kind == "row":
        return render_row(op, p, header_line)
    render = {"pointwise": _pointwise, "pair": _pair, "update": _update}[op.kind]
    return render(op, p, header_line)


# ---- pointwise -----------------------------------------------------------------------

def _pointwise(op: ir.DerivedOp, p: planner.KernelPlan, head: str) -> ir.RenderedCuda:
    body: ir.PointwiseDerived = op.body
    ins = [o.name for o in op.inputs]
    outs = [o.name for o in op.outputs]
    fwd = block(body.forward)
    bwd = block(body.backward)
    grads = [f"d{o.name}" for o in op.inputs if o.differentiable]
    # The backward reads the inputs, any forward output it chose to reuse, and d<out>.
    bwd_reads = ins + [o for o in outs if o in bwd.uses] + [f"d{o}" for o in outs]
    kernels = [
        {"kernel": f"{op.name}_forward", "impl": f"{op.name}_forward", "stage": "forward",
         "title": f"forward: {', '.join(outs)} from {', '.join(ins)}",
         "loads": ins, "stores": outs, "code": fwd,
         "light": planner.arithmetic_light(body.forward)},
    ]
    if grads:
        kernels.append(
            {"kernel": f"{op.name}_backward", "impl": f"{op.name}_backward", "stage": "backward",
             "title": f"backward: {', '.join(grads)} from {', '.join(bwd_reads)}",
             "loads": bwd_reads, "stores": grads, "code": bwd,
             "light": planner.arithmetic_light(body.backward)})
    for k in kernels:
        k["ptrs"] = [Ptr(a, "const ") for a in k["loads"]] + [Ptr(a, "") for a in k["stores"]]
        k["geometry"] = {dt: planner.pointwise_launch(dt, len(k["loads"]), k["light"])
                         for dt in p.dtypes}
        k["tiles"] = {dt: (g.threads, g.unroll) for dt, g in k["geometry"].items()}
        k["min_blocks"] = {dt: g.min_blocks for dt, g in k["geometry"].items()}
    source = render_template(p.template, header=head, op=op.name, kernels=kernels,
                             params=param_names(op), dtypes=dtype_values(p.dtypes))
    sigs = []
    for k in kernels:
        for dt in p.dtypes:
            args = tuple((a.name, _ctype(dt, bool(a.const))) for a in k["ptrs"])
            args += tuple((q, "float") for q in param_names(op)) + (("n", "long long"),)
            sigs.append(ir.KernelSig(f"{k['kernel']}_{dt}", args, dt, k["stage"],
                                     k["geometry"][dt]))
    return ir.RenderedCuda(source, tuple(sigs))


# ---- pair ----------------------------------------------------------------------------

# What each index role is at a pair (b, t, h, k) of a [B, T, H, D] tensor.
_PAIR_INDEX = {"position": "t_ + pos0_", "pair": "k_", "head_dim": "D_", "head": "h_"}
# Roles that differ between the heads of one (token, k): what reads them is not tabled.
_PAIR_PER_HEAD = {"head"}


def _pair_kernel(kernel: str, stage: str, loads: list[str], stores: list[str], code: ir.Code,
                 index: tuple[tuple[str, str], ...]) -> dict:
    """One pair kernel's template values. The code is split (generator/hoist.py) into the
    per-(token, k) table (cos θ, sin θ: index symbols and params only), which a block
    computes once for all its heads, and the per-element code, which reads the table's
    `cached` names and the loaded operands."""
    varying = {f"{a}{i}" for a in loads for i in (0, 1)}
    varying |= {n for n, role in index if role in _PAIR_PER_HEAD}
    table, (elem,) = hoist([code], varying, row_constant_names("c"))
    table_b, elem_b = block(table), block(elem)
    values = lambda uses: [(n, _PAIR_INDEX[r]) for n, r in index if n in uses]  # noqa: E731
    return {"kernel": kernel, "impl": kernel, "stage": stage, "loads": loads, "stores": stores,
            "ptrs": [Ptr(a, "const ") for a in loads] + [Ptr(a, "") for a in stores],
            "title": f"{stage}: {', '.join(stores)} from {', '.join(loads)}",
            "table": table_b, "table_index": values(table_b.uses),
            "cached": [n for n in table_b.results if n in elem_b.uses],
            "code": elem_b, "elem_index": values(elem_b.uses),
            "elem_reads_k": any(r == "pair" for n, r in index if n in elem_b.uses)}


def _pair(op: ir.DerivedOp, p: planner.KernelPlan, head: str) -> ir.RenderedCuda:
    body: ir.PairDerived = op.body
    for o in op.inputs + op.outputs:
        if o.role != "pair":
            raise EulerError(f"pair op operand {o.name!r} has role {o.role!r} (only 'pair' "
                             "operands are supported)", file=op.where.file, line=op.where.line,
                             key="inputs")
    for name, role in body.index:
        if role not in _PAIR_INDEX:
            raise EulerError(f"index {name!r} has unknown role {role!r} (expected one of "
                             f"{', '.join(_PAIR_INDEX)})", file=op.where.file,
                             line=op.where.line, key="index")
    ins = [o.name for o in op.inputs]
    outs = [o.name for o in op.outputs]
    bwd_uses = block(body.backward).uses
    reads_pair = lambda names: [n for n in names if {f"{n}0", f"{n}1"} & bwd_uses]  # noqa: E731
    grads = [f"d{o.name}" for o in op.inputs if o.differentiable]
    kernels = [_pair_kernel(f"{op.name}_forward", "forward", ins, outs, body.forward, body.index)]
    if grads:
        kernels.append(_pair_kernel(f"{op.name}_backward", "backward",
                                    reads_pair(ins + outs) + [f"d{o}" for o in outs], grads,
                                    body.backward, body.index))
    source = render_template(p.template, header=head, op=op.name, kernels=kernels, params=param_names(op),
                             dtypes=dtype_values(p.dtypes), threads=planner.PAIR_THREADS, table_pairs=planner.PAIR_TABLE,
                             min_blocks=planner.PAIR_MIN_BLOCKS)
    sigs = []
    for k in kernels:
        for dt in p.dtypes:
            args: tuple = ()
            for a in k["ptrs"]:
                args += ((a.name, _ctype(dt, bool(a.const))), (f"{a.name}_sb", "long long"),
                         (f"{a.name}_st", "long long"), (f"{a.name}_sh", "long long"))
            args += tuple((q, "float") for q in param_names(op))
            args += (("B", "int"), ("T", "int"), ("H", "int"), ("D", "int"), ("pos0", "int"))
            sigs.append(ir.KernelSig(f"{k['kernel']}_{dt}", args, dt, k["stage"],
                                     planner.pair_launch(dt)))
    return ir.RenderedCuda(source, tuple(sigs))


# ---- update --------------------------------------------------------------------------

def _update(op: ir.DerivedOp, p: planner.KernelPlan, head: str) -> ir.RenderedCuda:
    body: ir.UpdateDerived = op.body
    for o in op.inputs:
        if o.role not in ("state", "grad"):
            raise EulerError(f"update op input {o.name!r} has role {o.role!r} (expected "
                             "'state' or 'grad')", file=op.where.file, line=op.where.line,
                             key="inputs")
    state = {o.name for o in op.inputs if o.role == "state"}
    code = block(body.step, declare=False)
    for r in code.results:
        if r not in state:
            raise EulerError(f"update result {r!r} is not a state input", file=op.where.file,
                             line=op.where.line, key=f"update.{r}")
    dtypes = [dict(d, vec=p.vec_of(d["name"])) for d in dtype_values(p.dtypes)]
    source = render_template(p.template, header=head, op=op.name, operands=list(op.inputs),
                             params=param_names(op), dtypes=dtypes, threads=planner.UPDATE_THREADS, code=code)
    sigs = []
    for dt in p.dtypes:
        args = tuple((o.name, _ctype(dt, True) if o.role == "grad" else "float*")
                     for o in op.inputs)
        args += tuple((q, "float") for q in param_names(op)) + (("n", "long long"),)
        sigs.append(ir.KernelSig(f"{op.name}_step_{dt}", args, dt, "step",
                                 planner.update_launch(dt)))
    return ir.RenderedCuda(source, tuple(sigs))


# ---- embedding (a template with no spec) ---------------------------------------------

def render_embedding(header_line: str) -> ir.RenderedCuda:
    """Token/position embedding kernels; `{"kind": "embedding"}` in the manifest."""
    dtypes = [{"name": d, "ctype": planner.CTYPE[d]} for d in planner.DTYPES]
    source = render_template("embedding.cu.j2", header=header_line, dtypes=dtypes,
                             threads=planner.EMBEDDING_THREADS,
                             fetch=planner.EMBEDDING_FETCH,
                             sort_threads=planner.EMBEDDING_SORT_THREADS,
                             tile=planner.EMBEDDING_TILE,
                             tile_steps=planner.EMBEDDING_TILE.bit_length(),
                             merge_group=planner.EMBEDDING_MERGE_GROUP,
                             merge_min_blocks=planner.EMBEDDING_MERGE_MIN_BLOCKS,
                             wte_threads=planner.EMBEDDING_WTE_THREADS,
                             warp_rows=planner.EMBEDDING_WTE_WARP_ROWS,
                             long_run=planner.EMBEDDING_LONG_RUN,
                             long_threads=planner.EMBEDDING_LONG_THREADS,
                             long_rows=planner.EMBEDDING_LONG_ROWS)
    sigs = []
    for dt in planner.DTYPES:
        c = planner.CTYPE[dt]
        stages = (
            ("forward", (("ids", "const int*"), ("wte", f"const {c}*"), ("wpe", f"const {c}*"),
                         ("out", f"{c}*"), ("BT", "long long"), ("T", "int"), ("C", "int"),
                         ("V", "int"))),
            ("backward_sort", (("ids", "const int*"), ("tiled", "long long*"),
                               ("first", "int*"), ("runs", "int*"), ("n", "int"), ("V", "int"))),
            ("backward_merge", (("tiled", "const long long*"), ("keys", "long long*"),
                                ("first", "int*"), ("n", "int"))),
            ("backward_wte", (("dout", f"const {c}*"), ("keys", "const long long*"),
                              ("first", "const int*"), ("runs", "int*"), ("dwte", f"{c}*"),
                              ("n", "int"), ("V", "int"), ("C", "int"), ("vec", "int"),
                              ("accumulate", "int"))),
            ("backward_wte_long", (("dout", f"const {c}*"), ("keys", "const long long*"),
                                   ("first", "const int*"), ("runs", "const int*"),
                                   ("dwte", f"{c}*"), ("n", "int"), ("C", "int"), ("vec", "int"),
                                   ("accumulate", "int"))),
            ("backward_wpe", (("dout", f"const {c}*"), ("dwpe", f"{c}*"), ("B", "int"),
                              ("T", "int"), ("C", "int"), ("accumulate", "int"))),
        )
        sigs += [ir.KernelSig(f"embedding_{stage}_{dt}", args, dt, stage,
                              planner.embedding_launch(stage, dt)) for stage, args in stages]
    return ir.RenderedCuda(source, tuple(sigs))
