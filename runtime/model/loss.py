"""The batch's loss on the device: the mean of the per-token losses, summed in a fixed order
in float64 (deterministic), allocating nothing, so a captured step replays it. The numpy
form is the reference; the kernel is templates/step_control.cu.j2's `loss_mean`, which
tests/test_step_control.py compiles with g++ against it."""
from __future__ import annotations

import numpy as np

from eulergen.runtime.engine.backend import is_cupy
from eulergen.runtime.engine.kinds import support


def loss_mean(losses, out) -> None:
    """out[0] = the mean of the per-token losses (float32 [N] into float32 [1]). On the
    GPU one block in a fixed order (cupy.mean may take CUB's reduction, whose scratch comes
    from the pool: no allocation may happen in a capture)."""
    if is_cupy(losses):
        support.launch("step_control", "loss_mean", "f32",
                       {"losses": losses, "out": out, "n": losses.size}, 1)
    else:
        np.mean(losses, keepdims=True, out=out)
