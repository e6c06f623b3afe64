"""Rendering of row ops (templates/row.cu.j2): the stages' steps (reduction sweeps, picked
columns, per-row and per-element code), their pointers and kernel signatures.

Each stage forms the reductions its later steps read: one sweep per level, a sum that
rescales with a stabilizer max in the max's sweep (ir.Online; block-per-row kernels only,
warp-per-row ones keep the two-pass form, so a stage where one joins has a second device
impl, `<op>_<stage>_online`), a sum that is one column's value read at that column
(ir.Pick), and the backward's adjoint sums in the sweep after the last one forming a
reduction they read (derive has taken their row-constant factors out). Each kernel's
block, register slots, prefetch, batch and whole groups are the plan's (plan.RowShape).
"""
from __future__ import annotations

from dataclasses import dataclass

from eulergen.errors import EulerError
from eulergen.generator import ir, plan as planner
from eulergen.generator.hoist import hoist, row_constant_names
from eulergen.generator.printer import cuda_expr
from eulergen.generator.emit import Block, block, dtype_values, param_names, render_template


@dataclass(frozen=True)
class RowPtr:
    name: str
    ctype: str                        # in the template body (over scalar_t)
    ctypes: dict                      # dtype -> C type at the extern "C" boundary
    role: str                         # 'row' (chunked), 'weight', 'scalar', 'partials'


def _row_ptr(name: str, role: str, *, const: bool, storage: str = "T") -> RowPtr:
    c = "const " if const else ""
    if storage == "T":
        return RowPtr(name, f"{c}scalar_t*", {d: f"{c}{planner.CTYPE[d]}*" for d in planner.DTYPES},
                      role)
    return RowPtr(name, f"{c}{storage}*", {d: f"{c}{storage}*" for d in planner.DTYPES}, role)


def _uses(*blocks) -> frozenset[str]:
    out: set[str] = set()
    for b in blocks:
        if b is not None:
            out |= b.uses
    return frozenset(out)


