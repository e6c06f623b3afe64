"""Row planning: every choice a row op's kernels make, as a frozen RowPlan that the row
kind (generator/kinds/row.py) prints through templates/row.cu.j2. The stages' steps are
generator/row_schedule.py's; here each stage's impls become kernels with their pointers
(roles and C types), cached operands, row scalars, per-layout and per-dtype blocks
(plan.RowShape) and entry points, whose signatures (KernelSig) are made once.

A norm-shaped op (one that takes the `add` fusion) has its kernels, the add fusion's among
them, once more in the `autocast` precision (bf16 entry points only): the same steps and
blocks with each pointer's own storage type (generator/row_precision.py says which).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from eulergen.errors import EulerError
from eulergen.generator import fuse, ir, plan as planner
from eulergen.generator.emit import param_names
from eulergen.generator.hoist import row_constant_names
from eulergen.generator.row_schedule import (RowLayout, RowNames, RowStats, Stage, Step, Sweep,
                                             row_names, stages, variants)
from eulergen.generator.row_precision import (AUTOCAST_DTYPES, refuse_copy_clash, storage_note,
                                              storage_of)
from eulergen.signature import AUTOCAST, KernelSig, bf16_copy, variant_name


@dataclass(frozen=True)
class RowPtr:
    """A kernel's pointer argument."""
    name: str
    ctype: str                             # in the template body (over scalar_t)
    ctypes: tuple[tuple[str, str], ...]    # dtype -> C type at the extern "C" boundary
    role: str                              # 'row' (chunked), 'weight', 'scalar', 'partials',
                                           # 'stats', 'copy' (dx in bf16, where not null)
    elem: str = "scalar_t"                 # what it points to in the template body


def _ptr(name: str, role: str, *, const: bool, storage: str = "T") -> RowPtr:
    c = "const " if const else ""
    if storage == "T":
        return RowPtr(name, f"{c}scalar_t*",
                      tuple((d, f"{c}{planner.CTYPE[d]}*") for d in planner.DTYPES), role)
    return RowPtr(name, f"{c}{storage}*", tuple((d, f"{c}{storage}*") for d in planner.DTYPES),
                  role, storage)


@dataclass(frozen=True)
class Entry:
    """One `extern "C"` entry point: its signature, and the template arguments of the impl
    it instantiates (a row kernel's layout and shape)."""
    sig: KernelSig
    ctype: str
    aligned: bool
    layout: RowLayout | None = None
    shape: planner.RowShape | None = None


@dataclass(frozen=True)
class RowScalar:
    """A per-row input a kernel loads once a row."""
    name: str
    index: bool     # an index input: an int a row


def _impl_params(ptrs, op: ir.DerivedOp) -> str:
    return ", ".join([f"{a.ctype} {a.name}_ptr" for a in ptrs]
                     + [f"float {q}" for q in param_names(op)] + ["long long rows_", "int cols_"])


