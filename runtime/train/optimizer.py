"""The optimizer over the model's flat arenas: its update ops (`training.optimizer`,
runtime/model/optimizer_plan.py) launched over ranges of the params, grads and optimizer
arenas (a matrix op over each matrix alone), all reading the step's one control array,
and their state as a checkpoint holds it: `<state>.<param>` (adamw's m.<param> and
v.<param>), whole (with ZeRO-1 gathered to rank 0 and split again on a resume, so a
checkpoint does not depend on the world size)."""
from __future__ import annotations

import numpy as np

from eulergen.errors import EulerError
from eulergen.runtime.model.gpt import GPT
from eulergen.runtime.model.memory import upload
from eulergen.runtime.engine.gemm import gemm_for
from eulergen.runtime.engine.lanes import Lanes
from eulergen.runtime.model.optimizer_plan import (UpdateOps, lane_buffer, lanes_for,
                                                   plan_optimizer, state_inputs)
from eulergen.runtime.train.config import TrainingConfig

# training keys an update op's params of these names take (None there: the op's default)
FROM_CONFIG = {"beta1": "beta1", "beta2": "beta2", "eps": "adam_eps"}


class Optimizer:
    """`lib.step(op, …)` for each of the plan's groups (ZeRO-1, `shards`: the rank's share,
    runtime/distributed/data_parallel.py; else every parameter). The learning rate, the
    update count (adamw's bias correction counts applied updates only), whether to skip
    and the clip scale come from an array on the device (`control`, in `slots`:
    step_control.decide writes them). The float32 master weights and state are updated
    (from bf16 gradients in a bf16 run: the ops' bf16 kernels, which write the model's bf16
    copy of the same range in the same pass). An op's `weight_decay` is the config's on
    the decayed parameters (the matrices) and 0 on the rest. A matrix op steps each matrix
    on its lane's stream (runtime/engine/lanes.py), in a bf16 run iterating in bf16."""

    def __init__(self, model: GPT, ops: UpdateOps, t: TrainingConfig, shards=None):
        self.model, self.ops, self.shards = model, ops, shards
        self.plan = plan_optimizer(model.arch, ops, shards.plan if shards else None,
                                   rank=shards.rank if shards else 0,
                                   lanes=lanes_for(model.backend.is_gpu))
        self.lanes = Lanes(model.backend, self.plan.lanes)
        self.slots = ops.slots
        mem = model.mem
        missing = [n for n, _ in self.plan.buffers() if n not in mem]
        if missing:
            raise EulerError(f"the model's plan holds no {missing[0]} (build or plan the "
                             "model with optimizer=)", key="training.optimizer")
        # each op's own control slots: the first of the shared array's (update_ops checks)
        own = {op.name: len(model.lib.control_slots(op)) for op in ops.ops}
        self.launches, self.lane_of = [], []   # each launch, and its lane
        gemms = {0: model.tape.gemm}
        for g in self.plan.groups:
            op = self.plan.op(g.op)
            arrays = [self._array(op, o, g) for o in op.inputs]
            copy = mem.arenas["params_bf16"][g.lo:g.hi] if model.bf16 else None
            extra = {}
            if g.shape is not None:   # one matrix: [rows, cols] views, its lane's GEMMs
                copy = None if copy is None else copy.reshape(g.shape)
                if g.lane not in gemms:   # the model's GEMM, on the lane's own workspace
                    gemms[g.lane] = gemm_for(model.backend, model.tape.gemm.tf32,
                                             mem[lane_buffer(f"{op.name}.gemm_ws", g.lane)])
                extra = {"gemm": gemms[g.lane],
                         "workspace": mem[lane_buffer(f"{op.name}.newton_schulz", g.lane)],
                         "half": model.bf16}   # a bf16 run iterates in bf16
            self.launches.append((op, arrays, copy, own[op.name],
                                  {**_params(op, t, g.decay), **extra}))
            self.lane_of.append(g.lane)

    def _array(self, op, o, g):
        """The view of input `o` of `op` that group g's launch takes."""
        mem, n = self.model.mem, g.size
        if o.role == "grad":
            a = mem.arenas["grads"][g.lo:g.hi]
        elif o.role == "work":
            a = mem[lane_buffer(f"{op.name}.{o.name}", g.lane)][:n]
        elif o in state_inputs(op):
            a = mem[f"{op.name}.{o.name}"][g.at:g.at + n]
        else:   # the weight
            a = mem.arenas["params"][g.lo:g.hi]
        return a if g.shape is None else a.reshape(g.shape)

    def step(self, control) -> None:
        lib = self.model.lib
        with self.lanes.forked() as on:
            for (op, arrays, copy, own, params), lane in zip(self.launches, self.lane_of):
                with on(lane):
                    lib.step(op, *arrays, control=control[:own], copy=copy, **params)

    # -- checkpoints: whole tensors by name ------------------------------------------------

    def _groups(self, op):
        """The groups whose state lies in op's buffers."""
        return [g for g in self.plan.groups if g.op == op.name]

    def _states(self):
        """(op, state input, the parameters it steps) of each state buffer."""
        owners = self.plan.owner
        for op in self.ops.ops:
            params = [p for p, o in owners if o == op.name]
            for s in state_inputs(op):
                yield op, s.name, params

    def state_tensors(self) -> list[tuple[str, str, int, tuple]]:
        """(checkpoint name, state buffer, offset in it, shape) of each tensor state_dict
        holds, of one process (every parameter's range in one group): what a program that
        writes the checkpoint itself reads (export-c --train)."""
        plan, out = self.model.mem.plan, []
        for op, state, params in self._states():
            for name in params:
                b = plan.buffer(name)
                g = next(g for g in self._groups(op) if g.lo <= b.offset < g.hi)
                out.append((_named(state, name), f"{op.name}.{state}",
                            g.at + b.offset - g.lo, b.shape))
        return out

    def state_dict(self) -> dict:
        """Each state by parameter, `<state>.<param>`, whole (ZeRO: gathered to rank 0; the
        other ranks get {})."""
        mem, plan, out = self.model.mem, self.model.mem.plan, {}
        total = plan.arena("params").size
        for op, state, params in self._states():
            buf = self.model.backend.asnumpy(mem[f"{op.name}.{state}"])
            full = np.zeros(total, buf.dtype)
            for g in self._groups(op):
                full[g.lo:g.hi] = buf[g.at:g.at + g.size]
            if self.shards:   # every rank takes part in every gather
                full = self.shards.gather(self.shards.compact(full),
                                          f"the {op.name}.{state} gather")
            for name in params if full is not None else ():
                b = plan.buffer(name)
                out[_named(state, name)] = full[b.offset:b.offset + b.size].reshape(b.shape).copy()
        return out

    def load_state_dict(self, state: dict) -> None:
        mem, plan = self.model.mem, self.model.mem.plan
        want = {_named(s, p) for _, s, params in self._states() for p in params}
        extra = sorted(set(state) - want)
        if extra:
            raise EulerError(f"optimizer state holds {extra[0]}, which {self.ops.main.name} has "
                             "no place for (a checkpoint of another optimizer?)", key="checkpoint")
        for op, s, params in self._states():
            buf = mem[f"{op.name}.{s}"]
            full = np.zeros(plan.arena("params").size, buf.dtype)
            for name in params:
                if _named(s, name) not in state:
                    raise EulerError(f"optimizer state lacks {_named(s, name)}", key="checkpoint")
                b = plan.buffer(name)
                full[b.offset:b.offset + b.size] = state[_named(s, name)].reshape(-1)
            flat = np.zeros(buf.size, buf.dtype)
            for g in self._groups(op):
                flat[g.at:g.at + g.size] = full[g.lo:g.hi]
            upload(buf, flat)


def _named(state: str, param: str) -> str:
    """A state tensor's name in a checkpoint: adamw's m.<param>, v.<param>."""
    return f"{state}.{param}"


def _params(op, t: TrainingConfig, decay: bool) -> dict:
    """The values of an op's params that the config gives: weight_decay (the config's on
    decayed parameters, else 0), and adamw's betas and eps where the config sets them."""
    out = {k: getattr(t, key) for k, key in FROM_CONFIG.items()
           if k in op.params and getattr(t, key) is not None}
    if "weight_decay" in op.params:
        out["weight_decay"] = t.weight_decay if decay else 0.0
    return out
