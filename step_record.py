"""A training step's record: the float64 slots the step control keeps on the device, and
the codes its `why` slot holds. The generator prints them into the step kernels
(templates/step_control.cu.j2); the runtime reads and writes the record by them
(runtime/train/step_control.py), so both sides take them from here.

A leaf: it imports nothing of eulergen.
"""
from __future__ import annotations

RECORD = ("lr", "loss_sum", "loss", "norm", "why", "mean", "loss_mean", "norm_mean", "seen",
          "updates")
AT = {name: i for i, name in enumerate(RECORD)}
# `why`: the step's update was applied (0) or skipped, and for what
WHY = {name: code for code, name in enumerate(
    ("applied", "loss_spike", "norm_spike", "bad_loss", "bad_norm"))}
APPLIED, LOSS_SPIKE, NORM_SPIKE, BAD_LOSS, BAD_NORM = WHY.values()