@dataclass(frozen=True)
class RowKernel:
    """One device impl of a stage (`impl`: two-pass, or `_online`) and its entry points."""
    kernel: str                      # the entry points' name stem
    impl: str
    stage: str                       # its name: forward, backward_rows_add…
    call: str                        # its signatures' stage, part and fusion
    part: str
    fusion: str
    online: bool                     # an online sum joins one of its sweeps
    layouts: tuple[RowLayout, ...]
    title: str
    ptrs: tuple[RowPtr, ...]
    steps: tuple[Step, ...]
    wgrads: tuple[str, ...]
    row_ptrs: tuple[RowPtr, ...]     # rows it addresses: written, or read by a step
    row_vec_ptrs: tuple[str, ...]    # every row operand (their alignment decides 16-byte access)
    weight_ptrs: tuple[str, ...]
    split_ptr: str                   # the row operand whose split every row operand shares
    cached: tuple[str, ...]          # row operands whose first SLOTS groups stay in registers
    row_scalars: tuple[RowScalar, ...]
    uses_n: bool                     # reads N, the row length
    shapes: tuple[tuple[str, str, planner.RowShape | None], ...]   # (layout, dtype, shape)
    max_reductions: int              # rows of the block's shared merge buffer
    split_cols: tuple[tuple[str, int], ...]   # dtype -> the split backward's from (0: none)
    impl_params: str                 # the device impl's (over scalar_t)
    entries: tuple[Entry, ...] = ()
    dtypes: tuple[str, ...] = planner.DTYPES   # those it has entry points of
    precision: str = ""              # '' or AUTOCAST: each pointer of its own storage type
    elems: tuple[tuple[str, str], ...] = ()   # autocast: each pointer's element C type

    @property
    def mixed(self) -> bool:
        """Whether its pointers have storage types of their own (the template then reads a
        group of VEC columns of each through as many 16-byte words as it fills)."""
        return bool(self.precision)

    def shape(self, layout: str, dtype: str) -> planner.RowShape | None:
        """The block of this impl's `layout` kernel of `dtype` (None: that layout has none)."""
        return next((s for lay, dt, s in self.shapes if (lay, dt) == (layout, dtype)), None)

    @property
    def aligned_rows(self) -> bool:
        """Whether an aligned entry point takes every row on a 16-byte boundary (weights or
        weight gradients: a thread keeps its columns across rows; storage types of their
        own: a row splits at other columns in each), not only the row operands at one
        offset from one."""
        return bool(self.weight_ptrs or self.wgrads or self.mixed)


@dataclass(frozen=True)
class WgradCols:
    """The split backward's column kernel: the weight-gradient terms alone (row-invariant
    parts hoisted); the per-row values they read (`stats`) come from backward_rows."""
    step: Sweep
    stats: tuple[str, ...]
    operands: tuple[str, ...]
    weights: tuple[str, ...]
    wgrads: tuple[str, ...]
    ptrs: tuple[RowPtr, ...]
    uses_n: bool
    threads: int
    rows: int                        # rows whose loads a thread has in flight
    impl_params: str
    entries: tuple[Entry, ...] = ()
    dtypes: tuple[str, ...] = planner.DTYPES   # as RowKernel's
    precision: str = ""
    elems: tuple[tuple[str, str], ...] = ()
    name: str = ""                   # the entry points' name stem

    @property
    def mixed(self) -> bool:
        return bool(self.precision)


@dataclass(frozen=True)
class WgradReduce:
    """The fixed-order sum of the per-worker weight partials: RX x RY threads a block."""
    x: int
    y: int
    entries: tuple[Entry, ...]


@dataclass(frozen=True)
class RowPlan:
    """A row op's kernels: per stage and impl a RowKernel, the split backward's column kernel
    (and its autocast one) and the weight-gradient reduce; `signatures` are the manifest's,
    in the .cu's order."""
    op: str
    kernels: tuple[RowKernel, ...]
    splits: tuple[WgradCols, ...]     # the split backward's column kernels, the autocast one last
    reduce: WgradReduce | None

    @property
    def mixed(self) -> bool:
        """Whether it has autocast kernels (pointers of their own storage types)."""
        return any(k.mixed for k in self.kernels)

    @property
    def split(self) -> WgradCols | None:
        """The split backward's column kernel of the op's own precision."""
        return self.splits[0] if self.splits else None

    @property
    def signatures(self) -> tuple[KernelSig, ...]:
        entries = [e for k in self.kernels for e in k.entries]
        entries += [e for s in self.splits for e in s.entries]
        entries += list(self.reduce.entries if self.reduce else ())
        return tuple(e.sig for e in entries)


