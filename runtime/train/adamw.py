"""AdamW from ops/adamw.yaml over the model's flat arenas: its update kernels launched
over ranges of the params, grads and moment arenas, reading the step's control array, and
its moments as a checkpoint holds them (by parameter name, whole: with ZeRO-1 gathered to
rank 0 and split again on a resume, so a checkpoint does not depend on the world size)."""
from __future__ import annotations

import numpy as np

from eulergen.errors import EulerError
from eulergen.runtime.distributed.buckets import Span
from eulergen.runtime.train.config import TrainingConfig
from eulergen.runtime.model.memory import upload
from eulergen.runtime.model.gpt import GPT


class AdamW:
    """`lib.step("adamw", …)` over the flat parameter buffer: a launch over the decayed
    matrices (laid out first by the planner) and one over the rest with weight_decay 0,
    for each span the rank updates (ZeRO-1, `shards`: its share, runtime/distributed/data_parallel.py,
    whose moments lie span after span in the moment arenas; else the whole buffer). The
    learning rate, the update count (bias correction counts applied updates only), whether
    to skip and the clip scale come from an array on the device (`control`, in the op's
    `slots`: step_control.decide writes them). The float32 master weights and moments are
    updated (from bf16 gradients in a bf16 run: the op's bf16 kernel, which writes the
    model's bf16 copy of the same span in the same pass)."""

    def __init__(self, model: GPT, t: TrainingConfig, shards=None):
        self.model, self.t, self.shards = model, t, shards
        plan, mem = model.mem.plan, model.mem
        rest = [s.name for s in model.specs if not s.decay]
        decay_end = plan.span(rest)[0] if rest else plan.arena("params").size
        spans = shards.owned if shards else (Span(0, plan.arena("params").size, 0),)
        self.groups = []
        for s in spans:
            for lo, hi, wd in ((s.lo, min(s.hi, decay_end), t.weight_decay),
                               (max(s.lo, decay_end), s.hi, 0.0)):
                if lo < hi:
                    at = s.at + lo - s.lo
                    arrays = (mem.arenas["params"][lo:hi], mem.arenas["grads"][lo:hi],
                              mem.arenas["adam_m"][at:at + hi - lo],
                              mem.arenas["adam_v"][at:at + hi - lo])
                    copy = mem.arenas["params_bf16"][lo:hi] if model.bf16 else None
                    self.groups.append((arrays, copy, wd))
        self.op = model.lib.op("adamw")
        self.slots = model.lib.control_slots(self.op)

    def step(self, control) -> None:
        t = self.t
        for (p, g, m, v), copy, wd in self.groups:
            self.model.lib.step(self.op, p, g, m, v, control=control, copy=copy, beta1=t.beta1,
                                beta2=t.beta2, eps=t.adam_eps, weight_decay=wd)

    def state_dict(self) -> dict:
        """The moments by parameter name, whole (ZeRO: gathered to rank 0; the other ranks
        get {})."""
        mem, out = self.model.mem, {}
        flats = {a: self.model.backend.asnumpy(mem.arenas[a]) for a in ("adam_m", "adam_v")}
        if self.shards:
            flats = {a: self.shards.gather(f, f"the {a} gather") for a, f in flats.items()}
        for arena, prefix in (("adam_m", "m"), ("adam_v", "v")):
            flat = flats[arena]
            if flat is None:   # ZeRO: a rank other than 0
                return {}
            for s in self.model.specs:
                b = mem.plan.buffer(s.name)
                out[f"{prefix}.{s.name}"] = flat[b.offset:b.offset + b.size].reshape(b.shape).copy()
        return out

    def load_state_dict(self, state: dict) -> None:
        mem = self.model.mem
        for arena, prefix in (("adam_m", "m"), ("adam_v", "v")):
            flat = np.zeros(mem.plan.arena("params").size, mem.arenas[arena].dtype)
            for s in self.model.specs:
                b = mem.plan.buffer(s.name)
                if f"{prefix}.{s.name}" not in state:
                    raise EulerError(f"optimizer state lacks {prefix}.{s.name}", key="checkpoint")
                flat[b.offset:b.offset + b.size] = state[f"{prefix}.{s.name}"].reshape(-1)
            upload(mem.arenas[arena], self.shards.compact(flat) if self.shards else flat)
