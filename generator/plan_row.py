"""Row planning (templates/row.cu.j2's kernels): every choice a row op's kernels make, as a
frozen RowPlan that generator/render_row.py prints and tests inspect without Jinja.

Each stage (forward, backward, fwdbwd, the split backward's backward_rows) forms the
reductions its later steps read: one sweep per level, a sum that rescales with a stabilizer
max in the max's sweep (ir.Online; block-per-row kernels only, warp-per-row ones keep the
two-pass form, so a stage where one joins has a second device impl, `<op>_<stage>_online`),
a sum that is one column's value read at that column (ir.Pick), and the backward's adjoint
sums in the sweep after the last one forming a reduction they read (derive has taken their
row-constant factors out). Each kernel's block, register slots, prefetch, batch and whole
groups are the planner's (plan.RowShape); its entry points' signatures are made here once.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator

from eulergen.errors import EulerError
from eulergen.generator import ir, plan as planner
from eulergen.generator.emit import Block, block, param_names
from eulergen.generator.hoist import hoist, row_constant_names
from eulergen.generator.printer import cuda_expr


@dataclass(frozen=True)
class RowPtr:
    name: str
    ctype: str                             # in the template body (over scalar_t)
    ctypes: tuple[tuple[str, str], ...]    # dtype -> C type at the extern "C" boundary
    role: str                              # 'row' (chunked), 'weight', 'scalar', 'partials', 'stats'


def _ptr(name: str, role: str, *, const: bool, storage: str = "T") -> RowPtr:
    c = "const " if const else ""
    if storage == "T":
        return RowPtr(name, f"{c}scalar_t*",
                      tuple((d, f"{c}{planner.CTYPE[d]}*") for d in planner.DTYPES), role)
    return RowPtr(name, f"{c}{storage}*", tuple((d, f"{c}{storage}*") for d in planner.DTYPES),
                  role)


@dataclass(frozen=True)
class Loads:
    """What code over a group of columns reads of the row: row operands and weights (in the
    op's order), and whether the column index `i`."""
    operands: tuple[str, ...]
    weights: tuple[str, ...]
    column: bool


@dataclass(frozen=True)
class Visit:
    """What a sweep does with one group of VEC columns a thread owns. A sweep with online sums
    visits its cached groups twice, the plain reductions (the max among them) first and then
    the online terms against that max, with nothing to rescale as they come first in the row;
    its re-read groups once, for both."""
    loads: Loads
    elements: bool                # the element code: the step's lines, accumulations, stores
    online: bool                  # the online terms
    rescale: tuple[str, ...]      # maxes the group may move: kept, then the sums rescaled
    bounds: bool                  # tests which lanes' columns are in the row's body (in_)
    registers: tuple[str, ...]    # weight grads added into the worker's cached partials
    workspace: tuple[str, ...]    # weight grads added into its workspace row


@dataclass(frozen=True)
class OnlineSum:
    """An ir.Online as a sweep forms it: the term's printed block and the rescale factor."""
    name: str
    red: str
    max: str
    block: Block
    factor: str


@dataclass(frozen=True)
class Sweep:
    """One sweep over the row: it forms reductions (`ops`, and online sums against their
    running max), or it is an element sweep, the row's last, that stores outputs and adds
    weight gradients. `consts`: its row-invariant parts, once per row (generator/hoist.py);
    `pre`: the element outputs, recomputed first where the step reads them."""
    block: Block
    pre: Block | None
    consts: Block | None
    uses: frozenset[str]
    ops: tuple[tuple[str, str], ...] = ()
    online: tuple[OnlineSum, ...] = ()
    stores: tuple[str, ...] = ()
    wgrads: tuple[str, ...] = ()
    cached: tuple[Visit, ...] = ()   # over the groups held in registers
    reread: Visit | None = None      # over the others and the edge
    online_loads: Loads | None = None
    batched: bool = False            # takes the BATCH loop (the kernel's first sweep)
    whole: bool = False              # takes the WHOLE loop
    read: tuple[tuple[str, str], ...] = ()   # the reductions later steps read, (name, op)

    @property
    def kind(self) -> str:
        return "sweep" if self.ops else "elements"

    @property
    def maxes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(o.max for o in self.online))

    @property
    def merged(self) -> tuple[str, ...]:
        """The reductions a block's warps merge through shared memory, in its rows' order."""
        return tuple(n for n, _ in self.ops) + tuple(o.name for o in self.online)

    @property
    def evict_first(self) -> bool:
        """An element sweep is the row's last: a block per row re-reads it evict-first."""
        return not self.ops