def _kernel(o: RowNames, st: Stage, suffix: str, steps: list[Step],
            layouts: tuple[RowLayout, ...], fusion: str = "", precision: str = "") -> RowKernel:
    """The kernel of stage `st` (of the op's `fusion` variant, in the `precision` variant):
    its block shapes are the stage's, its names the variant's (signature.variant_name, then
    `_autocast`)."""
    op, where = o.op, dict(file=o.op.where.file, line=o.op.where.line)
    label = variant_name(st.name, fusion)
    stem = f"{op.name}_{label}{'_' + precision if precision else ''}"
    storage = storage_of(o, precision)
    dtypes = AUTOCAST_DTYPES if precision else planner.DTYPES
    # the split backward's rows kernel is a part of the backward; the others are their call's
    call, part = ("backward", "rows") if st.name == "backward_rows" else (st.name, "")
    if st.name == "backward_rows":   # long rows only
        layouts = tuple(lay for lay in layouts if lay.name == "block_per_row")
    uses = frozenset().union(*(s.uses for s in steps))
    sweeps = [s for s in steps if isinstance(s, Sweep)]
    levels = sum(s.kind == "sweep" for s in sweeps)
    chunked = set(o.rows_in + o.d_elem_out + o.elem_out + o.d_rows)
    ptrs = []
    for name in st.reads:
        role = "row" if name in chunked else "weight" if name in o.weights else "scalar"
        kept = "int" if name in o.index else "float" if name in o.d_row_out else "T"
        ptrs.append(_ptr(name, role, const=True, storage=storage(name, kept)))
    for name in st.writes:
        ptrs.append(_ptr(name, "row" if name in chunked else "scalar", const=False,
                         storage=storage(name, "float" if name in o.row_out else "T")))
    # an autocast backward's dx, rounded to bf16 beside its float32 store
    copies = tuple((d, bf16_copy(d)) for d in st.writes if precision and d in o.d_rows)
    for _, c in copies:
        ptrs.append(_ptr(c, "copy", const=False, storage=planner.CTYPE["bf16"]))
    for name in st.wgrads:
        ptrs.append(_ptr(f"{name}_partials", "partials", const=False, storage="float"))
    if st.row_stats:
        ptrs.append(_ptr("rowstats", "stats", const=False, storage="float"))
    defined = set(param_names(op)) | {"i", "N"}
    for s in steps:
        if isinstance(s, RowStats):
            continue
        defined |= set(s.block.results)
        if isinstance(s, Sweep):
            defined |= {n for n, _ in s.ops} | {x.name for x in s.online}
            defined |= set(s.consts.results if s.consts else ()) | set(s.pre.results if s.pre else ())
    missing = sorted((uses | set(st.row_stats)) - defined - set(st.reads))
    if missing:
        raise EulerError(f"{label} reads {', '.join(missing)}, which no kernel argument or "
                         "earlier step provides", key="outputs", **where)
    # registers cache the row operands sweeps read again; one only the last sweep reads (an
    # `add` backward's incoming stream gradient) comes from the row there, as the others'
    # re-read groups do
    cached = tuple(a.name for a in ptrs if a.role == "row" and a.name in st.reads and a.name in uses
                   and (len(sweeps) < 2 or sum(a.name in s.uses for s in sweeps) > 1))
    shapes = tuple(
        [("warp_per_row", dt, planner.warp_shape(dt, stage=st.name, wgrad=bool(st.wgrads),
                                                 levels=levels, cached=len(cached)))
         for dt in dtypes]
        + [("block_held", dt, planner.held_shape(dt, stage=st.name, wgrad=bool(st.wgrads),
                                                 cached=len(cached)))
           for dt in dtypes]
        + [("block_per_row", dt, planner.block_shape(
            dt, stage=st.name, sweeps=len(sweeps), cached=len(cached), weights=bool(o.weights),
            wgrad=bool(st.wgrads))) for dt in dtypes])
    served = [sh for lay, _, sh in shapes if sh and lay in {x.name for x in layouts}]
    # a first sweep that some shape batches is printed both ways (row.cu.j2, sweep), and so
    # is one that some shape sweeps whole (RowShape.batch, .whole)
    batched, whole = any(sh.batch > 1 for sh in served), any(sh.whole for sh in served)
    first = next((s for s in sweeps if s.kind == "sweep"), None)
    elems = tuple((a.name, a.elem) for a in ptrs) if precision else ()
    steps = [replace(s, batched=batched and s is first, whole=whole,
                     read=tuple(x for x in s.ops + tuple((y.name, y.red) for y in s.online)
                                if x[0] in uses),
                     cached=tuple(replace(v, direct=tuple(a for a in v.loads.operands
                                                          if a not in cached))
                                  for v in s.cached),
                     elems=elems, copies=tuple(c for c in copies if c[0] in s.stores))
             if isinstance(s, Sweep) else s for s in steps]
    title = f"{label}: {', '.join(st.writes + st.wgrads)} from {', '.join(st.reads)}"
    return RowKernel(
        kernel=stem, impl=f"{stem}{suffix}", stage=label, call=call,
        part=part, fusion=fusion,
        online=bool(suffix), layouts=layouts,
        title=f"{title} ({precision}: {storage_note(ptrs)})" if precision else title,
        ptrs=tuple(ptrs), steps=tuple(steps), wgrads=st.wgrads,
        row_ptrs=tuple(a for a in ptrs if a.role == "row"
                       and (a.name not in st.reads or a.name in uses)),
        row_vec_ptrs=tuple(a.name for a in ptrs if a.role in ("row", "copy")),
        weight_ptrs=tuple(a.name for a in ptrs if a.role == "weight"),
        split_ptr=next(a.name for a in ptrs if a.role == "row"), cached=cached,
        row_scalars=tuple(RowScalar(a.name, a.name in o.index) for a in ptrs
                          if a.role == "scalar" and a.name in uses and a.name in st.reads),
        uses_n="N" in uses, shapes=shapes,
        max_reductions=max((len(s.merged) for s in sweeps if s.kind == "sweep"), default=0),
        split_cols=tuple((dt, planner.wgrad_split_cols(dt, levels)
                          if st.name == "backward_rows" else 0) for dt in dtypes),
        impl_params=_impl_params(ptrs, op), dtypes=dtypes, precision=precision, elems=elems)


