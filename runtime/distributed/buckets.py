"""The gradient buckets of data-parallel training: spans of the flat grads arena, each
reduced over the ranks as soon as the backward pass has finished every gradient in it.

The params arena (runtime/model/params.py) holds the decayed matrices in model order, then the
other parameters in model order. The backward runs the blocks last to first, so along the
arena a parameter's gradient is final no later than the one before it, except where the
matrices end and the biases and norm weights begin, and the tied token table, whose
gradient the embedding adds to last. A bucket is a run of consecutive parameters: a new one
starts where a gradient is final later than the one before it, where the bucket holds
`cap` elements already, and after the parameters that are final only at the end, so that
they never hold back earlier ones. Buckets are issued in the order they become final.

ZeRO-1: each bucket is reduce-scattered, rank r owning elements [lo + r·shard, lo +
(r+1)·shard) of it; the rest (the `tail`, fewer than ranks·ALIGN elements) is all-reduced,
and every rank updates it alike. A rank's AdamW moments hold what it owns, bucket after
bucket (`Span.at`), the same number of elements on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass

from eulergen.runtime.model.memory import ALIGN
from eulergen.runtime.model.params import parameters

MIB = 1 << 20


@dataclass(frozen=True)
class Bucket:
    lo: int          # [lo, hi): elements of the grads arena
    hi: int
    ready: int       # the tape node (in backward order) after which its gradients are final
    shard: int = 0   # ZeRO: elements each rank owns of [lo, lo + ranks·shard); 0: no ZeRO

    @property
    def size(self) -> int:
        return self.hi - self.lo

    def share(self, rank: int) -> int:
        """ZeRO: where rank `rank`'s share starts (rank = ranks: where the tail starts)."""
        return self.lo + rank * self.shard


@dataclass(frozen=True)
class Span:
    """A range of the flat arenas a rank updates, `at` its place in the rank's moments;
    `tail`: every rank owns it (its gradient norm is counted once, by rank 0)."""
    lo: int
    hi: int
    at: int
    tail: bool = False


@dataclass(frozen=True)
class BucketPlan:
    buckets: tuple[Bucket, ...]   # in the order they are issued
    nodes: int                    # tape nodes: a bucket ready at nodes - 1 waits for the end
    ranks: int
    zero: bool
    total: int                    # elements of the grads arena

    def owned(self, rank: int) -> tuple[Span, ...]:
        """What rank `rank` updates: without ZeRO the whole arena; with it its slice of
        every bucket, and the bucket's tail."""
        if not self.zero:
            return (Span(0, self.total, 0),)
        spans, at = [], 0
        for b in self.buckets:
            lo = b.share(rank)
            spans.append(Span(lo, lo + b.shard, at))
            at += b.shard
            tail = b.share(self.ranks)
            if tail < b.hi:
                spans.append(Span(tail, b.hi, at, tail=True))
                at += b.hi - tail
        return tuple(s for s in spans if s.hi > s.lo)

    @property
    def moments(self) -> int:
        """Elements of each rank's AdamW moment arenas."""
        return sum(s.hi - s.lo for s in self.owned(0))


def param_ready(a) -> dict[str, int]:
    """Each parameter's gradient's last writer, as an index into the tape's backward order
    (the tied table: the embedding's, the very last node)."""
    names = {s.name for s in parameters(a)}
    ready = {}
    g = a.graph
    for i, (layer, node, _) in enumerate(reversed(g.steps())):
        for name in g.parameter_names(node, layer, names):
            ready[name] = i
    return ready


def plan_buckets(a, ranks: int, *, zero: bool = False, bucket_mb: float = 25.0,
                 itemsize: int = 4) -> BucketPlan:
    """The buckets of an Arch's gradients for `ranks` ranks, each about `bucket_mb` MiB of
    gradients of `itemsize` bytes."""
    layout = a.param_layout
    ready = param_ready(a)
    nodes = len(a.graph.steps())
    cap = max(ALIGN, int(bucket_mb * MIB / itemsize))
    runs: list[list] = []   # [lo, ready] of each bucket, in arena order
    prev = None
    for s, offset in layout.entries:
        r = ready[s.name]
        if (not runs or r > prev or offset - runs[-1][0] >= cap
                or (runs[-1][1] == nodes - 1 and r < nodes - 1)):
            runs.append([offset, r])
        prev = r
    ends = [lo for lo, _ in runs[1:]] + [layout.total]
    buckets = [Bucket(lo, hi, r, _shard(hi - lo, ranks) if zero else 0)
               for (lo, r), hi in zip(runs, ends)]
    buckets.sort(key=lambda b: (b.ready, -b.lo))
    return BucketPlan(tuple(buckets), nodes, ranks, zero, layout.total)


def _shard(size: int, ranks: int) -> int:
    """The elements each rank owns of a bucket of `size`: whole ALIGN blocks (vector access
    stays aligned), the tail left over."""
    return size // (ranks * ALIGN) * ALIGN
