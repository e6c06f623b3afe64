"""A training step's scalars, kept on the device: the loss (the micro-steps' sum of the
model's mean loss, runtime/model/loss.py), the gradient clip scale, the spike guard's decision and running
means, the AdamW update count, and a flag for a loss or norm that is not finite. Nothing
here is read by the host during a step, so a captured step (runtime/train/step_graph.py) replays
it; the host reads the record a step later, and at checkpoints.

They live in the step's `record`, a float64 array of eulergen/step_record.py's RECORD slots
(`why` holds one of its WHY codes: applied, or why skipped); `decide` also writes the
update op's `control` array (its kernels read it: OpLibrary.control_slots; float32 on the
GPU, as a scalar argument was passed, float64 on numpy, as a Python float was). The
arithmetic is float64, in the order the host used to do it, so a numpy run and a resume
repeat the old runs' bits: each step has a numpy form (the numpy backend's, and the
reference) and a kernel of templates/step_control.cu.j2 (one thread, every rounding spelled
out: no fused multiply-add), launched through runtime/engine/kinds/support.py;
tests/test_step_control.py compiles the generated kernels with g++ against the numpy forms.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from eulergen.errors import EulerError
from eulergen.runtime.engine.backend import is_cupy
from eulergen.runtime.engine.kinds import support
from eulergen.signature import CONTROL
from eulergen.step_record import APPLIED, AT, BAD_LOSS, BAD_NORM, LOSS_SPIKE, NORM_SPIKE

SPIKE_WARMUP = 10       # accepted steps before the spike guard trusts its running means
SPIKE_DECAY = 0.95      # running means are EMAs with this decay
# the update op's runtime params the trainer fills in its control slots (after signature.CONTROL)
RUNTIME_PARAMS = ("lr", "step")


@dataclass(frozen=True)
class StepRule:
    """What decides a step: the spike factor and clip norm (0: off), the micro-steps whose
    losses are averaged, the data-parallel ranks, whether the gradient norm arrives as the
    ranks' summed squares of their shares (ZeRO-1: `zero`, its root taken here), and where
    in the update op's control array the skip flag, the gradient scale, the learning rate
    and the step count go (-1: the op has no such slot)."""
    spike_factor: float
    grad_clip: float
    micro_steps: int
    ranks: int
    zero: bool
    skip_at: int
    scale_at: int
    lr_at: int
    step_at: int

    @classmethod
    def of(cls, t, slots: tuple[str, ...], ranks: int = 1, zero: bool = False) -> StepRule:
        """The rule of a TrainingConfig for an update op with control slots `slots`."""
        if tuple(slots[:len(CONTROL)]) != CONTROL:
            raise EulerError(f"the optimizer's kernels read control slots {tuple(slots)}, not "
                             f"{', '.join(CONTROL)} first (a stale build: run `eulergen build`)",
                             key="params")
        unknown = [s for s in slots[len(CONTROL):] if s not in RUNTIME_PARAMS]
        if unknown:
            raise EulerError(f"the optimizer's runtime param {unknown[0]!r} is none the trainer "
                             f"sets each step ({', '.join(RUNTIME_PARAMS)})", key="params")
        at = {s: i for i, s in enumerate(slots)}
        return cls(float(t.spike_factor), float(t.grad_clip), int(t.gradient_accumulation),
                   int(ranks), bool(zero), at["skip"], at["grad_scale"], at.get("lr", -1),
                   at.get("step", -1))


def guard_state(record) -> dict:
    """The spike guard's state, as checkpoints hold it (a host copy of the record)."""
    return {"loss_mean": float(record[AT["loss_mean"]]),
            "norm_mean": float(record[AT["norm_mean"]]), "seen": int(record[AT["seen"]])}


def restore(record: np.ndarray, updates: int, guard: dict) -> None:
    """Put a checkpoint's update count and guard state into a host copy of the record."""
    record[AT["updates"]] = int(updates)
    record[AT["loss_mean"]] = float(guard["loss_mean"])
    record[AT["norm_mean"]] = float(guard["norm_mean"])
    record[AT["seen"]] = int(guard["seen"])


def why_skipped(record, spike_factor: float) -> str | None:
    """Why the step of this (host) record was not applied, as the log says it; None: applied."""
    why = int(record[AT["why"]])
    if why == APPLIED:
        return None
    loss, norm, mean = (float(record[AT[k]]) for k in ("loss", "norm", "mean"))
    if why == LOSS_SPIKE:
        return f"loss {loss:.4f} > {spike_factor:g} x running mean {mean:.4f}"
    if why == NORM_SPIKE:
        return f"grad norm {norm:.4f} > {spike_factor:g} x running mean {mean:.4f}"
    return f"{'loss' if why == BAD_LOSS else 'gradient norm'} is " \
           f"{loss if why == BAD_LOSS else norm}"