def _wgrad_cols(o: RowNames, step: Sweep, stats: tuple[str, ...],
                precision: str = "") -> WgradCols:
    operands = tuple(a for a in o.operands if a in step.uses)
    weights = tuple(w for w in o.weights if w in step.uses)
    storage = storage_of(o, precision)
    ptrs = ([_ptr(a, "row", const=True, storage=storage(a, "T")) for a in operands + weights]
            + [_ptr("rowstats", "stats", const=True, storage="float")]
            + [_ptr(f"{g}_partials", "partials", const=False, storage="float")
               for g in o.d_weights])
    return WgradCols(step, stats, operands, weights, o.d_weights, tuple(ptrs), "N" in step.uses,
                     planner.WGRAD_COLS_THREADS, planner.WGRAD_COLS_ROWS,
                     _impl_params(ptrs, o.op),
                     dtypes=AUTOCAST_DTYPES if precision else planner.DTYPES, precision=precision,
                     elems=tuple((a.name, a.elem) for a in ptrs) if precision else (),
                     name=f"{o.op.name}_wgrad_cols{'_' + precision if precision else ''}")


def _entry_args(op: ir.DerivedOp, ptrs, dt: str) -> tuple[tuple[str, str], ...]:
    """An entry point's parameters over storage `dt`: its pointers, the op's params, the sizes."""
    return (tuple((a.name, dict(a.ctypes)[dt]) for a in ptrs)
            + tuple((q, "float") for q in param_names(op))
            + (("rows", "long long"), ("cols", "int")))