def render_row(op: ir.DerivedOp, p: planner.KernelPlan, head: str) -> ir.RenderedCuda:
    body: ir.RowDerived = op.body
    where = dict(file=op.where.file, line=op.where.line)
    by_role = lambda ops, role: [o for o in ops if o.role == role]  # noqa: E731
    rows_in = [o.name for o in by_role(op.inputs, "row")]
    weights = [o.name for o in by_role(op.inputs, "weight")]
    index = [o.name for o in by_role(op.inputs, "index")]
    elem_out = [o.name for o in by_role(op.outputs, "row")]
    row_out = [o.name for o in by_role(op.outputs, "scalar")]
    d_elem_out = [f"d{o}" for o in elem_out]
    d_row_out = [f"d{o}" for o in row_out]
    d_rows = [f"d{o.name}" for o in by_role(op.inputs, "row") if o.differentiable]
    d_weights = [f"d{o.name}" for o in by_role(op.inputs, "weight") if o.differentiable]
    for o in op.inputs + op.outputs:
        if o.role not in ("row", "weight", "index", "scalar"):
            raise EulerError(f"row op operand {o.name!r} has role {o.role!r}", key="inputs", **where)

    row_outputs = block(body.row_outputs, declare=False)
    # Per-element steps compute their row-invariant parts once per row, before the sweep
    # (generator/hoist.py); `consts` is that code, its names unique in the op.
    varying = set(rows_in + d_elem_out + weights) | {"i"}
    const_names = row_constant_names()

    def sweep_step(kind: str, code: ir.Code, with_outputs: bool,
                   online: tuple[ir.Online, ...] = (), **extra) -> dict:
        """A pass or an element step; with_outputs: the element outputs are recomputed
        first (`pre`), for code that reads them. `online`: sums a pass accumulates against
        its running max, which varies along the row like an element."""
        first = [body.elem_outputs, code] if with_outputs else [code]
        maxes = list(dict.fromkeys(o.max for o in online))
        consts, hoisted = hoist(first + [o.term for o in online], varying | set(maxes),
                                const_names)
        blocks = [block(c) for c in hoisted]
        pre, b = (blocks[0], blocks[1]) if with_outputs else (None, blocks[0])
        terms = blocks[len(first):]
        c = block(consts) if consts.results else None
        joined = [{"name": o.name, "red": o.op, "max": o.max, "block": t,
                   "factor": cuda_expr(o.factor)} for o, t in zip(online, terms)]
        factor_uses = {s.name for o in online for s in o.factor.free_symbols}
        factor_uses -= {ir.RESCALE_FROM, ir.RESCALE_TO}
        online_uses = _uses(*terms)
        return {"kind": kind, "block": b, "pre": pre, "consts": c, "online": joined,
                "maxes": maxes, "online_uses": online_uses,
                "uses": _uses(b, pre, c) | online_uses | factor_uses, **extra}

    def reads_outputs(code: ir.Code) -> bool:
        return bool(block(code).uses & set(elem_out))

    def pass_step(ps: ir.Pass, online: tuple[ir.Online, ...] = ()) -> dict:
        return sweep_step("pass", ps.body, reads_outputs(ps.body), online,
                          ops=[list(o) for o in ps.ops], stores=[], wgrads=[])

    def pick_step(pk: ir.Pick) -> dict:
        b = block(pk.value, declare=False)
        return {"kind": "pick", "block": b, "index": pk.index, "uses": b.uses | {pk.index}}

    # A stage computes the reductions its later steps read (and what those read): a pick
    # (ir.Pick) from its one column, the others one sweep per level, except that an online
    # sum (ir.Online) joins its max's sweep: one sweep fewer where it was its level's only
    # reduction.
    # Online sums join only in the block-per-row kernels, whose rows are re-read from memory
    # each sweep; a warp-per-row kernel holds its row in registers, where a second sweep
    # costs no traffic and the two-pass form ran faster (H200, softmax bf16 262144 x 768:
    # forward 0.235 ms two-pass, 0.254 online).
    def reductions(later: list[dict], online: bool) -> list[dict]:
        """The sweeps (and picks) that form what `later` reads, the adjoint sums (when read)
        among them: in the sweep after the last one forming a reduction they read (the
        first sweep if they read none), or a sweep of their own after all of them."""
        moved = {pk.name for pk in body.picks} | ({o.name for o in body.online} if online else set())
        need = set().union(*(s["uses"] for s in later))
        adj = body.adjoint_pass
        adj = adj if adj is not None and {n for n, _ in adj.ops} & need else None
        adj_step = pass_step(adj) if adj is not None else None
        adj_reads = adj_step["uses"] if adj_step else set()
        need |= adj_reads
        passes: list[tuple[ir.Pass, tuple[ir.Online, ...]]] = []
        steps: list[dict] = []               # pass_step of each of `passes`
        for ps in reversed(body.passes):
            own = {n for n, _ in ps.ops}
            joined = tuple(o for o in body.online
                           if online and o.max in own and o.name in need)
            need |= {o.max for o in joined}
            plain = tuple(o for o in ps.ops if o[0] in need and o[0] not in moved)
            if plain:
                passes.insert(0, (ir.Pass(plain, ps.body.only({n for n, _ in plain})), joined))
                steps.insert(0, pass_step(*passes[0]))
                need |= steps[0]["uses"]
        if adj is not None:
            formed = [{n for n, _ in ps.ops} | {o.name for o in joined} for ps, joined in passes]
            at = max((i + 1 for i, names in enumerate(formed) if names & adj_reads), default=0)
            if at < len(passes):
                ps, joined = passes[at]
                steps[at] = pass_step(ir.Pass(ps.ops + adj.ops,
                                              ir.Code(ps.body.temps + adj.body.temps,
                                                      ps.body.results + adj.body.results)),
                                      joined)
            else:
                steps.append(adj_step)
        return [pick_step(pk) for pk in body.picks if pk.name in need] + steps

    def row_step(b: Block, stores: list[str]) -> dict:
        return {"kind": "row", "block": b, "stores": stores, "uses": b.uses}

    def elem_step(code: ir.Code, stores: list[str], wgrads: list[str], outputs: bool = False) -> dict:
        return sweep_step("elem", code, not outputs and reads_outputs(code), stores=stores,
                          wgrads=wgrads)

    grads = body.elem_grads
    adjoints = block(body.adjoints, declare=False)
    # The backward's adjoint sums (body.adjoint_pass) are placed by `reductions`: in the
    # sweep after the last one forming a reduction they read (log-softmax's Σ dy and
    # RMSNorm's Σ dy·w·x read none: the row's first sweep; LayerNorm's Σ dy·w·(x - mu) reads
    # mu: var's sweep), one sweep fewer than a sweep of their own, which they take only
    # where that last one is the stage's last (softmax's online backward: after m's).
    grad_steps = [row_step(adjoints, []),
                  elem_step(grads, [g for g in grads.names if g in d_rows],
                            [g for g in grads.names if g in d_weights])]
    adjoint_sums = block(body.adjoint_pass.body) if body.adjoint_pass else None
    needs_row_out = _uses(adjoint_sums, *(s["block"] for s in grad_steps),
                          *(s.get("consts") for s in grad_steps)) & set(row_out)

    forward = (([row_step(row_outputs, row_out)] if row_out else [])
               + ([elem_step(body.elem_outputs, elem_out, [], outputs=True)] if elem_out else []))
    # The split backward's column kernel: the weight-gradient terms alone, row-invariant
    # parts hoisted; the per-row values they read (`stats`) come from backward_rows.
    wgrad_step = elem_step(grads.only(set(d_weights)), [], d_weights) if d_weights else None
    per_elem = set(rows_in + d_elem_out + weights) | {"i", "N"} | set(param_names(op))
    stats: list[str] = []
    if wgrad_step:
        local = set(wgrad_step["consts"].results if wgrad_step["consts"] else ())
        local |= set(wgrad_step["pre"].results if wgrad_step["pre"] else ())
        stats = sorted(wgrad_step["uses"] - local - per_elem)

    stages = [("forward", forward, rows_in + weights + index, elem_out + row_out, [])]
    if d_rows or d_weights:
        backward = ([row_step(row_outputs, [])] if needs_row_out else []) + grad_steps
        stages.append(("backward", backward,
                       rows_in + weights + index + d_elem_out + d_row_out, d_rows, d_weights))
        if p.fwdbwd:
            fused = [row_step(row_outputs, row_out)] + grad_steps
            stages.append(("fwdbwd", fused,
                           rows_in + weights + index + d_row_out, row_out + d_rows, d_weights))
        if d_weights:
            # The split backward of long rows (plan.WGRAD_SPLIT_COLS): a block per row writes
            # the input grads and the per-row values the weight-gradient terms read (so the
            # row forms those too); a column kernel sums those terms over rows (wgrad_cols).
            rows_elem = elem_step(grads.only(set(d_rows)), grad_steps[1]["stores"], [])
            rows_elem["uses"] = rows_elem["uses"] | set(stats)
            split_rows = (([row_step(row_outputs, [])] if needs_row_out else [])
                          + [grad_steps[0], rows_elem])
            stages.append(("backward_rows", split_rows,
                           rows_in + weights + index + d_elem_out + d_row_out, d_rows, []))

    # A block_held kernel holds its row in registers, as a warp does: it takes the two-pass
    # impl too (generator/plan.py, HELD_SLOTS).
    layouts = [{"suffix": "", "warp": "true", "layout": "warp_per_row"},
               {"suffix": "_held", "warp": "false", "layout": "block_held"},
               {"suffix": "_block", "warp": "false", "layout": "block_per_row"}]

    def variants(later: list[dict]) -> list[tuple[str, list[dict], list[dict]]]:
        """(impl suffix, steps, the layouts it serves): the two-pass impl for every layout,
        unless an online sum joins one of the stage's sweeps; then block_per_row has its own
        `_online` impl."""
        two_pass = reductions(later, False) + later
        online = reductions(later, True) + later
        if any(s.get("online") for s in online):
            return [("", two_pass, layouts[:2]), ("_online", online, layouts[2:])]
        return [("", two_pass, layouts)]

    kernels = []
    chunked = set(rows_in + d_elem_out + elem_out + d_rows)
    for (stage, later, reads, writes, wgrads), (suffix, steps, lays) in (
            (st, v) for st in stages for v in variants(st[1])):
        if stage == "backward_rows":   # long rows only
            lays = [lay for lay in lays if lay["layout"] == "block_per_row"]
        uses = frozenset().union(*(s["uses"] for s in steps))
        levels = sum(s["kind"] == "pass" for s in steps)
        ptrs = []
        for name in reads:
            role = ("row" if name in chunked else "weight" if name in weights
                    else "scalar")
            storage = "int" if name in index else "float" if name in d_row_out else "T"
            ptrs.append(_row_ptr(name, role, const=True, storage=storage))
        for name in writes:
            ptrs.append(_row_ptr(name, "row" if name in chunked else "scalar", const=False,
                                 storage="float" if name in row_out else "T"))
        for name in wgrads:
            ptrs.append(_row_ptr(f"{name}_partials", "partials", const=False, storage="float"))
        row_stats = stats if stage == "backward_rows" else []
        if row_stats:
            ptrs.append(_row_ptr("rowstats", "stats", const=False, storage="float"))
        defined = set(param_names(op)) | {"i", "N"}
        for s in steps:
            defined |= set(s["block"].results) | {n for n, _ in s.get("ops", [])}
            defined |= {o["name"] for o in s.get("online", [])}
            if s.get("consts"):
                defined |= set(s["consts"].results)
            if s.get("pre"):
                defined |= set(s["pre"].results)
        missing = sorted((uses | set(row_stats)) - defined - set(reads))
        if missing:
            raise EulerError(f"{stage} reads {', '.join(missing)}, which no kernel argument or "
                             "earlier step provides", key="outputs", **where)
        cached = [a.name for a in ptrs if a.role == "row" and a.name in reads and a.name in uses]
        row_scalars = []
        for a in ptrs:
            if a.role == "scalar" and a.name in uses and a.name in reads:
                load = (f"(float){a.name}_ptr[row_]" if a.name in index
                        else f"eg_load({a.name}_ptr, row_)")
                row_scalars.append({"name": a.name, "load": load})
        shapes = {
            "warp_per_row": {dt: planner.warp_shape(dt, stage=stage, wgrad=bool(wgrads),
                                                    levels=levels) for dt in planner.DTYPES},
            "block_held": {dt: planner.held_shape(dt, stage=stage, wgrad=bool(wgrads))
                           for dt in planner.DTYPES},
            "block_per_row": {dt: planner.block_shape(
                dt, stage=stage, sweeps=sum(s["kind"] in ("pass", "elem") for s in steps),
                cached=len(cached), weights=bool(weights), wgrad=bool(wgrads))
                for dt in planner.DTYPES}}
        kernels.append({
            "kernel": f"{op.name}_{stage}", "impl": f"{op.name}_{stage}{suffix}", "stage": stage,
            "layouts": lays,
            "title": f"{stage}: {', '.join(writes + wgrads)} from {', '.join(reads)}",
            "ptrs": ptrs, "steps": steps, "wgrads": wgrads,
            "row_ptrs": [a for a in ptrs if a.role == "row"
                         and (a.name not in reads or a.name in uses)],
            "row_vec_ptrs": [a.name for a in ptrs if a.role == "row"],
            "weight_ptrs": [a.name for a in ptrs if a.role == "weight"],
            "split_ptr": next(a.name for a in ptrs if a.role == "row"),
            "cached": cached,
            "row_scalars": row_scalars, "uses_n": "N" in uses, "uses": uses,
            # a layout serves the dtypes it has a shape for (block_held: HELD_SLOTS')
            "shapes": shapes,
            # a first sweep that some shape batches is rendered both ways (row.cu.j2, sweep)
            "batched": any(sh.batch > 1 for lay in lays
                           for sh in shapes[lay["layout"]].values() if sh),
            # and one that some shape sweeps whole, both ways too (WHOLE picks)
            "whole": any(sh.whole for lay in lays
                         for sh in shapes[lay["layout"]].values() if sh),
            "max_reductions": max((len(s["ops"]) + len(s["online"]) for s in steps
                                   if s["kind"] == "pass"), default=0),
            "row_stats": row_stats,
            "split_cols": {dt: planner.wgrad_split_cols(dt, levels)
                           if stage == "backward_rows" else 0 for dt in planner.DTYPES},
        })
    wgrad = any(k["wgrads"] for k in kernels)
    split = None
    if wgrad_step:
        operands = [a for a in rows_in + d_elem_out if a in wgrad_step["uses"]]
        used_weights = [w for w in weights if w in wgrad_step["uses"]]
        split = {"step": wgrad_step, "stats": stats, "operands": operands,
                 "weights": used_weights, "wgrads": d_weights,
                 "ptrs": ([_row_ptr(a, "row", const=True) for a in operands + used_weights]
                          + [_row_ptr("rowstats", "stats", const=True, storage="float")]
                          + [_row_ptr(f"{g}_partials", "partials", const=False, storage="float")
                             for g in d_weights]),
                 "uses_n": "N" in wgrad_step["uses"], "threads": planner.WGRAD_COLS_THREADS,
                 "rows": planner.WGRAD_COLS_ROWS}
    source = render_template(p.template, header=head, op=op.name, kernels=kernels, params=param_names(op),
                             dtypes=dtype_values(p.dtypes), wgrad=wgrad, split=split,
                             reduce={"x": planner.REDUCE_X, "y": planner.REDUCE_Y},
                             row_operands=rows_in + d_elem_out, weights=weights,
                             rescale_from=ir.RESCALE_FROM, rescale_to=ir.RESCALE_TO)
    sigs = []
    for k in kernels:
        for dt in p.dtypes:
            for lay in k["layouts"]:
                if k["shapes"][lay["layout"]][dt] is None:
                    continue
                args = tuple((a.name, a.ctypes[dt]) for a in k["ptrs"])
                args += tuple((q, "float") for q in param_names(op)) + (("rows", "long long"),
                                                                    ("cols", "int"))
                for aligned in (True, False):
                    name = f"{k['kernel']}{lay['suffix']}{'' if aligned else '_unaligned'}_{dt}"
                    sigs.append(ir.KernelSig(name, args, dt, k["stage"], planner.row_launch(
                        dt, lay["layout"], wgrad=bool(k["wgrads"]),
                        shape=k["shapes"][lay["layout"]][dt], aligned=aligned,
                        fwdbwd=k["stage"] == "fwdbwd", split_cols=k["split_cols"][dt])))
    if split:
        for dt in p.dtypes:
            args = tuple((a.name, a.ctypes[dt]) for a in split["ptrs"])
            args += tuple((q, "float") for q in param_names(op)) + (("rows", "long long"),
                                                                ("cols", "int"))
            for aligned in (True, False):
                name = f"{op.name}_wgrad_cols{'' if aligned else '_unaligned'}_{dt}"
                sigs.append(ir.KernelSig(name, args, dt, "wgrad_cols",
                                         planner.wgrad_cols_launch(dt, len(stats), aligned)))
    if wgrad:
        for dt in p.dtypes:
            args = (("partials", "const float*"), ("dw", f"{planner.CTYPE[dt]}*"),
                    ("num_partials", "int"), ("cols", "int"), ("accumulate", "int"))
            sigs.append(ir.KernelSig(f"{op.name}_wgrad_reduce_{dt}", args, dt, "wgrad_reduce",
                                     planner.WGRAD_REDUCE_LAUNCH))
    return ir.RenderedCuda(source, tuple(sigs))
