"""The optimizer of a run (`training.optimizer`: any update op, ops/adamw.yaml by default):
which update op steps each parameter, over which ranges of the flat arenas, and where its
state lies, planned from the Arch before anything is allocated.

An op's state buffers are its `state` inputs but the weight (adamw's m and v), each
planned as `<op>.<input>` in the `optimizer` arena; they hold the parameters the op steps,
range after range in the params arena's order, so that a parameter's state sits at its
range's `at`. An op with a `rest` op (`rest:` in its spec: lion's adamw, muon's) steps the
Linear weights, its rest op the embeddings (the tied head) and the 1-D parameters; one
with a matrix step (muon: `matrix:`, which needs a rest op) steps each Linear weight alone
(its shape is the step's), its `work` inputs one buffer each, the largest matrix's, and
its Newton-Schulz workspace `<op>.newton_schulz`. On a GPU the matrices' steps run on
LANES CUDA streams at once (runtime/engine/lanes.py: one matrix's GEMMs are too small to
fill the GPU), each matrix on the lane (`Group.lane`) that balances their Newton-Schulz
FLOPs; each lane past the first has work buffers, a workspace and a GEMM workspace of its
own (`<op>.u.1`, `<op>.newton_schulz.1`, `<op>.gemm_ws.1`, ...). The ops of one optimizer read one control
array (step_control.decide writes it): each op's control slots are a prefix of the
longest one's (muon's skip, grad_scale, lr of adamw's skip, grad_scale, lr, step).

With ZeRO-1 (`buckets`), a rank steps its share: every range cut to the spans it owns
(runtime/distributed/buckets.py), its state buffers as large as the largest rank's share.
"""
from __future__ import annotations

import dataclasses
import math

from dataclasses import dataclass

from eulergen.errors import EulerError, suggest
from eulergen.runtime.engine import newton_schulz
from eulergen.runtime.engine.cublas import WORKSPACE_BYTES

KEY = "training.optimizer"
LANES = 4   # CUDA streams a GPU run's matrix steps share (benchmarks/RESULTS.md, "Muon's lanes")


@dataclass(frozen=True)
class UpdateOps:
    """A run's update ops (manifest entries), resolved once: `main`, the one
    training.optimizer names, and, where its spec names one, its `rest` op."""
    main: object
    rest: object = None
    slots: tuple[str, ...] = ()    # the control array's: the longest op's control slots

    @property
    def ops(self) -> tuple:
        return (self.main,) + ((self.rest,) if self.rest is not None else ())


def update_ops(lib, name: str) -> UpdateOps:
    """The update op `name` (and its rest op) from the library, refused with one line
    naming training.optimizer: no such op ("did you mean"), not an update op, a rest op
    that is missing, has a matrix step or a rest op of its own, control slots that
    disagree."""
    main = _update_op(lib, name)
    rest = None
    if main.rest is not None:
        rest = _update_op(lib, main.rest, f" (the rest op of {name})")
        if rest.matrix is not None:
            raise EulerError(f"{name}'s rest op {rest.name!r} has a matrix step; the "
                             "parameters it steps are no matrices", key=KEY)
        if rest.rest is not None:
            raise EulerError(f"{name}'s rest op {rest.name!r} names a rest op of its own "
                             f"({rest.rest!r}); a rest op steps every parameter it is given",
                             key=KEY)
    slots = [lib.control_slots(op) for op in (main, rest) if op is not None]
    longest = max(slots, key=len)
    for op, own in zip((main, rest), slots):
        if tuple(longest[:len(own)]) != tuple(own):
            raise EulerError(f"{op.name}'s control slots {own} are no prefix of {longest}: the "
                             "ops of one optimizer read one control array", key=KEY)
    return UpdateOps(main, rest, tuple(longest))


def _update_op(lib, name: str, what: str = ""):
    updates = sorted(n for n, op in lib.ops.items() if op.kind == "update")
    op = lib.ops.get(name)
    if op is None or op.kind != "update":
        found = f"no op{suggest(name, updates)}" if op is None else f"a {op.kind} op"
        raise EulerError(f"{name!r}{what} is {found}; an optimizer is an update op: "
                         f"{', '.join(updates)}", key=KEY)
    return op


