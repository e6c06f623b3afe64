"""bf16 storage: a bf16 tensor is a uint16 array of bf16 bit patterns (the top half of the
float32 bits; CuPy has no bfloat16 dtype). The generated kernels read and write that form
themselves; what the runtime does to such arrays outside them is here, in one place:
rounding float32 into it, widening it, and the few elementwise steps of a mixed-precision
step that have no op of their own (adding a gradient, the gradient norm's row sums), and
`plan_dtype`, which refuses bf16 where it cannot run.

Each helper has a numpy form, which is the reference, and a kernel of templates/bf16.cu.j2
(hand-written; launched through runtime/engine/kinds/support.py, writing into the caller's
arrays and allocating nothing but to_bf16's result when no `out=` is given; the CPU tests
compile the generated kernels with g++ against the numpy forms). Arithmetic is float32,
rounded once to nearest even (ties to even; a NaN stays a quiet NaN), like the generated
kernels' __float2bfloat16_rn.
"""
from __future__ import annotations

import numpy as np

from eulergen.errors import EulerError
from eulergen.runtime.engine.backend import is_cupy
from eulergen.runtime.engine.kinds import support


def plan_dtype(training_dtype: str, backend) -> str:
    """The plan dtype of `training.dtype` on this backend ("float32" or "bf16"). "auto" is
    bf16 on a GPU with bf16 tensor cores and fp32 elsewhere; an explicit bf16 needs such a
    GPU: anything else is refused, never run in fp32 instead."""
    if training_dtype == "auto":
        return "bf16" if backend.is_gpu and backend.sm >= 80 else "float32"
    if training_dtype != "bf16":
        return "float32"
    if not backend.is_gpu:
        raise EulerError("bf16 needs a CUDA GPU; the numpy backend trains in fp32 only "
                         "(--set training.dtype=fp32)", key="training.dtype")
    if backend.sm < 80:
        raise EulerError(f"bf16 needs a GPU of compute capability 8.0 or newer (bf16 tensor "
                         f"cores), this one is {backend.device}; --set training.dtype=fp32",
                         key="training.dtype")
    return "bf16"


def _check_shapes(call: str, *arrays) -> None:
    """The kernels take their arrays as flat runs of one length: refuse shapes that differ."""
    shapes = [tuple(a.shape) for a in arrays]
    if len(set(shapes)) > 1:
        raise EulerError(f"bf16.{call}: arrays of shapes {shapes}, which must be alike",
                         key=call)


def to_bf16(a, out=None):
    """float32 → bf16 bits (uint16), rounding to nearest, ties to even; NaN stays NaN.
    `out`: a uint16 array of a's shape to write into (returned)."""
    if is_cupy(a):
        import cupy
        a = cupy.ascontiguousarray(a, dtype=cupy.float32)
        out = cupy.empty(a.shape, cupy.uint16) if out is None else out
        _check_shapes("to_bf16", a, out)
        support.launch("bf16", "round", "bf16", {"x": a, "y": out, "n": a.size}, a.size)
        return out
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16
    # A NaN's payload may sit in the low half only; keep it a (quiet) NaN, not infinity.
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    got = np.where(nan, (bits >> 16) | np.uint32(0x40), rounded).astype(np.uint16)
    if out is None:
        return got
    out[...] = got
    return out


def from_bf16(a, out=None):
    """bf16 bits (uint16) → float32, exactly. `out`: a float32 array of a's shape to write
    into (returned; on the GPU a kernel, which allocates nothing)."""
    if is_cupy(a):
        import cupy
        if out is None:
            return (cupy.asarray(a, dtype=cupy.uint16).astype(cupy.uint32) << 16).view(
                cupy.float32)
        _check_shapes("from_bf16", a, out)
        support.launch("bf16", "widen", "bf16", {"x": a, "y": out, "n": a.size}, a.size)
        return out
    got = (np.asarray(a, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
    if out is None:
        return got
    out[...] = got
    return out


def bits(value: float) -> int:
    """The bf16 bit pattern of one number, for filling a bf16 array (1.0: 0x3F80, -inf:
    0xFF80): a float assigned into a uint16 array would be converted as an integer."""
    return int(to_bf16(np.float32([value]))[0])


def add(a, b, out) -> None:
    """out = a + b, all bf16 (out may be a or b)."""
    if is_cupy(out):
        _check_shapes("add", a, b, out)
        support.launch("bf16", "add", "bf16", {"a": a, "b": b, "y": out, "n": out.size},
                       out.size)
    else:
        to_bf16(from_bf16(a) + from_bf16(b), out=out)


def row_norms(g, out) -> None:
    """out[r] = the float32 L2 norm of row r of the bf16 matrix g [R, K] (out [R])."""
    if is_cupy(g):
        if g.ndim != 2 or tuple(out.shape) != g.shape[:1]:
            raise EulerError(f"bf16.row_norms: g {tuple(g.shape)} and out {tuple(out.shape)}, "
                             "expected [R, K] and [R]", key="row_norms")
        rows, cols = g.shape
        support.launch("bf16", "row_norms", "bf16",
                       {"g": g, "norms": out, "rows": rows, "cols": cols}, rows)
    else:
        wide = from_bf16(g)
        np.sqrt(np.einsum("rk,rk->r", wide, wide), out=out)