@dataclass(frozen=True)
class Pick:
    """A sum that is one column's value (ir.Pick), read at that column."""
    block: Block
    index: str
    loads: Loads
    uses: frozenset[str]
    kind = "pick"


@dataclass(frozen=True)
class RowCode:
    """Per-row code (adjoints, row outputs); lane 0 stores `stores`."""
    block: Block
    stores: tuple[str, ...]
    uses: frozenset[str]
    kind = "row"


@dataclass(frozen=True)
class RowStats:
    """The split backward's rows kernel writes what the weight-gradient terms read of each
    row to the workspace wgrad_cols reads."""
    names: tuple[str, ...]
    uses: frozenset[str]
    kind = "row_stats"


Step = Sweep | Pick | RowCode | RowStats


@dataclass(frozen=True)
class RowLayout:
    name: str       # 'warp_per_row' | 'block_held' | 'block_per_row'
    suffix: str     # of the entry points' names
    warp: bool      # one warp a row (the impl's WARP)


# A block_held kernel holds its row in registers, as a warp does: it takes the two-pass impl
# too (generator/plan.py, HELD_SLOTS).
LAYOUTS = (RowLayout("warp_per_row", "", True), RowLayout("block_held", "_held", False),
           RowLayout("block_per_row", "_block", False))


@dataclass(frozen=True)
class Entry:
    """One `extern "C"` entry point: its signature, and the template arguments of the impl
    it instantiates (a row kernel's layout and shape)."""
    sig: ir.KernelSig
    ctype: str
    aligned: bool
    layout: RowLayout | None = None
    shape: planner.RowShape | None = None


@dataclass(frozen=True)
class RowScalar:
    name: str
    index: bool     # an index input: an int a row


def _impl_params(ptrs: tuple[RowPtr, ...], params: tuple[str, ...]) -> str:
    return ", ".join([f"{a.ctype} {a.name}_ptr" for a in ptrs] + [f"float {q}" for q in params]
                     + ["long long rows_", "int cols_"])


@dataclass(frozen=True)
class RowKernel:
    """One device impl of a stage (`impl`: two-pass, or `_online`) and its entry points."""
    kernel: str                      # the entry points' name stem
    impl: str
    stage: str
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
    uses_n: bool
    uses: frozenset[str]
    shapes: tuple[tuple[str, str, planner.RowShape | None], ...]   # (layout, dtype, shape)
    max_reductions: int              # rows of the block's shared merge buffer
    row_stats: tuple[str, ...]
    split_cols: tuple[tuple[str, int], ...]   # dtype -> split backward from (0: none)
    params: tuple[str, ...]
    entries: tuple[Entry, ...] = ()

    def shape(self, layout: str, dtype: str) -> planner.RowShape | None:
        return next(s for lay, dt, s in self.shapes if (lay, dt) == (layout, dtype))

    @property
    def impl_params(self) -> str:
        """The device impl's parameters (over scalar_t); its entry points forward theirs."""
        return _impl_params(self.ptrs, self.params)

    @property
    def aligned_rows(self) -> bool:
        """Whether an aligned entry point takes every row on a 16-byte boundary (weights or
        weight gradients: a thread keeps its columns across rows), not only the row
        operands at one offset from one."""
        return bool(self.weight_ptrs or self.wgrads)


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
    params: tuple[str, ...]
    uses_n: bool
    threads: int
    rows: int
    entries: tuple[Entry, ...] = ()

    @property
    def impl_params(self) -> str:
        return _impl_params(self.ptrs, self.params)


@dataclass(frozen=True)
class WgradReduce:
    """The fixed-order sum of the per-worker weight partials: RX x RY threads a block."""
    x: int
    y: int
    entries: tuple[Entry, ...]


