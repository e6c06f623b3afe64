"""Data-parallel training over a collective (runtime/collective.py, runtime/nccl.py): a
BucketPlan's gradient buckets (runtime/buckets.py) reduced as the backward pass finishes
them, the rank's loss joining the last one's collective; with ZeRO-1, a rank's share of
the step (the gradient norm from the shares, the clip, the weights gathered after its
AdamW update) and the gathers that keep a checkpoint one rank-independent file set.

On the GPU a bucket's collectives run on a stream of their own, after an event the
compute stream records when the bucket's last gradient is written, so they overlap the
rest of the backward; the compute stream waits for that stream before anything reads the
gradients. On the CPU collective the same schedule runs in the same order (each call
returns when it is done), so the tests check the logic the GPU runs.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np

from eulergen.runtime import bf16
from eulergen.runtime.buckets import BucketPlan
from eulergen.runtime.collective import CpuCollective
from eulergen.runtime.memory import ALIGN, upload
from eulergen.runtime.tape import cublas_nrm2


class DataParallel:
    """One rank's side of a data-parallel step over `model` (runtime/model.py, planned with
    `plan`). The trainer calls, in order: `after` as Tape.backward's hook on a step's last
    micro-step, `finish`, then (ZeRO) `grad_norm`, `scale_grads`, its AdamW over `owned`,
    and `gather_params`."""

    def __init__(self, model, collective, plan: BucketPlan):
        self.model, self.c, self.plan = model, collective, plan
        self.zero = plan.zero
        self.rank, self.ranks = collective.rank, collective.world_size
        self.owned = plan.owned(self.rank)
        self._after: dict[int, list] = {}   # tape node -> the buckets final after it
        for b in plan.buckets:
            if b.ready < plan.nodes - 1:
                self._after.setdefault(b.ready, []).append(b)
        self._last = [b for b in plan.buckets if b.ready >= plan.nodes - 1]
        self._stream = None
        if model.backend.is_gpu:
            self._cupy = model.xp
            self._stream = model.xp.cuda.Stream(non_blocking=True)

    # -- the gradients ------------------------------------------------------------------

    def after(self, node: int) -> None:
        """Tape.backward's hook: reduce the buckets whose gradients node `node` finished."""
        buckets = self._after.get(node)
        if buckets:
            self._issue(buckets)

    def finish(self, loss: float) -> float:
        """After the last micro-step's backward: the buckets final only at its end, this
        rank's `loss` in the same collective; the loss averaged over the ranks. Every
        gradient (ZeRO: of this rank's share) is then summed over the ranks; each rank's
        were already divided by their number (GPT.set_accumulation)."""
        slot = self.model.mem["dp_loss"]
        upload(slot, [loss])
        self._issue(self._last, slot)
        if self._stream is not None:   # the compute stream reads what the collectives wrote
            done = self._cupy.cuda.Event(disable_timing=True)
            done.record(self._stream)
            self._cupy.cuda.get_current_stream().wait_event(done)
        self.c.settle("the gradients' reduction")
        return float(self.model.backend.asnumpy(slot)[0]) / self.ranks

    def _issue(self, buckets, loss=None) -> None:
        g = self.model.mem.arenas["grads"]
        stream = contextlib.nullcontext()
        if self._stream is not None:
            ready = self._cupy.cuda.Event(disable_timing=True)
            ready.record()
            self._stream.wait_event(ready)
            stream = self._stream
        with stream, self.c.group():
            for b in buckets:
                if not self.zero:
                    self.c.all_reduce_sum(g[b.lo:b.hi])
                    continue
                mine, split = b.lo + self.rank * b.shard, b.lo + self.ranks * b.shard
                if b.shard:
                    self.c.reduce_scatter(g[b.lo:split], g[mine:mine + b.shard])
                if split < b.hi:
                    self.c.all_reduce_sum(g[split:b.hi])
            if loss is not None:
                self.c.all_reduce_sum(loss)

    # -- ZeRO-1: this rank's share of the update --------------------------------------------

    def grad_norm(self) -> float:
        """The global gradient norm from the shares: each rank's sum of squares (a tail,
        which every rank holds, counted by rank 0 alone), summed over the ranks."""
        m = self.model
        g = m.mem.arenas["grads"]
        spans = [s for s in self.owned if not s.tail or self.rank == 0]
        if not m.backend.is_gpu:
            sumsq = sum(float(np.dot(g[s.lo:s.hi], g[s.lo:s.hi])) for s in spans)
        elif m.bf16:   # float32 norms of rows of the share into the planned rows, then theirs
            rows = m.mem["shard_rows"]
            for s in spans:
                bf16.row_norms(g[s.lo:s.hi].reshape(-1, ALIGN),
                               rows[s.at // ALIGN:(s.at + s.hi - s.lo) // ALIGN])
            sumsq = cublas_nrm2(rows) ** 2
        else:
            sumsq = sum(cublas_nrm2(g[s.lo:s.hi]) ** 2 for s in spans)
        slot = m.mem["dp_sumsq"]
        upload(slot, [sumsq])
        self.c.all_reduce_sum(slot)
        self.c.settle("the gradient norm")
        return math.sqrt(float(m.backend.asnumpy(slot)[0]))

    def scale_grads(self, factor: float) -> None:
        for s in self.owned:
            self.model.scale_grads(factor, s.lo, s.hi)

    def gather_params(self) -> None:
        """After this rank's AdamW update of its share: every rank's share of the weights
        the kernels read (fp32: the weights, bf16: their bf16 copy), one group."""
        m = self.model
        a = m.mem.arenas["params_bf16" if m.bf16 else "params"]
        with self.c.group():
            for b in self.plan.buckets:
                if b.shard:
                    mine = b.lo + self.rank * b.shard
                    self.c.all_gather(a[mine:mine + b.shard], a[b.lo:b.lo + self.ranks * b.shard])
        self.c.settle("the parameters' gather")

    # -- checkpoints -------------------------------------------------------------------------

    def compact(self, full: np.ndarray) -> np.ndarray:
        """This rank's share of a flat array of the params layout, span after span."""
        return np.concatenate([full[s.lo:s.hi] for s in self.owned])

    def gather(self, share: np.ndarray, what: str) -> np.ndarray | None:
        """Rank 0: the whole flat array (params layout) whose shares (`compact`) every rank
        sends; the other ranks: None."""
        parts = self.c.gather_bytes(np.ascontiguousarray(share).tobytes(), what)
        if parts is None:
            return None
        full = np.zeros(self.plan.total, share.dtype)
        for r, data in enumerate(parts):
            part = np.frombuffer(data, share.dtype)
            for s in self.plan.owned(r):
                full[s.lo:s.hi] = part[s.at:s.at + s.hi - s.lo]
        return full

    def complete_master(self) -> None:
        """bf16 with ZeRO: each rank's float32 master weights are up to date in its share
        only; gather them whole into rank 0's (for a checkpoint or a sample)."""
        m = self.model
        if not (self.zero and m.bf16):
            return
        params = m.mem.arenas["params"]
        share = np.concatenate([m.backend.asnumpy(params[s.lo:s.hi]) for s in self.owned])
        full = self.gather(share, "the master weights' gather")
        if full is not None:
            upload(params, full)


def connect(rv, backend):
    """The collective of a Rendezvous for a backend: NCCL on the GPU, the TCP hub on numpy."""
    if backend.is_gpu:
        from eulergen.runtime.nccl import NcclCollective
        return NcclCollective(rv)
    return CpuCollective(rv)