def not_finite(record) -> bool:
    return int(record[AT["why"]]) in (BAD_LOSS, BAD_NORM)


# -- the numpy forms (the reference) ----------------------------------------------------------

def _numpy_accumulate(record, loss, first: bool) -> None:
    record[AT["loss_sum"]] = (0.0 if first else float(record[AT["loss_sum"]])) + float(loss[0])


def _numpy_rank_loss(record, rule: StepRule, out) -> None:
    out[0] = np.float32(float(record[AT["loss_sum"]]) / rule.micro_steps)


def _numpy_decide(record, control, norm, reduced, rule: StepRule) -> None:
    r = {k: float(record[i]) for k, i in AT.items()}
    loss = (float(reduced[0]) / rule.ranks if rule.ranks > 1
            else r["loss_sum"] / rule.micro_steps)
    norm = math.sqrt(float(norm[0])) if rule.zero else float(norm[0])
    why, mean = APPLIED, 0.0
    if not math.isfinite(loss):
        why = BAD_LOSS
    elif not math.isfinite(norm):
        why = BAD_NORM
    else:
        factor = rule.spike_factor
        if factor > 0 and r["seen"] >= SPIKE_WARMUP:
            if loss > factor * r["loss_mean"]:
                why, mean = LOSS_SPIKE, r["loss_mean"]
            elif norm > factor * r["norm_mean"]:
                why, mean = NORM_SPIKE, r["norm_mean"]
        # spikes join the means too, damped, so that a lasting shift (grad norms grow as
        # the learning rate decays) is absorbed after a few skips instead of skipping forever
        if r["seen"] == 0:
            r["loss_mean"], r["norm_mean"] = loss, norm
        else:
            r["loss_mean"] = SPIKE_DECAY * r["loss_mean"] + (1 - SPIKE_DECAY) * loss
            r["norm_mean"] = SPIKE_DECAY * r["norm_mean"] + (1 - SPIKE_DECAY) * norm
        r["seen"] += 1
    if why == APPLIED:
        r["updates"] += 1
    r.update(loss=loss, norm=norm, why=float(why), mean=mean)
    for k, i in AT.items():
        record[i] = r[k]
    control[rule.skip_at] = float(why != APPLIED)
    clip = rule.grad_clip
    control[rule.scale_at] = clip / norm if clip > 0 and norm > clip else 1.0
    if rule.lr_at >= 0:
        control[rule.lr_at] = r["lr"]
    if rule.step_at >= 0:
        control[rule.step_at] = r["updates"]


# -- on the GPU: templates/step_control.cu.j2's kernels ---------------------------------------

def _launch(call: str, values: dict) -> None:
    support.launch("step_control", call, "f32", values, 1)


def accumulate(record, loss, first: bool) -> None:
    """Add a micro-step's loss (a 1-element float32 array) to the step's sum (its first:
    the sum is that loss)."""
    if is_cupy(record):
        _launch("accumulate", {"rec": record, "loss": loss, "first": first})
    else:
        _numpy_accumulate(record, loss, first)


def rank_loss(record, rule: StepRule, out) -> None:
    """out[0] = this rank's loss in float32: what the ranks sum (data parallel)."""
    if is_cupy(record):
        _launch("rank_loss", {"rec": record, "out": out, "micro": rule.micro_steps})
    else:
        _numpy_rank_loss(record, rule, out)


def decide(record, control, norm, reduced, rule: StepRule) -> None:
    """After backward (and, data parallel, the ranks' sums): the step's loss (the micro-steps'
    mean; over ranks: `reduced`, their float32 sum, / ranks) and gradient norm (`norm`, a
    1-element array; ZeRO-1: the ranks' summed squares, whose root is the norm) into the
    record; a non-finite one, or a spike past the running means, skips the update; the
    running means, the update count, and the update op's `control` slots (skip, clip
    scale, the record's lr, the count) follow."""
    if is_cupy(record):
        _launch("decide", {
            "rec": record, "control": control, "norm_in": norm,
            "reduced": norm if reduced is None else reduced, "factor": rule.spike_factor,
            "decay": SPIKE_DECAY, "warmup": SPIKE_WARMUP, "clip": rule.grad_clip,
            "micro": rule.micro_steps, "ranks": rule.ranks, "zero": rule.zero,
            "skip_at": rule.skip_at, "scale_at": rule.scale_at, "lr_at": rule.lr_at,
            "step_at": rule.step_at})
    else:
        _numpy_decide(record, control, norm, reduced, rule)
