"""Rendering: a DerivedOp and its plan → the CUDA text of one op (`ir.RenderedCuda`).

The plan (generator/plan.py) has made every choice: the stages, their pointer operands, the
kernel signatures and their launch geometry. This module prints: it hands the templates
finished lines from the CUDA printer, the names each line reads (so a template declares only
the locals a formula uses), and the signatures, whose parameter lists the templates print.
"""
from __future__ import annotations

from dataclasses import dataclass

from eulergen.generator import fuse, ir, plan_ops
from eulergen.generator.plan import CTYPE, DTYPES
from eulergen.generator.emit import block, dtype_values, param_names, render_template
from eulergen.generator.hoist import hoist, row_constant_names
from eulergen.generator.render_attention import render_attention
from eulergen.generator.render_row import render_row
from eulergen.kinds import KINDS
from eulergen.signature import KernelSig, variant_name


def template_of(op: ir.DerivedOp) -> str:
    """The template file an op renders through, as headers and the manifest name it."""
    return f"templates/{KINDS[op.kind].template}"


@dataclass(frozen=True)
class Ptr:
    name: str
    const: str   # "const " or ""


def render_op(op: ir.DerivedOp, plan, header_line: str) -> ir.RenderedCuda:
    """The .cu text of one op, printed from its plan (plan_ops.plan_op), and the plan's kernel
    signatures (the manifest's `kernels`)."""
    if op.kind == "attention":   # prints its own header line
        return render_attention(op, plan)
    render = {"row": render_row, "pointwise": _pointwise, "pair": _pair, "update": _update}
    return render[op.kind](op, plan, header_line)


def _ptrs(loads, stores) -> list[Ptr]:
    return [Ptr(a, "const ") for a in loads] + [Ptr(a, "") for a in stores]


def _title(stage: str, loads, stores) -> str:
    return f"{stage}: {', '.join(stores)} from {', '.join(loads)}"


def _entries(st: plan_ops.StagePlan) -> list[dict]:
    """A stage's entry points, one a dtype: its signature and the C type it instantiates."""
    return [{"sig": sig, "ctype": CTYPE[sig.dtype]} for sig in st.sigs]


# ---- pointwise -----------------------------------------------------------------------

def _pointwise(op: ir.DerivedOp, plan: plan_ops.OpPlan, head: str) -> ir.RenderedCuda:
    body: ir.PointwiseDerived = op.body
    fused = fuse.bias_variant(op).body
    code = {"forward": body.forward, "backward": body.backward,
            variant_name("forward", "bias"): fused.forward,
            variant_name("backward", "bias"): fused.backward}

    def kernel(st: plan_ops.StagePlan) -> dict:
        return {"impl": st.name, "title": _title(st.label, st.loads, st.stores + st.partials),
                "loads": st.loads, "stores": st.stores, "ptrs": _ptrs(st.loads, st.stores),
                "code": block(code[st.label]), "entries": _entries(st), "biases": st.biases,
                "rows": [a for a in st.loads if a not in st.biases], "partials": st.partials}
    reduce = next((st for st in plan.bias if st.label == variant_name("reduce", "bias")), None)
    source = render_template(plan.template, header=head, op=op.name,
                             kernels=[kernel(st) for st in plan.stages],
                             bias_kernels=[kernel(st) for st in plan.bias if st is not reduce],
                             reduce=reduce and {"entries": _entries(reduce)},
                             params=param_names(op))
    return ir.RenderedCuda(source, plan.sigs)


# ---- pair ----------------------------------------------------------------------------

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
    values = lambda uses: [(n, plan_ops.PAIR_INDEX[r]) for n, r in index if n in uses]  # noqa: E731
    return {"impl": kernel, "stage": stage, "loads": loads, "stores": stores,
            "ptrs": _ptrs(loads, stores), "title": _title(stage, loads, stores),
            "table": table_b, "table_index": values(table_b.uses),
            "cached": [n for n in table_b.results if n in elem_b.uses],
            "code": elem_b, "elem_index": values(elem_b.uses),
            "elem_reads_k": any(r == "pair" for n, r in index if n in elem_b.uses)}


def _pair(op: ir.DerivedOp, plan: plan_ops.OpPlan, head: str) -> ir.RenderedCuda:
    body: ir.PairDerived = op.body
    code = {"forward": body.forward, "backward": body.backward}
    kernels = [dict(_pair_kernel(st.name, st.label, list(st.loads), list(st.stores),
                                 code[st.label], body.index), entries=_entries(st))
               for st in plan.stages]
    source = render_template(plan.template, header=head, op=op.name, kernels=kernels,
                             params=param_names(op),
                             table_pairs=plan.stages[0].sigs[0].geometry.table_pairs)
    return ir.RenderedCuda(source, plan.sigs)


# ---- update --------------------------------------------------------------------------

def _update(op: ir.DerivedOp, plan: plan_ops.OpPlan, head: str) -> ir.RenderedCuda:
    body: ir.UpdateDerived = op.body
    (st,) = plan.stages
    control, weight = st.sigs[0].control, plan_ops.update_weight(op)
    entries = [dict(e, impl_args=_update_impl_args(e["sig"], f"{weight}_bf16"))
               for e in _entries(st)]
    source = render_template(
        plan.template, header=head, op=op.name, operands=list(op.inputs),
        params=[p.name for p in op.params if p.default is not None], weight=weight,
        skip_slot=control.index("skip"), scale_slot=control.index("grad_scale"),
        runtime=[(n, i) for i, n in enumerate(control) if n not in KINDS["update"].control],
        code=block(body.step, declare=False), entries=entries)
    return ir.RenderedCuda(source, plan.sigs)


def _update_impl_args(sig: KernelSig, copy: str) -> str:
    """What an entry point passes its device impl: its parameters, with the weight's bf16
    copy (a null pointer where the entry point has none) between the operands and control."""
    names = [n for n, _ in sig.args if n != copy]
    at = names.index("control")
    return ", ".join(names[:at] + [copy if copy in dict(sig.args) else "nullptr"] + names[at:])


# ---- embedding (a template with no spec) ---------------------------------------------

def render_embedding(plan: plan_ops.EmbeddingPlan, header_line: str) -> ir.RenderedCuda:
    """Token/position embedding kernels, printed from plan_ops.plan_embedding();
    `{"kind": "embedding"}` in the manifest."""
    # a dtype's kernels as the template names them: forward, backward_sort, …
    dtypes = [dict(d, sigs={plan_ops.embedding_label(k.stage, k.part): k for k in plan.sigs
                            if k.dtype == d["name"]}) for d in dtype_values(DTYPES)]
    tile = plan.sig("sort").geometry.tile   # the geometry is alike in each dtype
    source = render_template(
        KINDS["embedding"].template, header=header_line, dtypes=dtypes, fetch=plan.fetch,
        tile=tile, tile_steps=tile.bit_length(), merge_group=plan.merge_group,
        merge_min_blocks=plan.merge_min_blocks, warp_rows=plan.warp_rows,
        long_run=plan.sig("wte_long").geometry.long_run,
        long_threads=plan.sig("wte_long").geometry.threads, long_rows=plan.long_rows)
    return ir.RenderedCuda(source, plan.sigs)