@dataclass(frozen=True)
class Group:
    """One launch of an update op: params arena elements [lo, hi), its state from `at` in
    the op's state buffers; `shape`: a matrix op's parameter, [rows, cols]."""
    op: str
    lo: int
    hi: int
    at: int
    decay: bool
    shape: tuple[int, int] | None = None
    lane: int = 0    # a matrix's: the CUDA stream of its step (0: the step's own)

    @property
    def size(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class OptimizerPlan:
    ops: UpdateOps
    groups: tuple[Group, ...]          # the rank's launches, in order
    owner: tuple[tuple[str, str], ...]  # (parameter, the op that steps it), arena order
    sizes: tuple[tuple[str, int], ...]  # (op, elements of each of its state buffers)
    work: int                          # elements of a work buffer (the largest matrix)
    newton_schulz: int                 # elements of the matrix step's workspace
    lanes: int = 1                     # the matrix steps' CUDA streams

    def op(self, name: str):
        return next(o for o in self.ops.ops if o.name == name)

    def buffers(self) -> list[tuple[str, int]]:
        """The optimizer arena's buffers: (name, elements)."""
        out, sizes = [], dict(self.sizes)
        for op in self.ops.ops:
            for o in state_inputs(op):
                out.append((f"{op.name}.{o.name}", sizes[op.name]))
            if op.matrix is not None:
                for lane in range(self.lanes):
                    out += [(lane_buffer(f"{op.name}.{o.name}", lane), self.work)
                            for o in op.inputs if o.role == "work"]
                    out.append((lane_buffer(f"{op.name}.newton_schulz", lane),
                                self.newton_schulz))
                    if lane:   # the first lane's GEMMs are the model's, on its workspace
                        out.append((lane_buffer(f"{op.name}.gemm_ws", lane),
                                    WORKSPACE_BYTES // 4))
        return [(n, size) for n, size in out if size]


def lane_buffer(name: str, lane: int) -> str:
    """A matrix step's buffer of one lane: the first lane's has the plain name."""
    return f"{name}.{lane}" if lane else name


def lanes_for(gpu: bool) -> int:
    """The matrix steps' lanes of a run: LANES on a GPU, one stream on numpy."""
    return LANES if gpu else 1


def state_inputs(op) -> list:
    """An update op's state buffers: its `state` inputs but the first (the weight)."""
    states = [o for o in op.inputs if o.role == "state"]
    return states[1:]


def plan_optimizer(a, ops: UpdateOps, buckets=None, rank: int = 0,
                   lanes: int = 1) -> OptimizerPlan:
    """The launches and state of `ops` over an Arch's parameters: ranges of one op and one
    weight-decay choice (the decayed matrices lie first: runtime/model/params.py; with a
    rest op, the Linear weights the main op's, the others the rest op's), a matrix op's
    parameters one by one, spread over at most `lanes` streams; with ZeRO-1 `buckets`,
    rank `rank`'s share of them."""
    main, matrix = ops.main, ops.main.matrix is not None
    if matrix and buckets is not None and buckets.zero:
        raise EulerError(f"ZeRO-1 shares the update by elements; {main.name}'s matrix step "
                         "needs whole matrices (training.zero=0)", key="training.zero")
    owner, groups = [], []
    for s, offset in a.param_layout.entries:
        op = main if ops.rest is None or s.linear else ops.rest
        owner.append((s.name, op.name))
        whole = matrix and op is main
        if groups and not whole and groups[-1].shape is None and \
                (groups[-1].op, groups[-1].decay) == (op.name, s.decay):
            continue   # the range goes on
        if groups and groups[-1].shape is None:   # a range ends where the next starts
            groups[-1] = dataclasses.replace(groups[-1], hi=offset)
        groups.append(Group(op.name, offset, offset + math.prod(s.shape), 0, s.decay,
                            tuple(s.shape) if whole else None))
    if groups[-1].shape is None:
        groups[-1] = dataclasses.replace(groups[-1], hi=a.param_layout.total)
    groups, lanes = _on_lanes(groups, lanes)
    ranks = range(buckets.ranks) if buckets is not None and buckets.zero else (0,)
    shares = {r: _share(groups, buckets.owned(r) if buckets is not None else None) for r in ranks}
    sizes = {op.name: max(sum(g.size for g in shares[r] if g.op == op.name) for r in ranks)
             for op in ops.ops}
    shapes = [g.shape for g in groups if g.shape is not None]
    return OptimizerPlan(ops, shares[rank], tuple(owner), tuple(sizes.items()),
                         max((r * c for r, c in shapes), default=0),
                         max((newton_schulz.workspace_elements(*sh) for sh in shapes), default=0),
                         lanes)


def _on_lanes(groups: list[Group], lanes: int) -> tuple[list[Group], int]:
    """The matrices spread over at most `lanes` lanes, the largest first, each to the lane
    least loaded so far by Newton-Schulz FLOPs (so that the lanes end about together); and
    how many lanes that uses."""
    matrices = sorted((i for i, g in enumerate(groups) if g.shape is not None),
                      key=lambda i: -newton_schulz.flops(*groups[i].shape))
    lanes = max(1, min(lanes, len(matrices)))
    load, out = [0] * lanes, list(groups)
    for i in matrices:
        lane = load.index(min(load))
        load[lane] += newton_schulz.flops(*groups[i].shape)
        out[i] = dataclasses.replace(groups[i], lane=lane)
    return out, lanes


def _share(groups: list[Group], owned) -> tuple[Group, ...]:
    """The groups cut to the spans a rank owns (None: all of them), each op's state laid
    out piece after piece in that order."""
    pieces, at = [], {}
    for s in owned if owned is not None else (None,):
        for g in groups:
            lo, hi = (g.lo, g.hi) if s is None else (max(g.lo, s.lo), min(g.hi, s.hi))
            if lo < hi:
                pieces.append(Group(g.op, lo, hi, at.get(g.op, 0), g.decay, g.shape, g.lane))
                at[g.op] = at.get(g.op, 0) + hi - lo
    return tuple(pieces)
