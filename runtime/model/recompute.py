"""training.recompute: what the forward keeps for the backward, and what the backward makes
again (activation recomputation, planned).

`none` keeps every value a block's backward reads, a set per layer (Graph.kept). `blocks`
keeps per layer only what a block reads from the one before it (its `x` and `ln_1`: what
the stem and each block hand on, Graph.handoff) and plans the rest of what a backward reads
once, as `block.<name>`, which every block's forward writes over. Before a block's backward
the tape runs that block's forward again from its x and ln_1: the same tape nodes over the
same buffers and weights, so the same ops in the same order on the same bits, and the
backward reads what it would have read. Two forwards are never re-run: the last block's,
whose values are still there when the backward starts, and each block's closing norm, which
writes only what it hands on (the next block's x and ln_1, kept).

The plan (runtime/model/plan.py) lays out each layer's values by `per_layer` (`own`) and
the one block's (`shared`); the training tape (runtime/model/training_tape.py) reads the mode back
from the plan (`planned`) and wraps the first node of each re-run block's backward in a
`Replay`, so the tape keeps its nodes and their order (data parallel's buckets are issued by
node, runtime/distributed/buckets.py). Imports nothing of the runtime: graph values only.
"""
from __future__ import annotations

NONE, BLOCKS = "none", "blocks"
MODES = (NONE, BLOCKS)
_SHARED = "block."


def own(layer: int, name: str) -> str:
    """The buffer of block value `name` that layer `layer` keeps for itself."""
    return f"h.{layer}.{name}"


def shared(name: str) -> str:
    """The buffer of block value `name` where one block's values serve every block."""
    return _SHARED + name


def per_layer(g, mode: str) -> frozenset[str]:
    """The block values a layer keeps, each in a buffer of its own (`own`):
    every one a backward reads (none), or those the block before it hands on (blocks)."""
    kept = g.kept()
    return kept if mode == NONE else kept & {ours for ours, _ in g.handoff.values()}


def planned(g, memory) -> str:
    """The mode a Memory's plan was made in: the tape follows it."""
    return BLOCKS if any(shared(n) in memory for n in g.kept()) else NONE


def kept_bytes(g, plan) -> int:
    """The bytes of a plan's buffers that hold block values from the forward for the
    backward: each layer's and the one block's."""
    names = {own(layer, n) for layer in range(g.layers) for n in g.kept()}
    names |= {shared(n) for n in g.kept()}
    return sum(plan.buffer(n).nbytes for n in names if n in plan.index)


def rerun(g) -> tuple:
    """The block's nodes a replay runs again: all but those that write only what the
    block hands on."""
    return tuple(n for n in g.block if not set(n.outputs) <= set(g.handoff))


def rerun_layers(layers: int, mode: str) -> int:
    """The blocks whose forward a step runs twice: every one but the last (blocks)."""
    return max(layers - 1, 0) if mode == BLOCKS else 0


class Replay:
    """A tape node whose backward first runs `again` (tape nodes, in forward order: its
    block's forward), then its own."""

    def __init__(self, node, again):
        self.node, self.again = node, tuple(again)

    def forward(self, tape) -> None:
        self.node.forward(tape)

    def backward(self, tape) -> None:
        for node in self.again:
            node.forward(tape)
        self.node.backward(tape)


def replayed(g, steps, nodes, mode: str) -> list:
    """The tape's `nodes` (one per step of g.steps(), in that order) with the first node in
    backward order of each block whose forward `mode` runs twice wrapped in a Replay of
    that block's forward."""
    again, twice = rerun(g), rerun_layers(g.layers, mode)
    forward: dict[int, list] = {}
    first: dict[int, int] = {}   # layer -> its last step in forward order
    for i, ((layer, node, _), tape_node) in enumerate(zip(steps, nodes, strict=True)):
        if layer is not None and 0 <= layer < twice:
            if node in again:
                forward.setdefault(layer, []).append(tape_node)
            first[layer] = i
    out = list(nodes)
    for layer, i in first.items():
        out[i] = Replay(out[i], forward.get(layer, ()))
    return out
