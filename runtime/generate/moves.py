"""Moving rows by indices held on the device, for the KV-cache decoder: a step's keys,
values and token ids written at their positions, and one row of each sequence taken out.
The positions and the index are device values (written before a run, advanced by a
decode step), so one captured step serves every position (runtime/engine/cuda_graph.py).

No math happens here: each is a copy. Each has a numpy form and a CuPy form (one
ElementwiseKernel, made on first use, allocating nothing), as runtime/engine/bf16.py's helpers.
"""
from __future__ import annotations

from math import prod

import numpy as np

# dst [B, S, …] (contiguous) at dst[b, positions[b, t]] = src[b, t] (src [B, T, …], any
# strides; positions [B, T] contiguous): `width` elements a row, `rows` = T, `seq` = S
SCATTER = ("T src, raw int32 positions, int64 rows, int64 width, int64 seq", "raw T dst",
           "const long long bt = i / width;"
           "dst[((bt / rows) * seq + positions[bt]) * width + i % width] = src")
# y [B, width] = x[b, index[0]] of x [B, rows, width] (contiguous)
TAKE = ("raw T x, raw int32 index, int64 rows, int64 width", "T y",
        "y = x[((i / width) * rows + index[0]) * width + i % width]")

_kernels: dict = {}


def _kernel(name: str):
    if name not in _kernels:
        import cupy
        _kernels[name] = cupy.ElementwiseKernel(*{"scatter": SCATTER, "take": TAKE}[name],
                                                f"eg_{name}_rows")
    return _kernels[name]


def scatter_rows(src, positions, dst) -> None:
    """dst[b, positions[b, t]] = src[b, t] for every b, t (a step's k or v into the cache)."""
    B, T = positions.shape
    if isinstance(dst, np.ndarray):
        dst[np.arange(B)[:, None], positions] = src
        return
    width = prod(src.shape[2:])
    _kernel("scatter")(src, positions, T, width, dst.shape[1], dst)


def take_row(x, index, out) -> None:
    """out[b] = x[b, index[0]] (x [B, rows, …] contiguous, index a 1-element int32 array)."""
    if isinstance(x, np.ndarray):
        out[...] = x[:, int(index[0])]
        return
    _kernel("take")(x, index, x.shape[1], prod(x.shape[2:]), out)