@dataclass(frozen=True)
class RowPlan:
    op: str
    template: str
    dtypes: tuple[str, ...]
    params: tuple[str, ...]
    row_operands: tuple[str, ...]   # what a sweep loads by groups: row inputs and d<outputs>
    weights: tuple[str, ...]
    kernels: tuple[RowKernel, ...]
    split: WgradCols | None
    reduce: WgradReduce | None

    @property
    def signatures(self) -> tuple[ir.KernelSig, ...]:
        entries = [e for k in self.kernels for e in k.entries]
        entries += list(self.split.entries if self.split else ())
        entries += list(self.reduce.entries if self.reduce else ())
        return tuple(e.sig for e in entries)


# ---- the schedule ------------------------------------------------------------------------

@dataclass(frozen=True)
class _Op:
    """A row op's operand names by role, in spec order."""
    op: ir.DerivedOp
    rows_in: tuple[str, ...]
    weights: tuple[str, ...]
    index: tuple[str, ...]
    elem_out: tuple[str, ...]
    row_out: tuple[str, ...]
    d_elem_out: tuple[str, ...]
    d_row_out: tuple[str, ...]
    d_rows: tuple[str, ...]
    d_weights: tuple[str, ...]

    @property
    def body(self) -> ir.RowDerived:
        return self.op.body

    @property
    def operands(self) -> tuple[str, ...]:
        return self.rows_in + self.d_elem_out

    @property
    def varying(self) -> set[str]:
        """What differs between the elements of a row."""
        return set(self.rows_in + self.d_elem_out + self.weights) | {"i"}


def _names(op: ir.DerivedOp) -> _Op:
    where = dict(file=op.where.file, line=op.where.line)
    for o in op.inputs + op.outputs:
        if o.role not in ("row", "weight", "index", "scalar"):
            raise EulerError(f"row op operand {o.name!r} has role {o.role!r}", key="inputs", **where)

    def of(ops, role, prefix="", differentiable=False):
        return tuple(f"{prefix}{o.name}" for o in ops
                     if o.role == role and (o.differentiable or not differentiable))
    return _Op(op, of(op.inputs, "row"), of(op.inputs, "weight"), of(op.inputs, "index"),
               of(op.outputs, "row"), of(op.outputs, "scalar"), of(op.outputs, "row", "d"),
               of(op.outputs, "scalar", "d"), of(op.inputs, "row", "d", True),
               of(op.inputs, "weight", "d", True))


def _uses(*blocks) -> frozenset[str]:
    out: set[str] = set()
    for b in blocks:
        if b is not None:
            out |= b.uses
    return frozenset(out)


def _loads(o: _Op, uses) -> Loads:
    return Loads(tuple(a for a in o.operands if a in uses),
                 tuple(w for w in o.weights if w in uses), "i" in uses)


def _sweep(o: _Op, names: Iterator[str], code: ir.Code, with_outputs: bool, *,
           online: tuple[ir.Online, ...] = (), ops: tuple = (), stores: tuple = (),
           wgrads: tuple = ()) -> Sweep:
    """A reduction or element sweep; with_outputs: the element outputs are recomputed first
    (`pre`), for code that reads them. `online`: sums it accumulates against its running
    max, which varies along the row like an element."""
    first = [o.body.elem_outputs, code] if with_outputs else [code]
    maxes = tuple(dict.fromkeys(s.max for s in online))
    consts, hoisted = hoist(first + [s.term for s in online], o.varying | set(maxes), names)
    blocks = [block(c) for c in hoisted]
    pre, b = (blocks[0], blocks[1]) if with_outputs else (None, blocks[0])
    terms = blocks[len(first):]
    c = block(consts) if consts.results else None
    joined = tuple(OnlineSum(s.name, s.op, s.max, t, cuda_expr(s.factor))
                   for s, t in zip(online, terms))
    factor_uses = {x.name for s in online for x in s.factor.free_symbols}
    factor_uses -= {ir.RESCALE_FROM, ir.RESCALE_TO}
    online_uses = _uses(*terms)
    uses = _uses(b, pre, c) | online_uses | factor_uses
    loads = _loads(o, uses)
    bounds = bool(ops)
    if joined:
        cached = (Visit(loads, True, False, (), bounds, tuple(wgrads), ()),
                  Visit(_loads(o, online_uses), False, True, (), bounds, tuple(wgrads), ()))
    else:
        cached = (Visit(loads, True, False, maxes, bounds, tuple(wgrads), ()),)
    reread = Visit(loads, True, bool(joined), maxes, bounds or bool(wgrads), (), tuple(wgrads))
    return Sweep(b, pre, c, uses, tuple(ops), joined, tuple(stores), tuple(wgrads), cached,
                 reread, _loads(o, online_uses))


