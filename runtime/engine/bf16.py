"""bf16 storage: a bf16 tensor is a uint16 array of bf16 bit patterns (the top half of the
float32 bits; CuPy has no bfloat16 dtype). The generated kernels read and write that form
themselves; what the runtime does to such arrays outside them is here, in one place:
rounding float32 into it, widening it, and the few elementwise steps of a mixed-precision
step that have no op of their own (adding a gradient, the gradient norm's row sums), and
`plan_dtype`, which refuses bf16 where it cannot run.

Each helper has a numpy form, which is the reference (the CPU tests compile the CUDA text
below with g++ and compare it with it), and a CuPy form: one elementwise or row-reduction
kernel that writes into the caller's arrays and allocates nothing (but to_bf16's result
when no `out=` is given). CuPy copies an input that overlaps an output unless it is the
very same array, so in-place calls pass that array twice. Arithmetic is float32,
rounded once to nearest even (ties to even; a NaN stays a quiet NaN), like the generated
kernels' __float2bfloat16_rn.
"""
from __future__ import annotations

import numpy as np

from eulergen.errors import EulerError
from eulergen.runtime.engine.backend import is_cupy

# The device functions every kernel below uses: widen bf16 bits to float, round a float to
# bf16 bits (to_bf16's rule, in integers, so no header is needed under NVRTC).
DEVICE = r"""
__device__ __forceinline__ float eg_widen(unsigned short h) {
  return __uint_as_float(((unsigned int)h) << 16);
}
__device__ __forceinline__ unsigned short eg_round(float f) {
  const unsigned int u = __float_as_uint(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (unsigned short)((u >> 16) | 0x40u);
  return (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
"""

# name -> (in params, out params, operation), as cupy.ElementwiseKernel takes them
ELEMENTWISE = {
    "to_bf16": ("float32 x", "uint16 y", "y = eg_round(x)"),
    "add": ("uint16 a, uint16 b", "uint16 y", "y = eg_round(eg_widen(a) + eg_widen(b))"),
}
# out[r] = ‖g[r, :]‖₂, summed in float32: (in, out, map, reduce, post map, identity) as
# cupy.ReductionKernel takes them. Its parameter names must not occur inside any other
# identifier of the expressions: CuPy substitutes them as text (`g` in `eg_widen` and `s`
# in `sqrtf` were rewritten, and NVRTC refused the result on the H200).
ROW_NORMS = ("uint16 grad_bits", "float32 row_norm", "eg_widen(grad_bits) * eg_widen(grad_bits)",
             "a + b", "row_norm = sqrtf(a)", "0")


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


_kernels: dict = {}


def _kernel(name: str):
    """The CuPy kernel `name`, made on first use (compiled by CuPy at the first call)."""
    if name not in _kernels:
        import cupy
        if name == "row_norms":
            *args, identity = ROW_NORMS
            _kernels[name] = cupy.ReductionKernel(*args, identity, "eg_bf16_row_norms",
                                                  preamble=DEVICE)
        else:
            _kernels[name] = cupy.ElementwiseKernel(*ELEMENTWISE[name], f"eg_bf16_{name}",
                                                    preamble=DEVICE)
    return _kernels[name]


def to_bf16(a, out=None):
    """float32 → bf16 bits (uint16), rounding to nearest, ties to even; NaN stays NaN.
    `out`: a uint16 array of a's shape to write into (returned)."""
    if is_cupy(a):
        import cupy
        a = cupy.ascontiguousarray(a, dtype=cupy.float32)
        out = cupy.empty(a.shape, cupy.uint16) if out is None else out
        _kernel("to_bf16")(a, out)
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


def from_bf16(a):
    """bf16 bits (uint16) → float32, exactly."""
    if is_cupy(a):
        import cupy
        return (cupy.asarray(a, dtype=cupy.uint16).astype(cupy.uint32) << 16).view(cupy.float32)
    return (np.asarray(a, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def bits(value: float) -> int:
    """The bf16 bit pattern of one number, for filling a bf16 array (1.0: 0x3F80, -inf:
    0xFF80): a float assigned into a uint16 array would be converted as an integer."""
    return int(to_bf16(np.float32([value]))[0])


def add(a, b, out) -> None:
    """out = a + b, all bf16 (out may be a or b)."""
    if is_cupy(out):
        _kernel("add")(a, b, out)
    else:
        to_bf16(from_bf16(a) + from_bf16(b), out=out)


def row_norms(g, out) -> None:
    """out[r] = the float32 L2 norm of row r of the bf16 matrix g [R, K] (out [R])."""
    if is_cupy(g):
        _kernel("row_norms")(g, out, axis=1)
    else:
        wide = from_bf16(g)
        np.sqrt(np.einsum("rk,rk->r", wide, wide), out=out)
