"""The schedule of a row op's stages (templates/row.cu.j2): which sweeps, picks and per-row
steps each stage takes, in order, as frozen values that generator/plan_row.py puts into its
kernels and tests inspect without Jinja.

A stage (forward, backward, fwdbwd, the split backward's backward_rows) forms the reductions
its later steps read: one sweep per level, a sum that rescales with a stabilizer max in the
max's sweep (ir.Online; block-per-row kernels only, warp-per-row ones keep the two-pass form,
so a stage where one joins has a second device impl, `<op>_<stage>_online`), a sum that is
one column's value read at that column (ir.Pick), and the backward's adjoint sums in the
sweep after the last one forming a reduction they read (derive has taken their row-constant
factors out). Every per-element step computes its row-invariant parts once per row
(generator/hoist.py); their names (`r0_, r1_, …`, unique in the op) are drawn from one
iterator in the order the steps are made here.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator

from eulergen.errors import EulerError
from eulergen.generator import ir
from eulergen.generator.emit import Block, block, param_names
from eulergen.generator.hoist import hoist
from eulergen.generator.printer import cuda_expr


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
    direct: tuple[str, ...] = ()  # operands a cached group reads from the row all the same
                                  # (plan_row: registers cache what several sweeps read)


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
    # an autocast kernel's (plan_row): each pointer's element type, and the stores also
    # written rounded to bf16 (store, its copy's pointer) where that pointer is not null
    elems: tuple[tuple[str, str], ...] = ()
    copies: tuple[tuple[str, str], ...] = ()

    @property
    def mixed(self) -> bool:
        return bool(self.elems)

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
    """Where a kernel's rows go: a warp a row, or a block that holds it, or any block."""
    name: str       # 'warp_per_row' | 'block_held' | 'block_per_row'
    suffix: str     # of the entry points' names
    warp: bool      # one warp a row (the impl's WARP)


# A block_held kernel holds its row in registers, as a warp does: it takes the two-pass impl
# too (generator/plan.py, HELD_SLOTS).
LAYOUTS = (RowLayout("warp_per_row", "", True), RowLayout("block_held", "_held", False),
           RowLayout("block_per_row", "_block", False))


@dataclass(frozen=True)
class RowNames:
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


def row_names(op: ir.DerivedOp) -> RowNames:
    where = dict(file=op.where.file, line=op.where.line)
    for o in op.inputs + op.outputs:
        if o.role not in ("row", "weight", "index", "scalar"):
            raise EulerError(f"row op operand {o.name!r} has role {o.role!r}", key="inputs", **where)

    def of(ops, role, prefix="", differentiable=False):
        return tuple(f"{prefix}{o.name}" for o in ops
                     if o.role == role and (o.differentiable or not differentiable))
    return RowNames(op, of(op.inputs, "row"), of(op.inputs, "weight"), of(op.inputs, "index"),
                    of(op.outputs, "row"), of(op.outputs, "scalar"), of(op.outputs, "row", "d"),
                    of(op.outputs, "scalar", "d"), of(op.inputs, "row", "d", True),
                    of(op.inputs, "weight", "d", True))


def _uses(*blocks) -> frozenset[str]:
    out: set[str] = set()
    for b in blocks:
        if b is not None:
            out |= b.uses
    return frozenset(out)


def _loads(o: RowNames, uses) -> Loads:
    return Loads(tuple(a for a in o.operands if a in uses),
                 tuple(w for w in o.weights if w in uses), "i" in uses)


def _sweep(o: RowNames, names: Iterator[str], code: ir.Code, with_outputs: bool, *,
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


def _reads_outputs(o: RowNames, code: ir.Code) -> bool:
    return bool(code.uses & set(o.elem_out))


def _pass(o: RowNames, names: Iterator[str], ps: ir.Pass, online: tuple[ir.Online, ...] = ()) -> Sweep:
    return _sweep(o, names, ps.body, _reads_outputs(o, ps.body), online=online,
                  ops=tuple(tuple(x) for x in ps.ops))


def _elements(o: RowNames, names: Iterator[str], code: ir.Code, stores, wgrads,
              outputs: bool = False) -> Sweep:
    return _sweep(o, names, code, not outputs and _reads_outputs(o, code), stores=tuple(stores),
                  wgrads=tuple(wgrads))


def _pick(o: RowNames, pk: ir.Pick) -> Pick:
    b = block(pk.value, declare=False)
    uses = b.uses | {pk.index}
    return Pick(b, pk.index, _loads(o, uses), uses)


# A stage computes the reductions its later steps read (and what those read): a pick from its
# one column, the others one sweep per level, except that an online sum joins its max's
# sweep: one sweep fewer where it was its level's only reduction. Online sums join only in
# the block-per-row kernels, whose rows are re-read each sweep; a warp holds its row in
# registers, where the two-pass form ran faster (benchmarks/RESULTS.md, "Why the row
# planner's constants are what they are": online sums).
def reductions(o: RowNames, names: Iterator[str], later: list[Step], online: bool) -> list[Step]:
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
class Stage:
    name: str
    later: tuple[Step, ...]     # its steps after the reductions
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    wgrads: tuple[str, ...]
    row_stats: tuple[str, ...] = ()


def stages(o: RowNames, names: Iterator[str], fwdbwd: bool) -> tuple[list[Stage], Sweep | None,
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
    adjoint_sums = body.adjoint_pass.body if body.adjoint_pass else None
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
    stages = [Stage("forward", forward, reads, o.elem_out + o.row_out, ())]
    if o.d_rows or o.d_weights:
        before = (per_row(()),) if needs_row_out else ()
        stages.append(Stage("backward", before + grad_steps, reads + o.d_elem_out + o.d_row_out,
                             o.d_rows, o.d_weights))
        if fwdbwd:
            stages.append(Stage("fwdbwd", (per_row(o.row_out),) + grad_steps,
                                 reads + o.d_row_out, o.row_out + o.d_rows, o.d_weights))
        if o.d_weights:
            # The split backward of long rows (plan.WGRAD_SPLIT_COLS): a block per row writes
            # the input grads and the per-row values the weight-gradient terms read (so the
            # row forms those too); a column kernel sums those terms over rows (wgrad_cols).
            rows_elem = _elements(o, names, grads.only(set(o.d_rows)), grad_elems.stores, [])
            rows_elem = replace(rows_elem, uses=rows_elem.uses | set(stats))
            stages.append(Stage("backward_rows",
                                 before + (adjoints, RowStats(stats, frozenset(stats)), rows_elem),
                                 reads + o.d_elem_out + o.d_row_out, o.d_rows, (), stats))
    return stages, wgrad_step, stats


def variants(o: RowNames, names: Iterator[str], later: tuple[Step, ...]):
    """(impl suffix, steps, the layouts it serves): the two-pass impl for every layout,
    unless an online sum joins one of the stage's sweeps; then block_per_row has its own
    `_online` impl."""
    two_pass = reductions(o, names, list(later), False) + list(later)
    online = reductions(o, names, list(later), True) + list(later)
    if any(getattr(s, "online", ()) for s in online):
        return [("", two_pass, LAYOUTS[:2]), ("_online", online, LAYOUTS[2:])]
    return [("", two_pass, LAYOUTS)]