def _reads_outputs(o: _Op, code: ir.Code) -> bool:
    return bool(block(code).uses & set(o.elem_out))


def _pass(o: _Op, names: Iterator[str], ps: ir.Pass, online: tuple[ir.Online, ...] = ()) -> Sweep:
    return _sweep(o, names, ps.body, _reads_outputs(o, ps.body), online=online,
                  ops=tuple(tuple(x) for x in ps.ops))


def _elements(o: _Op, names: Iterator[str], code: ir.Code, stores, wgrads,
              outputs: bool = False) -> Sweep:
    return _sweep(o, names, code, not outputs and _reads_outputs(o, code), stores=tuple(stores),
                  wgrads=tuple(wgrads))


def _pick(o: _Op, pk: ir.Pick) -> Pick:
    b = block(pk.value, declare=False)
    uses = b.uses | {pk.index}
    return Pick(b, pk.index, _loads(o, uses), uses)


# A stage computes the reductions its later steps read (and what those read): a pick from its
# one column, the others one sweep per level, except that an online sum joins its max's
# sweep: one sweep fewer where it was its level's only reduction. Online sums join only in
# the block-per-row kernels, whose rows are re-read each sweep; a warp holds its row in
# registers, where the two-pass form ran faster (benchmarks/RESULTS.md, "Why the row
# planner's constants are what they are": online sums).
def _reductions(o: _Op, names: Iterator[str], later: list[Step], online: bool) -> list[Step]:
    """The sweeps (and picks) that form what `later` reads, the adjoint sums (when read)
    among them: in the sweep after the last one forming a reduction they read (the first
    sweep if they read none), or a sweep of their own after all of them (log-softmax's
    Σ dy and RMSNorm's Σ dy·w·x read none: the row's first sweep; LayerNorm's
    Σ dy·w·(x - mu) reads mu: var's sweep; softmax's online backward: after m's)."""
    body = o.body
    moved = {pk.name for pk in body.picks} | ({s.name for s in body.online} if online else set())
    need = set().union(*(s.uses for s in later))
    adj = body.adjoint_pass
    adj = adj if adj is not None and {n for n, _ in adj.ops} & need else None
    adj_step = _pass(o, names, adj) if adj is not None else None
    adj_reads = adj_step.uses if adj_step else set()
    need |= adj_reads
    passes: list[tuple[ir.Pass, tuple[ir.Online, ...]]] = []
    steps: list[Step] = []               # the sweep of each of `passes`
    for ps in reversed(body.passes):
        own = {n for n, _ in ps.ops}
        joined = tuple(s for s in body.online if online and s.max in own and s.name in need)
        need |= {s.max for s in joined}
        plain = tuple(x for x in ps.ops if x[0] in need and x[0] not in moved)
        if plain:
            passes.insert(0, (ir.Pass(plain, ps.body.only({n for n, _ in plain})), joined))
            steps.insert(0, _pass(o, names, *passes[0]))
            need |= steps[0].uses
    if adj is not None:
        formed = [{n for n, _ in ps.ops} | {s.name for s in joined} for ps, joined in passes]
        at = max((i + 1 for i, made in enumerate(formed) if made & adj_reads), default=0)
        if at < len(passes):
            ps, joined = passes[at]
            steps[at] = _pass(o, names, ir.Pass(ps.ops + adj.ops,
                                                ir.Code(ps.body.temps + adj.body.temps,
                                                        ps.body.results + adj.body.results)),
                              joined)
        else:
            steps.append(adj_step)
    return [_pick(o, pk) for pk in body.picks if pk.name in need] + steps


@dataclass(frozen=True)
class _Stage:
    name: str
    later: tuple[Step, ...]     # its steps after the reductions
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    wgrads: tuple[str, ...]
    row_stats: tuple[str, ...] = ()


