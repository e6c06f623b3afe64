"""Data-parallel training over a collective (runtime/distributed/collective.py, runtime/distributed/nccl.py): a
BucketPlan's gradient buckets (runtime/distributed/buckets.py) reduced as the backward pass finishes
them, the rank's loss joining the last one's collective; with ZeRO-1, a rank's share of
the step (the gradient norm's sum of squares from the shares, its AdamW update, the
weights gathered after it) and the gathers that keep a checkpoint one rank-independent
file set.

The Stepper (runtime/train/step_graph.py) calls these between its kernels, on its stream, and
nothing here waits for the device or reads a value on the host during a step, so on the
GPU a captured step holds the NCCL calls too. A bucket's collectives run on a stream of
their own, after an event the step's stream records when the bucket's last gradient is
written, so they overlap the rest of the backward; the step's stream waits for that
stream before anything reads the gradients. On the CPU collective the same schedule runs
in the same order (each call returns when it is done), so the tests check the logic the
GPU runs.
"""
from __future__ import annotations

import contextlib

import numpy as np

from eulergen.runtime.engine import bf16
from eulergen.runtime.distributed.buckets import BucketPlan
from eulergen.runtime.distributed.collective import CpuCollective
from eulergen.runtime.model.memory import ALIGN, upload


class DataParallel:
    """One rank's side of a data-parallel step over `model` (runtime/model/gpt.py, planned with
    `plan`). The Stepper calls, in order: `after` as Tape.backward's hook on a step's last
    micro-step, `finish` (the rank's loss in `loss`) when that backward is done, then, with
    ZeRO, `sumsq` for the gradient norm and, after its AdamW update of `owned`,
    `gather_params`."""

    def __init__(self, model, collective, plan: BucketPlan):
        self.model, self.c, self.plan = model, collective, plan
        self.zero = plan.zero
        self.rank, self.ranks = collective.rank, collective.world_size
        self.owned = plan.owned(self.rank)
        self.loss = model.mem["dp_loss"]   # the rank's loss, then the ranks' sum
        self._after: dict[int, list] = {}   # tape node -> the buckets final after it
        for b in plan.buckets:
            if b.ready < plan.nodes - 1:
                self._after.setdefault(b.ready, []).append(b)
        self._last = [b for b in plan.buckets if b.ready >= plan.nodes - 1]
        self._side = None
        if model.backend.is_gpu:
            cuda = model.xp.cuda
            self._side = cuda.Stream(non_blocking=True)
            self._ready, self._done = (cuda.Event(disable_timing=True) for _ in range(2))

    # -- the gradients ------------------------------------------------------------------

    def after(self, node: int) -> None:
        """Tape.backward's hook: reduce the buckets whose gradients node `node` finished."""
        buckets = self._after.get(node)
        if buckets:
            self._issue(buckets)

    def finish(self) -> None:
        """After the last micro-step's backward, with the rank's loss in `loss`: the buckets
        final only at its end and the loss in one collective. Every gradient (ZeRO: of this
        rank's share) is then the sum over the ranks, each rank's divided by their number
        beforehand (GPT.set_accumulation), and `loss` the ranks' sum."""
        self._issue(self._last, self.loss)
        if self._side is not None:   # the step's stream reads what the collectives wrote
            self._done.record(self._side)
            self.model.xp.cuda.get_current_stream().wait_event(self._done)

    def _issue(self, buckets, loss=None) -> None:
        g = self.model.mem.arenas["grads"]
        stream = contextlib.nullcontext()
        if self._side is not None:   # after what the step's stream has written so far
            self._ready.record()
            self._side.wait_event(self._ready)
            stream = self._side
        with stream, self.c.group():
            for b in buckets:
                if not self.zero:
                    self.c.all_reduce_sum(g[b.lo:b.hi])
                    continue
                mine, split = b.share(self.rank), b.share(self.ranks)
                if b.shard:
                    self.c.reduce_scatter(g[b.lo:split], g[mine:mine + b.shard])
                if split < b.hi:
                    self.c.all_reduce_sum(g[split:b.hi])
            if loss is not None:
                self.c.all_reduce_sum(loss)

    # -- ZeRO-1: this rank's share of the update --------------------------------------------

    def sumsq(self):
        """The ranks' summed squares of their shares of the gradients (a tail, which every
        rank holds, counted by rank 0 alone), in the planned `dp_sumsq`, which it returns:
        step_control.decide takes its root. On the GPU: norms of the share's spans (float32
        gradients) or rows (bf16 ones) into planned memory, then their dot with themselves
        (cuBLAS, into device memory); the spans a rank does not count leave their norms at
        the 0 the planned memory starts with."""
        m = self.model
        g, out = m.mem.arenas["grads"], m.mem["dp_sumsq"]
        counted = [(k, s) for k, s in enumerate(self.owned) if not s.tail or self.rank == 0]
        if not m.backend.is_gpu:
            out[0] = sum(float(np.dot(g[s.lo:s.hi], g[s.lo:s.hi])) for _, s in counted)
        else:
            blas = m.tape.blas
            if m.bf16_grads:
                norms = m.mem["shard_rows"]
                for _, s in counted:
                    bf16.row_norms(g[s.lo:s.hi].reshape(-1, ALIGN),
                                   norms[s.at // ALIGN:(s.at + s.hi - s.lo) // ALIGN])
            else:
                norms = m.mem["shard_norms"]
                for k, s in counted:
                    blas.nrm2(g[s.lo:s.hi], norms[k:k + 1])
            blas.dot(norms, norms, out)
        self.c.all_reduce_sum(out)
        return out

    def gather_params(self) -> None:
        """After this rank's AdamW update of its share: every rank's share of the weights
        the kernels read (fp32: the weights, bf16: their bf16 copy, which the update
        wrote), one group."""
        m = self.model
        a = m.mem.arenas["params_bf16" if m.bf16 else "params"]
        with self.c.group():
            for b in self.plan.buckets:
                if b.shard:
                    mine = b.share(self.rank)
                    self.c.all_gather(a[mine:mine + b.shard], a[b.lo:b.share(self.ranks)])

    # -- checkpoints (between steps, the device idle) ----------------------------------------

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
        from eulergen.runtime.distributed.nccl import NcclCollective
        return NcclCollective(rv)
    return CpuCollective(rv)
