"""Moving rows by indices held on the device, for the KV-cache decoder: a run's token ids
written at their positions (`held`), a prefill's keys and values into the cache (a later
run's go in inside the decode attention kernel), and one row of each sequence taken out.
The positions and the index are device values (written before a run, advanced by a
decode step), so one captured step serves every position (runtime/engine/cuda_graph.py).

No math happens here: each is a copy. Each has a numpy form and a kernel of
templates/moves.cu.j2 (launched through runtime/engine/kinds/support.py, allocating
nothing), in the storage dtype's kernels; int32 token ids move as 4-byte words through the
float32 ones (a copy keeps every bit).
"""
from __future__ import annotations

from math import prod

import numpy as np

from eulergen.errors import EulerError
from eulergen.runtime.engine.kernels import storage_dtype_name
from eulergen.runtime.engine.kinds import support


def _words(*arrays) -> tuple:
    """Arrays as the kernels' storage: int32 as float32 words, the others as they are."""
    return tuple(a.view(np.float32) if a.dtype == np.int32 else a for a in arrays)


def _rows_contiguous(a) -> bool:
    """Whether each [b, t] row of a [B, T, …] is one contiguous run (its strides may not be)."""
    step = a.itemsize
    for n, stride in zip(reversed(a.shape[2:]), reversed(a.strides[2:])):
        if n > 1 and stride != step:
            return False
        step *= n
    return True


def scatter_rows(src, positions, dst) -> None:
    """dst[b, positions[b, t]] = src[b, t] for every b, t (ids into `held`, k or v into
    the cache):
    src [B, T, …] whose rows are contiguous (any b, t strides), positions [B, T] int32 and
    dst [B, S, …] contiguous."""
    B, T = positions.shape
    if isinstance(dst, np.ndarray):
        dst[np.arange(B)[:, None], positions] = src
        return
    if (tuple(src.shape[:2]) != (B, T) or dst.shape[0] != B
            or tuple(dst.shape[2:]) != tuple(src.shape[2:])):
        raise EulerError(f"scatter_rows: src {tuple(src.shape)}, positions {(B, T)}, dst "
                         f"{tuple(dst.shape)}: expected [B, T, …], [B, T], [B, S, …]",
                         key="scatter_rows")
    if not (_rows_contiguous(src) and positions.flags.c_contiguous and dst.flags.c_contiguous):
        raise EulerError("scatter_rows: src's rows, positions and dst must be contiguous",
                         key="scatter_rows")
    src, dst = _words(src, dst)
    width = prod(src.shape[2:])
    support.launch("moves", "scatter", storage_dtype_name(dst), {
        "src": src, "src_sb": src.strides[0] // src.itemsize,
        "src_st": src.strides[1] // src.itemsize, "positions": positions, "dst": dst,
        "rows": T, "width": width, "seq": dst.shape[1], "n": B * T * width},
        B * T * width, contiguous=False)


def take_row(x, index, out) -> None:
    """out[b] = x[b, index[0]] (x [B, rows, …] contiguous, index a 1-element int32 array)."""
    if isinstance(x, np.ndarray):
        out[...] = x[:, int(index[0])]
        return
    if out.shape[0] != x.shape[0] or tuple(out.shape[1:]) != tuple(x.shape[2:]):
        raise EulerError(f"take_row: x {tuple(x.shape)}, out {tuple(out.shape)}: expected "
                         "[B, rows, …] and [B, …]", key="take_row")
    x, out = _words(x, out)
    support.launch("moves", "take", storage_dtype_name(out), {
        "x": x, "index": index, "y": out, "rows": x.shape[1], "width": prod(x.shape[2:]),
        "n": out.size}, out.size)