def _stages(o: _Op, names: Iterator[str], fwdbwd: bool) -> tuple[list[_Stage], Sweep | None,
                                                                 tuple[str, ...]]:
    """The stages' steps after their reductions, the split backward's column step and the
    row stats it reads. (The hoisted names are drawn in this order.)"""
    body = o.body
    row_outputs = block(body.row_outputs, declare=False)
    grads = body.elem_grads
    adjoint_code = block(body.adjoints, declare=False)
    adjoints = RowCode(adjoint_code, (), adjoint_code.uses)
    grad_elems = _elements(o, names, grads, [g for g in grads.names if g in o.d_rows],
                           [g for g in grads.names if g in o.d_weights])
    grad_steps = (adjoints, grad_elems)
    adjoint_sums = block(body.adjoint_pass.body) if body.adjoint_pass else None
    needs_row_out = _uses(adjoint_sums, adjoints.block, grad_elems.block,
                          grad_elems.consts) & set(o.row_out)

    def per_row(stores) -> RowCode:
        return RowCode(row_outputs, tuple(stores), row_outputs.uses)
    forward = (((per_row(o.row_out),) if o.row_out else ())
               + ((_elements(o, names, body.elem_outputs, o.elem_out, [], outputs=True),)
                  if o.elem_out else ()))
    wgrad_step = (_elements(o, names, grads.only(set(o.d_weights)), [], o.d_weights)
                  if o.d_weights else None)
    per_elem = set(o.rows_in + o.d_elem_out + o.weights) | {"i", "N"} | set(param_names(o.op))
    stats: tuple[str, ...] = ()
    if wgrad_step:
        local = set(wgrad_step.consts.results if wgrad_step.consts else ())
        local |= set(wgrad_step.pre.results if wgrad_step.pre else ())
        stats = tuple(sorted(wgrad_step.uses - local - per_elem))

    reads = o.rows_in + o.weights + o.index
    stages = [_Stage("forward", forward, reads, o.elem_out + o.row_out, ())]
    if o.d_rows or o.d_weights:
        before = (per_row(()),) if needs_row_out else ()
        stages.append(_Stage("backward", before + grad_steps, reads + o.d_elem_out + o.d_row_out,
                             o.d_rows, o.d_weights))
        if fwdbwd:
            stages.append(_Stage("fwdbwd", (per_row(o.row_out),) + grad_steps,
                                 reads + o.d_row_out, o.row_out + o.d_rows, o.d_weights))
        if o.d_weights:
            # The split backward of long rows (plan.WGRAD_SPLIT_COLS): a block per row writes
            # the input grads and the per-row values the weight-gradient terms read (so the
            # row forms those too); a column kernel sums those terms over rows (wgrad_cols).
            rows_elem = _elements(o, names, grads.only(set(o.d_rows)), grad_elems.stores, [])
            rows_elem = replace(rows_elem, uses=rows_elem.uses | set(stats))
            stages.append(_Stage("backward_rows",
                                 before + (adjoints, RowStats(stats, frozenset(stats)), rows_elem),
                                 reads + o.d_elem_out + o.d_row_out, o.d_rows, (), stats))
    return stages, wgrad_step, stats


# ---- kernels -----------------------------------------------------------------------------

def _variants(o: _Op, names: Iterator[str], later: tuple[Step, ...]):
    """(impl suffix, steps, the layouts it serves): the two-pass impl for every layout,
    unless an online sum joins one of the stage's sweeps; then block_per_row has its own
    `_online` impl."""
    two_pass = _reductions(o, names, list(later), False) + list(later)
    online = _reductions(o, names, list(later), True) + list(later)
    if any(getattr(s, "online", ()) for s in online):
        return [("", two_pass, LAYOUTS[:2]), ("_online", online, LAYOUTS[2:])]
    return [("", two_pass, LAYOUTS)]