def signatures(op: ir.DerivedOp, p: planner.KernelPlan, kernels: tuple[RowKernel, ...],
               splits: tuple[WgradCols, ...]) -> tuple[list[tuple[Entry, ...]],
                                                       list[tuple[Entry, ...]],
                                                       tuple[Entry, ...]]:
    """The entry points of each row kernel, of each of the split backward's wgrad_cols and
    of the weight-gradient reduce: every row KernelSig, with its launch facts
    (plan.row_launch, plan.wgrad_cols_launch, plan.WGRAD_REDUCE_LAUNCH)."""
    rows = []
    for k in kernels:
        entries = []
        for dt in k.dtypes:
            args = _entry_args(op, k.ptrs, dt)
            for lay in k.layouts:
                shape = k.shape(lay.name, dt)
                if shape is None:
                    continue
                for aligned in (True, False):
                    name = f"{k.kernel}{lay.suffix}{'' if aligned else '_unaligned'}_{dt}"
                    geometry = planner.row_launch(dt, lay.name, wgrad=bool(k.wgrads), shape=shape,
                                                  aligned=aligned, fwdbwd=k.stage == "fwdbwd",
                                                  split_cols=dict(k.split_cols)[dt])
                    entries.append(Entry(KernelSig(name, args, dt, k.call, geometry,
                                                   part=k.part, fusion=k.fusion,
                                                   precision=k.precision),
                                         planner.CTYPE[dt], aligned, lay, shape))
        rows.append(tuple(entries))
    cols = []
    for s in splits:
        entries = []
        for dt in s.dtypes:
            args = _entry_args(op, s.ptrs, dt)
            for aligned in (True, False):
                name = f"{s.name}{'' if aligned else '_unaligned'}_{dt}"
                entries.append(Entry(KernelSig(name, args, dt, "backward",
                                               planner.wgrad_cols_launch(dt, len(s.stats),
                                                                         aligned),
                                               part="cols", precision=s.precision),
                                     planner.CTYPE[dt], aligned))
        cols.append(tuple(entries))
    reduce = []
    if any(k.wgrads for k in kernels):
        for dt in p.dtypes:
            reduce.append(Entry(KernelSig(f"{op.name}_wgrad_reduce_{dt}",
                                          planner.reduce_args(dt), dt, "backward",
                                          planner.WGRAD_REDUCE_LAUNCH, part="reduce"),
                                planner.CTYPE[dt], True))
    return rows, cols, tuple(reduce)


def _add_impls(op: ir.DerivedOp, names, stats: tuple[str, ...]) -> list[tuple]:
    """The impls (_kernel's arguments) of the op's `add` fusion (generator/fuse.py), none
    where it has none: add_forward's forward, add_backward's backward and split rows
    kernel. add_backward's weight-gradient terms are the op's, so the op's wgrad_cols and
    reduce serve it."""
    fused = fuse.add_variants(op)
    if fused is None:
        return []
    forward, backward = fused
    out = []
    for variant, wanted in ((forward, {"forward"}), (backward, {"backward", "backward_rows"})):
        o = row_names(variant)
        staged, _, variant_stats = stages(o, names, False)
        if variant is backward and variant_stats != stats:
            raise EulerError(f"add fusion: the split backward's row values {variant_stats} are "
                             f"not the op's {stats}", file=op.where.file, line=op.where.line)
        out += [(o, st, suffix, steps, lays, "add") for st in staged if st.name in wanted
                for suffix, steps, lays in variants(o, names, st.later)]
    return out


def plan_row(op: ir.DerivedOp) -> RowPlan:
    """Every choice of a row op's kernels: stages, impls, steps, pointers, shapes, entry
    points; a norm-shaped op's again in the autocast precision (the same impls)."""
    p = planner.KernelPlan(planner.DTYPES,
                           fwdbwd=all(o.role == "scalar" for o in op.outputs))
    o = row_names(op)
    names = row_constant_names()
    staged, wgrad_step, stats = stages(o, names, p.fwdbwd)
    impls = [(o, st, suffix, steps, lays, "")
             for st in staged for suffix, steps, lays in variants(o, names, st.later)]
    impls += _add_impls(op, names, stats)
    precisions = ("",)
    if fuse.takes_add(op):
        refuse_copy_clash(op)
        precisions += (AUTOCAST,)
    kernels = tuple(_kernel(*impl, precision=pr) for pr in precisions for impl in impls)
    splits = tuple(_wgrad_cols(o, wgrad_step, stats, pr) for pr in precisions) if wgrad_step \
        else ()
    rows, cols, reduce = signatures(op, p, kernels, splits)
    return RowPlan(
        op=op.name,
        kernels=tuple(replace(k, entries=e) for k, e in zip(kernels, rows)),
        splits=tuple(replace(s, entries=e) for s, e in zip(splits, cols)),
        reduce=WgradReduce(planner.REDUCE_X, planner.REDUCE_Y, reduce) if reduce else None)
