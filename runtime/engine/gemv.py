"""GEMMs of a few rows on the GPU, for the decoder: out (+)= x·wᵀ (+ b) for x of at most
`max_rows()` rows (templates/gemv.cu.j2), and `SmallRows`, the decoder's GEMM, which sends
each product these kernels take to them and every other to the process's GEMM (gemm.py).
The same product with a pointwise op applied, out = act(x·wᵀ + b), where the op `fuses`:
the kernels of its `gemv` variant, in its own .cu (generator/kinds/pointwise.py).

A decode step's Linear layers are GEMMs of B rows (one a sequence) against the whole
weight: reading w is all their work. cuBLASLt runs them as tensor-core tiles that are mostly
padding and, for the narrow outputs, as split-K with a reduction kernel after; here a block
reads one to four rows of w once and every row of x against each. The contract is
numpy_gemm's for tb=True (w as nn.Linear holds it): the sum in float32, the bias and the old
out (add) added to it, one rounding to out's dtype. bf16 x and w may write float32 (the
logits), without a bias, as LtGemm. With an activation, the op (its spec's code, printed by
the generator) reads the float32 sum as out's dtype stores it, and the bias, as the unfused
pair does (this GEMM writing x·wᵀ, then the op's bias variant): the same bits, one kernel.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from eulergen.launch import cdiv
from eulergen.runtime.engine.backend import sm_count
from eulergen.runtime.engine.kernels import NULL, Launcher, storage_dtype_name
from eulergen.runtime.engine.kinds import support

_VECTOR_BYTES = 16   # the kernels' loads
_COLS = (4, 2, 1)    # output columns a block can take (its 4 warps split among them)
# Blocks a launch wants per SM before it packs more columns into a block: with fewer, the
# warps reading w are too few to keep the loads in flight that memory bandwidth needs.
BLOCKS_PER_SM = 8
FUSION = "gemv"      # a pointwise op's variant of these kernels (its kernels' `fusion`)


@lru_cache(maxsize=1)
def bounds() -> tuple[int, ...]:
    """The row bounds of the built kernels, ascending (the planner's, from the manifest)."""
    return tuple(sorted({k.geometry.rows for k in support.entry("gemv").kernels.values()}))


def max_rows() -> int:
    return bounds()[-1]


def fuses(act) -> bool:
    """Whether the pointwise op `act` (an OpEntry) has the kernels of its `gemv` variant, which
    apply it to the sum: an op of one input and one output, built with them."""
    return any(k.fusion == FUSION for k in act.kernels.values())


@lru_cache(maxsize=None)
def _launcher(act) -> Launcher:
    """The op's Launcher (its .cu compiled through compile.py's cache, so a module the
    process loaded already is not loaded again)."""
    return Launcher(act)


def _aligned(a) -> bool:
    """A 2-D array whose rows are whole 16-byte vectors at 16-byte addresses."""
    return (a.ndim == 2 and a.strides[1] == a.itemsize and a.data.ptr % _VECTOR_BYTES == 0
            and (a.strides[0] * (a.shape[0] > 1)) % _VECTOR_BYTES == 0
            and (a.shape[1] * a.itemsize) % _VECTOR_BYTES == 0)


def takes(x, w, out, bias=None) -> bool:
    """Whether the kernels compute out = x·wᵀ (+ bias) for these arrays as they lie."""
    rows, k = x.shape if x.ndim == 2 else (0, 0)
    wide = out.dtype == np.float32 and x.dtype == np.uint16
    return (0 < rows <= max_rows() and x.dtype == w.dtype and x.dtype in (np.float32, np.uint16)
            and (out.dtype == x.dtype or wide and bias is None)
            and w.ndim == 2 and w.shape[1] == k and out.shape == (rows, w.shape[0])
            and out.strides[1] == out.itemsize and _aligned(x) and _aligned(w)
            and (bias is None or (bias.dtype == out.dtype and bias.size == w.shape[0]
                                  and bias.flags.c_contiguous)))


def columns(n: int, sms: int) -> int:
    """Output columns a block for n of them on `sms` SMs: the most that still leaves
    BLOCKS_PER_SM blocks an SM (a block a column below that)."""
    return next((c for c in _COLS if cdiv(n, c) >= BLOCKS_PER_SM * sms), 1)


def gemv(x, w, out, *, bias=None, add: bool = False, act=None, params=None) -> None:
    """out = x·wᵀ (+ bias) (+ out, with add) on the GPU, for arrays `takes` accepts; with
    `act`, a pointwise op that `fuses`, out = act(x·wᵀ + bias) instead (no add), its
    `params` (every one the op declares) by name."""
    rows, k = x.shape
    dtype = storage_dtype_name(x)
    n = w.shape[0]
    bound = next(r for r in bounds() if r >= rows)
    cols = columns(n, sm_count())
    values = {"x": x, "ldx": x.strides[0] // x.itemsize, "w": w,
              "ldw": w.strides[0] // w.itemsize, "b": NULL if bias is None else bias, "y": out,
              "ldy": out.strides[0] // out.itemsize, "rows": rows, "n": n, "k": k, "cols": cols}
    if act is None:
        stage = "gemv" if out.dtype == x.dtype else "gemv_f32_out"
        support.launch("gemv", stage, dtype, {**values, "beta": 1.0 if add else 0.0}, n, cols,
                       contiguous=False, rows=bound)
        return
    kernel = act.kernel("forward", dtype, fusion=FUSION, rows=bound)
    _launcher(act).launch(kernel, kernel.geometry.launch(n, cols),
                          {**values, **(params or {})}, contiguous=False)


class SmallRows:
    """The decoder's GEMM on a GPU: out (+)= x·wᵀ (+ bias) by `gemv` where it takes the
    arrays, every other call (and every other form: transposed a, alpha, beta, dbias) by
    `inner`, whose epilogues it states as its own."""

    def __init__(self, inner):
        self.inner, self.epilogues = inner, inner.epilogues

    def __call__(self, a, b, out, *, tb: bool = False, add: bool = False, bias=None, **rest):
        if tb and not rest and takes(a, b, out, bias):
            gemv(a, b, out, bias=bias, add=add)
            return
        if bias is not None:
            rest["bias"] = bias
        self.inner(a, b, out, tb=tb, add=add, **rest)
