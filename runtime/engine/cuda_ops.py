"""The device state of runtime/engine/ops.py's calls on CuPy arrays: each op's compiled
kernels and the library's own workspaces; the calls themselves are the op kinds'
(runtime/engine/kinds/). And the float32 workspace a call needs, which a memory planner asks
without a GPU.
"""
from __future__ import annotations

import numpy as np

from eulergen.runtime.engine.kernels import Launcher
from eulergen.runtime.engine.manifest import OpEntry
from eulergen.runtime.engine.registry import kind_of


def workspace_elements(op: OpEntry, stage: str, shape, dtype: str = "f32", *,
                       table_rows: int = 0, fusion: str = "", precision: str = "") -> int:
    """The float32 elements a `stage` call of `op` (its `fusion` variant, in the
    `precision` variant: a kind that takes one) needs from a caller's `workspace` (0: none)
    for inputs of `shape` (a row op's row input, a pointwise op's, attention's q [B, T, H,
    D], the embedding's ids, with `table_rows` the rows of its token table). Pure: a memory
    planner calls it without a GPU."""
    kind = kind_of(op)
    return kind.workspace_elements(op, stage, shape, dtype, table_rows=table_rows,
                                   fusion=fusion, **kind.precision_keywords(op, precision))


class CudaOps:
    """What the kinds' CUDA calls keep between calls: each op's compiled kernels and the
    library's own workspaces."""

    def __init__(self):
        self._compiled: dict[tuple, object] = {}
        self._workspaces: dict[tuple, object] = {}

    def compiled(self, op: OpEntry, make=Launcher):
        """The op's kernels as `make(op)` holds them (a Launcher; attention's own), made
        once for each version of its .cu."""
        key = (op.name, str(op.cuda), op.cuda_sha256, make)
        if key not in self._compiled:
            self._compiled[key] = make(op)
        return self._compiled[key]

    def launcher(self, op: OpEntry) -> Launcher:
        return self.compiled(op)

    def own_workspace(self, op: OpEntry, name: str, shape: tuple):
        """A float32 buffer of the kernels' temporaries (a row weight's per-worker partial
        sums, the split backward's per-row values, the embedding's sort keys) when the
        caller gave no workspace; kept between calls: launches on one stream run in order,
        so each call's last kernel has read the buffer before the next call's first writes
        it."""
        import cupy
        key = (op.name, name, shape)
        if key not in self._workspaces:
            self._workspaces[key] = cupy.empty(shape, dtype=np.float32)
        return self._workspaces[key]