def _kernel(o: _Op, st: _Stage, suffix: str, steps: list[Step],
            layouts: tuple[RowLayout, ...]) -> RowKernel:
    op, where = o.op, dict(file=o.op.where.file, line=o.op.where.line)
    if st.name == "backward_rows":   # long rows only
        layouts = tuple(lay for lay in layouts if lay.name == "block_per_row")
    uses = frozenset().union(*(s.uses for s in steps))
    sweeps = [s for s in steps if isinstance(s, Sweep)]
    levels = sum(s.kind == "sweep" for s in sweeps)
    chunked = set(o.rows_in + o.d_elem_out + o.elem_out + o.d_rows)
    ptrs = []
    for name in st.reads:
        role = "row" if name in chunked else "weight" if name in o.weights else "scalar"
        storage = "int" if name in o.index else "float" if name in o.d_row_out else "T"
        ptrs.append(_ptr(name, role, const=True, storage=storage))
    for name in st.writes:
        ptrs.append(_ptr(name, "row" if name in chunked else "scalar", const=False,
                         storage="float" if name in o.row_out else "T"))
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
        raise EulerError(f"{st.name} reads {', '.join(missing)}, which no kernel argument or "
                         "earlier step provides", key="outputs", **where)
    cached = tuple(a.name for a in ptrs if a.role == "row" and a.name in st.reads and a.name in uses)
    shapes = tuple(
        [("warp_per_row", dt, planner.warp_shape(dt, stage=st.name, wgrad=bool(st.wgrads),
                                                 levels=levels)) for dt in planner.DTYPES]
        + [("block_held", dt, planner.held_shape(dt, stage=st.name, wgrad=bool(st.wgrads)))
           for dt in planner.DTYPES]
        + [("block_per_row", dt, planner.block_shape(
            dt, stage=st.name, sweeps=len(sweeps), cached=len(cached), weights=bool(o.weights),
            wgrad=bool(st.wgrads))) for dt in planner.DTYPES])
    served = [sh for lay, _, sh in shapes if sh and lay in {x.name for x in layouts}]
    # a first sweep that some shape batches is printed both ways (row.cu.j2, sweep), and so
    # is one that some shape sweeps whole (RowShape.batch, .whole)
    batched, whole = any(sh.batch > 1 for sh in served), any(sh.whole for sh in served)
    first = next((s for s in sweeps if s.kind == "sweep"), None)
    steps = [replace(s, batched=batched and s is first, whole=whole,
                     read=tuple(x for x in s.ops + tuple((y.name, y.red) for y in s.online)
                                if x[0] in uses))
             if isinstance(s, Sweep) else s for s in steps]
    return RowKernel(
        kernel=f"{op.name}_{st.name}", impl=f"{op.name}_{st.name}{suffix}", stage=st.name,
        online=bool(suffix), layouts=layouts,
        title=f"{st.name}: {', '.join(st.writes + st.wgrads)} from {', '.join(st.reads)}",
        ptrs=tuple(ptrs), steps=tuple(steps), wgrads=st.wgrads,
        row_ptrs=tuple(a for a in ptrs if a.role == "row"
                       and (a.name not in st.reads or a.name in uses)),
        row_vec_ptrs=tuple(a.name for a in ptrs if a.role == "row"),
        weight_ptrs=tuple(a.name for a in ptrs if a.role == "weight"),
        split_ptr=next(a.name for a in ptrs if a.role == "row"), cached=cached,
        row_scalars=tuple(RowScalar(a.name, a.name in o.index) for a in ptrs
                          if a.role == "scalar" and a.name in uses and a.name in st.reads),
        uses_n="N" in uses, uses=uses, shapes=shapes,
        max_reductions=max((len(s.merged) for s in sweeps if s.kind == "sweep"), default=0),
        row_stats=st.row_stats,
        split_cols=tuple((dt, planner.wgrad_split_cols(dt, levels)
                          if st.name == "backward_rows" else 0) for dt in planner.DTYPES),
        params=tuple(param_names(op)))


def _wgrad_cols(o: _Op, step: Sweep, stats: tuple[str, ...]) -> WgradCols:
    operands = tuple(a for a in o.operands if a in step.uses)
    weights = tuple(w for w in o.weights if w in step.uses)
    ptrs = ([_ptr(a, "row", const=True) for a in operands + weights]
            + [_ptr("rowstats", "stats", const=True, storage="float")]
            + [_ptr(f"{g}_partials", "partials", const=False, storage="float")
               for g in o.d_weights])
    return WgradCols(step, stats, operands, weights, o.d_weights, tuple(ptrs),
                     tuple(param_names(o.op)), "N" in step.uses, planner.WGRAD_COLS_THREADS,
                     planner.WGRAD_COLS_ROWS)


