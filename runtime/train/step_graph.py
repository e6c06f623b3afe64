"""One training step as the trainer runs it, on either backend: for each micro-step the
batch's tokens, forward, loss and backward; then the gradient norm, step control
(runtime/train/step_control.py) and the optimizer's update, none of which reads a value on the host.
Data parallel (runtime/distributed/data_parallel.py): the last micro-step's backward issues each
gradient bucket's collective as it finishes the bucket, and the rank's loss joins the
last one; with ZeRO-1 the norm comes from the ranks' shares and the weights are gathered
after the update.

On the GPU the step runs on a stream of its own. Its tokens and learning rate arrive by
asynchronous copies from pinned host buffers (a copy from pageable memory makes the
stream wait for the host), and its record (loss, norm, what became of the update) goes back
the same way, for the host to read a step later, so that logging and the checks never
stall the next step. With `cuda_graph` the first micro-step, the accumulating ones, the
last one (data parallel: with its collectives) and the update (ZeRO: with the norm's sum
and the weights' gather) are captured as CUDA graphs, once, after a first step run
eagerly has compiled and loaded every kernel, and replayed from then on: the same kernels
and NCCL calls on the same planned buffers as an eager step, so the same bits. An
allocation while capturing is an error: a graph replays the addresses it was captured
with. The host waits for a step only when it reads its record; data parallel, it watches
the other ranks meanwhile (NCCL would wait forever for one that died).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from eulergen.errors import EulerError
from eulergen.runtime.train import step_control
from eulergen.runtime.engine.cuda_graph import capture
from eulergen.runtime.model.memory import upload
from eulergen.step_record import AT, RECORD

RING = 3   # steps of pinned buffers: the host runs at most two steps ahead of the GPU


@dataclass(frozen=True)
class StepResult:
    step: int
    loss: float
    norm: float
    skipped: str | None      # why the update was skipped (spike guard, non-finite), or None
    not_finite: bool         # the loss or the norm was not finite: the run must stop
    seconds: float           # the step's time on the device (numpy: on the host)


class Stepper:
    """Launches steps over a model and its optimizer with a StepRule (data parallel: and the
    rank's DataParallel, `dp`), and hands back their results in order (`result()`, a step
    after `launch()` on the GPU). `record` is the
    step control's float64 array, `control` the update op's control slots (float32 on the
    GPU, as its kernels read them; float64 on numpy)."""

    def __init__(self, model, optim, rule: step_control.StepRule, *, cuda_graph: bool = True,
                 dp=None):
        self.model, self.optim, self.rule, self.dp = model, optim, rule, dp
        xp = model.xp
        self.record = xp.zeros(len(RECORD), np.float64)
        gpu = model.backend.is_gpu
        self.control = xp.zeros(len(optim.slots), np.float32 if gpu else np.float64)
        # the norm as grad_norm writes it: float32 from cuBLAS, numpy's float64
        self.norm = model.mem["grad_norm"] if gpu else np.zeros(1)
        self.pending: deque = deque()
        self.device = _Device(self, cuda_graph) if gpu else None

    # -- what a step runs, on the device, in order ------------------------------------------

    def micro(self, first: bool, last: bool) -> None:
        """Forward, loss and backward of the loaded batch; its loss joins the step's. Data
        parallel, the step's last: the buckets' collectives issued as the backward finishes
        them, then the rank's loss (the micro-steps' mean) joining the last ones."""
        dp = self.dp if last else None
        self.model.loss_and_grad(accumulate=not first, after=dp.after if dp else None)
        step_control.accumulate(self.record, self.model.mem["loss"], first)
        if dp is not None:
            step_control.rank_loss(self.record, self.rule, dp.loss)
            dp.finish()

    def update(self) -> None:
        """The norm (ZeRO-1: the ranks' summed squares of their shares), step control, the
        optimizer's update (ZeRO-1: of this rank's share, then every rank's gathered)."""
        dp = self.dp
        zero = dp is not None and dp.zero
        if zero:
            norm = dp.sumsq()
        else:
            self.model.grad_norm(out=self.norm)
            norm = self.norm
        step_control.decide(self.record, self.control, norm, dp.loss if dp else None, self.rule)
        self.optim.step(self.control)
        if zero:
            dp.gather_params()

    # -- the host's side ------------------------------------------------------------------

    def launch(self, step: int, batches: list, lr: float) -> None:
        """Step `step` over `batches` ([(x, y)], one a micro-step) at learning rate lr."""
        if self.device is not None:
            self.pending.append(self.device.launch(step, batches, lr))
            return
        started = time.perf_counter()
        self.record[AT["lr"]] = lr
        for i, (x, y) in enumerate(batches):
            self.model.load_tokens(x, y)
            self.micro(i == 0, i == len(batches) - 1)
        self.update()
        self.pending.append((step, self.record.copy(), time.perf_counter() - started))

    def result(self) -> StepResult:
        """The oldest launched step's result (waiting for it on the GPU)."""
        pending = self.pending.popleft()
        step, record, seconds = pending if self.device is None else self.device.result(pending)
        return StepResult(step, float(record[AT["loss"]]), float(record[AT["norm"]]),
                          step_control.why_skipped(record, self.rule.spike_factor),
                          step_control.not_finite(record), seconds)

    def state(self) -> tuple[int, dict]:
        """(the optimizer's update count, the spike guard's state), read back: what a checkpoint
        keeps. Between steps only (nothing pending)."""
        record = self.model.backend.asnumpy(self._settled())
        return int(record[AT["updates"]]), step_control.guard_state(record)

    def load_state(self, updates: int, guard: dict) -> None:
        record = np.zeros(self.record.size)
        step_control.restore(record, updates, guard)
        upload(self._settled(), record)

    def _settled(self):
        if self.pending:
            raise RuntimeError("the step record is read between steps, none in flight")
        if self.device is not None:
            self.device.stream.synchronize()
        return self.record


class _Slot:
    """One step's pinned buffers: its tokens and lr in, its record out; events for when
    its inputs were copied and when it started and ended on the device."""

    def __init__(self, cupy, micro_steps: int, shape: tuple, record: int):
        def pinned(dtype, shape):
            n = int(np.prod(shape))
            mem = cupy.cuda.alloc_pinned_memory(n * np.dtype(dtype).itemsize)
            return np.frombuffer(mem, dtype, n).reshape(shape)
        self.tokens = pinned(np.int32, (micro_steps, 2, *shape))
        self.lr = pinned(np.float64, (1,))
        self.out = pinned(np.float64, (record,))
        self.copied, self.start, self.end = (cupy.cuda.Event() for _ in range(3))


class _Device:
    """The GPU side of a Stepper: its stream, pinned slots and graphs."""

    def __init__(self, stepper: Stepper, cuda_graph: bool):
        import cupy
        self.cupy, self.s = cupy, stepper
        m = stepper.model
        self.stream = cupy.cuda.Stream()
        self.graphs: dict | None = {} if cuda_graph else None
        self.warm = False   # a first step has run eagerly
        self.slots = [_Slot(cupy, stepper.rule.micro_steps, (m.batch, m.seq),
                            stepper.record.size) for _ in range(RING)]

    def launch(self, step: int, batches: list, lr: float) -> tuple:
        s, m, rt = self.s, self.s.model, self.cupy.cuda.runtime
        slot = self.slots[step % RING]
        slot.copied.synchronize()   # the step RING back has read its inputs
        slot.lr[0] = lr
        for i, (x, y) in enumerate(batches):
            slot.tokens[i] = m.check_tokens(x), m.check_tokens(y)
        with self.stream:
            slot.start.record(self.stream)
            self._copy(s.record[AT["lr"]:AT["lr"] + 1], slot.lr, rt.memcpyHostToDevice)
            last = len(batches) - 1
            for i in range(len(batches)):
                self._copy(m.mem["idx"], slot.tokens[i, 0], rt.memcpyHostToDevice)
                self._copy(m.mem["targets"], slot.tokens[i, 1], rt.memcpyHostToDevice)
                if i == last:
                    slot.copied.record(self.stream)
                # the last micro-step is a stage of its own where it issues collectives
                self._run(("micro", i == 0, i == last and s.dp is not None),
                          lambda first=i == 0, end=i == last: s.micro(first, end))
            self._run(("update",), s.update)
            self._copy(slot.out, s.record, rt.memcpyDeviceToHost)
            slot.end.record(self.stream)
        self.warm = True
        return step, slot

    def result(self, pending) -> tuple:
        step, slot = pending
        if self.s.dp is not None:   # bounded, naming a rank that died
            self.s.dp.c.settle(f"step {step}", slot.end)
        slot.end.synchronize()
        seconds = self.cupy.cuda.get_elapsed_time(slot.start, slot.end) / 1e3
        return step, slot.out.copy(), seconds

    def _copy(self, dst, src, kind) -> None:
        """An asynchronous copy between a device array and a pinned host one, on the stream."""
        rt = self.cupy.cuda.runtime
        host, device = (src, dst) if kind == rt.memcpyHostToDevice else (dst, src)
        if host.nbytes != device.nbytes or not device.flags.c_contiguous:
            raise RuntimeError(f"copy of {host.nbytes} bytes into {device.nbytes}")
        pointers = ((device.data.ptr, host.ctypes.data) if kind == rt.memcpyHostToDevice
                    else (host.ctypes.data, device.data.ptr))
        rt.memcpyAsync(*pointers, host.nbytes, kind, self.stream.ptr)

    def _run(self, key: tuple, work) -> None:
        """`work` eagerly, or its graph (captured on first use once a step has run)."""
        if self.graphs is None or not self.warm:
            work()
            return
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = self._capture(work)
        graph.launch(self.stream)

    def _capture(self, work):
        with self.cupy.cuda.using_allocator(_refuse):
            return capture(self.stream, work)


def _refuse(size: int):
    raise EulerError(f"a {size:,}-byte allocation while capturing the training step: a "
                     "captured step may touch planned buffers only (training.cuda_graph=false "
                     "runs it eagerly)", key="training.cuda_graph")
