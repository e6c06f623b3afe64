"""Column sums on the GPU: out (+)= Σ_r x[r, :] for x [rows, cols] (templates/colsum.cu.j2),
a Linear layer's bias gradient 1ᵀ·dy where cuBLASLt's bias-gradient epilogue does not write
it (runtime/model/tape.py). The tape's numpy form is the GEMM against a row of ones; here
row groups write float32 partial rows into the caller's workspace (the model's planned
kernel workspace) and the reduce adds them in a fixed order and rounds once to out's
dtype, so the same call gives the same bits at every run."""
from __future__ import annotations

from eulergen.runtime.engine.kernels import storage_dtype_name
from eulergen.runtime.engine.kinds import support
from eulergen.runtime.engine.launch_args import carve

NAME = "colsum"


def _aligned(x) -> bool:
    """Rows of whole 16-byte vectors at 16-byte addresses, as the aligned kernel reads."""
    ld = x.strides[0] * (x.shape[0] > 1)
    return x.data.ptr % 16 == 0 and ld % 16 == 0 and x.shape[1] * x.itemsize % 16 == 0


def _partials(op, dtype: str, rows: int, cols: int, aligned: bool) -> int:
    return op.kernel("partials", dtype, aligned=aligned).geometry.launch(rows, cols).partials


def colsum(x, out, *, workspace, add: bool = False) -> None:
    """out = Σ_r x[r, :] (+ out, with add) for x a 2-D GPU array with unit column stride and
    out `cols` contiguous elements of float32 or x's dtype; `workspace` a float32 array of
    at least what cuda_ops.workspace_elements(entry, "partials", (rows, cols), dtype) says
    (the model plans it)."""
    rows, cols = x.shape
    op = support.entry(NAME)
    dtype, aligned = storage_dtype_name(x), _aligned(x)
    groups = _partials(op, dtype, rows, cols, aligned)
    (partials,) = carve(op, workspace, [(groups, cols)])
    support.launch(NAME, "partials", dtype, {
        "x": x, "ld": x.strides[0] // x.itemsize, "partials": partials, "rows": rows,
        "cols": cols}, rows, cols, contiguous=False, aligned=aligned)
    support.launch(NAME, "reduce", storage_dtype_name(out), {
        "partials": partials, "dw": out, "num_partials": groups, "cols": cols,
        "accumulate": int(add)}, cols)