def signatures(op: ir.DerivedOp, p: planner.KernelPlan, kernels: tuple[RowKernel, ...],
               split: WgradCols | None) -> tuple[list[tuple[Entry, ...]], tuple[Entry, ...],
                                                 tuple[Entry, ...]]:
    """The entry points of each row kernel, of the split backward's wgrad_cols and of the
    weight-gradient reduce: every row KernelSig, with its launch facts (plan.row_launch,
    plan.wgrad_cols_launch, plan.WGRAD_REDUCE_LAUNCH)."""
    rows = []
    for k in kernels:
        entries = []
        for dt in p.dtypes:
            for lay in k.layouts:
                shape = k.shape(lay.name, dt)
                if shape is None:
                    continue
                args = tuple((a.name, dict(a.ctypes)[dt]) for a in k.ptrs)
                args += tuple((q, "float") for q in param_names(op)) + (("rows", "long long"),
                                                                    ("cols", "int"))
                launch = planner.row_launch(p, dt, lay.name, wgrad=bool(k.wgrads), shape=shape,
                                            fwdbwd=k.stage == "fwdbwd",
                                            split_cols=dict(k.split_cols)[dt])
                for aligned in (True, False):
                    name = f"{k.kernel}{lay.suffix}{'' if aligned else '_unaligned'}_{dt}"
                    entries.append(Entry(ir.KernelSig(name, args, dt, k.stage,
                                                      launch + (("aligned", aligned),)),
                                         planner.CTYPE[dt], aligned, lay, shape))
        rows.append(tuple(entries))
    cols = []
    if split:
        for dt in p.dtypes:
            args = tuple((a.name, dict(a.ctypes)[dt]) for a in split.ptrs)
            args += tuple((q, "float") for q in param_names(op)) + (("rows", "long long"),
                                                                ("cols", "int"))
            for aligned in (True, False):
                name = f"{op.name}_wgrad_cols{'' if aligned else '_unaligned'}_{dt}"
                cols.append(Entry(ir.KernelSig(name, args, dt, "wgrad_cols",
                                               planner.wgrad_cols_launch(p, dt, len(split.stats))
                                               + (("aligned", aligned),)),
                                  planner.CTYPE[dt], aligned))
    reduce = []
    if any(k.wgrads for k in kernels):
        for dt in p.dtypes:
            args = (("partials", "const float*"), ("dw", f"{planner.CTYPE[dt]}*"),
                    ("num_partials", "int"), ("cols", "int"), ("accumulate", "int"))
            reduce.append(Entry(ir.KernelSig(f"{op.name}_wgrad_reduce_{dt}", args, dt,
                                             "wgrad_reduce", planner.WGRAD_REDUCE_LAUNCH),
                                planner.CTYPE[dt], True))
    return rows, tuple(cols), tuple(reduce)


def plan_row(op: ir.DerivedOp) -> RowPlan:
    """Every choice of a row op's kernels: stages, impls, steps, pointers, shapes, entry
    points."""
    p = planner.plan_op(op)
    o = _names(op)
    names = row_constant_names()
    stages, wgrad_step, stats = _stages(o, names, p.fwdbwd)
    kernels = tuple(_kernel(o, st, suffix, steps, lays)
                    for st in stages for suffix, steps, lays in _variants(o, names, st.later))
    split = _wgrad_cols(o, wgrad_step, stats) if wgrad_step else None
    rows, cols, reduce = signatures(op, p, kernels, split)
    return RowPlan(
        op=op.name, template=p.template, dtypes=p.dtypes, params=tuple(param_names(op)),
        row_operands=o.operands, weights=o.weights,
        kernels=tuple(replace(k, entries=e) for k, e in zip(kernels, rows)),
        split=replace(split, entries=cols) if split else None,
        reduce=WgradReduce(planner.REDUCE_X, planner.REDUCE_Y, reduce) if reduce else None)
