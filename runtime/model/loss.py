"""The batch's loss on the device: the mean of the per-token losses, summed in a fixed order
in float64 (deterministic), allocating nothing, so a captured step replays it. The numpy form
is the reference; tests/test_step_control.py compiles the CUDA text with g++ against it."""
from __future__ import annotations

import numpy as np

from eulergen.runtime.engine.backend import is_cupy

THREADS = 256

CUDA = f"#define EG_LOSS_THREADS {THREADS}\n" + r"""
extern "C" __global__ void __launch_bounds__(EG_LOSS_THREADS) eg_loss_mean(
    const float* losses, float* out, long long n) {
  __shared__ double part[EG_LOSS_THREADS];
  const int t = threadIdx.x;
  double sum = 0.0;
  for (long long i = t; i < n; i += EG_LOSS_THREADS) sum = __dadd_rn(sum, (double)losses[i]);
  part[t] = sum;
  __syncthreads();
  for (int half = EG_LOSS_THREADS / 2; half > 0; half /= 2) {
    if (t < half) part[t] = __dadd_rn(part[t], part[t + half]);
    __syncthreads();
  }
  if (t == 0) out[0] = (float)__ddiv_rn(part[0], (double)n);
}
"""

_kernel = None


def loss_mean(losses, out) -> None:
    """out[0] = the mean of the per-token losses (float32 [N] into float32 [1]). On the
    GPU one block in a fixed order (cupy.mean may take CUB's reduction, whose scratch comes
    from the pool: no allocation may happen in a capture)."""
    global _kernel
    if is_cupy(losses):
        if _kernel is None:
            import cupy
            _kernel = cupy.RawModule(code=CUDA, options=("-std=c++17",)).get_function("eg_loss_mean")
        _kernel((1,), (THREADS,), (losses, out, np.int64(losses.size)))
    else:
        np.mean(losses, keepdims=True, out=out)
