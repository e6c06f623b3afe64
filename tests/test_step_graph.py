"""The GPU side of runtime/train/step_graph.py without a GPU: a stand-in `cupy` (numpy arrays,
copies done at once, a capture that records nothing but is undone, so that only replays
take effect, as on the device) and a stand-in model whose loss is its batch's mean id.

What this guards: tokens and the learning rate reach the device buffers before the step
that reads them, through the pinned ring; results come back in order, one per step; the
first step runs eagerly and each stage is captured once, at the second, then replayed; a
graphed run gives the eager run's records. The kernels' arithmetic under capture is
tests/gpu/test_step_graph_gpu.py's."""
from __future__ import annotations

import contextlib
import ctypes
import sys
import types

import numpy as np
import pytest

from eulergen.runtime.train import step_control
from eulergen.runtime.train.step_graph import Stepper

SLOTS = ("skip", "grad_scale", "lr", "step")


class FakeArray(np.ndarray):
    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])


class Capture:
    """What the stand-in stream records: the arrays a capture must leave as they were."""
    arrays: list = []
    counts = {"captures": 0, "replays": 0}


class Stream:
    ptr = 7

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        pass

    def begin_capture(self):
        self._saved = [a.copy() for a in Capture.arrays]

    def end_capture(self):
        for a, saved in zip(Capture.arrays, self._saved):   # a capture runs nothing
            a[...] = saved
        Capture.counts["captures"] += 1
        return Graph(self._work)


class Graph:
    def __init__(self, work):
        self.work = work

    def launch(self, stream):
        Capture.counts["replays"] += 1
        self.work()


class Event:
    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


def _memcpy(dst, src, size, kind, stream):
    ctypes.memmove(dst, src, size)


def fake_cupy() -> types.ModuleType:
    mod = types.ModuleType("cupy")
    mod.zeros = lambda *a, **k: np.zeros(*a, **k).view(FakeArray)
    runtime = types.SimpleNamespace(memcpyHostToDevice=1, memcpyDeviceToHost=2,
                                    memcpyAsync=_memcpy)
    mod.cuda = types.SimpleNamespace(
        Stream=Stream, Event=Event, runtime=runtime, alloc_pinned_memory=bytearray,
        get_elapsed_time=lambda a, b: 2.0, using_allocator=lambda fn: contextlib.nullcontext())
    return mod


class FakeModel:
    """Loss: the mean of the loaded ids; the gradient norm: the mean target; the weight
    moves by lr · norm a step. Every array is a 'device' one the capture restores."""

    def __init__(self):
        self.xp = sys.modules["cupy"]
        self.backend = types.SimpleNamespace(is_gpu=True, asnumpy=np.asarray)
        self.batch, self.seq = 2, 3
        self.mem = {n: np.zeros((2, 3), np.int32).view(FakeArray) for n in ("idx", "targets")}
        self.mem.update(loss=np.zeros(1, np.float32).view(FakeArray),
                        grad_norm=np.zeros(1, np.float32).view(FakeArray),
                        weight=np.zeros(1).view(FakeArray))
        self.calls = []

    def check_tokens(self, ids):
        return np.asarray(ids)

    def loss_and_grad(self, accumulate, after=None):
        self.calls.append(accumulate)
        self.mem["loss"][0] = self.mem["idx"].mean()
        if after is not None:   # the tape's hook, after a node's backward
            after(0)

    def grad_norm(self, out):
        out[0] = self.mem["targets"].mean()


class FakeOptim:
    slots = SLOTS

    def __init__(self, model):
        self.model = model

    def step(self, control):
        if not control[0]:
            self.model.mem["weight"][0] += control[2] * control[1]


class FakeDataParallel:
    """ZeRO-1 over two ranks whose other rank has this one's loss and squares: `finish`
    doubles the loss (the ranks' sum), `sumsq` gives 4 (a norm of 2); `log` says what ran,
    in order, and what the host waited for."""
    zero, ranks = True, 2

    def __init__(self):
        self.log = []
        self.loss = np.zeros(1, np.float32).view(FakeArray)
        self.squares = np.zeros(1, np.float32).view(FakeArray)
        self.c = types.SimpleNamespace(settle=lambda what, event: self.log.append(what))

    def after(self, node):
        self.log.append("after")

    def finish(self):
        self.loss[0] *= 2
        self.log.append("finish")

    def sumsq(self):
        self.squares[0] = 4.0
        self.log.append("sumsq")
        return self.squares

    def gather_params(self):
        self.log.append("gather")


def _run(monkeypatch, graph: bool, steps: int = 5, micro: int = 2, dp=None):
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy())
    Capture.counts.update(captures=0, replays=0)
    model = FakeModel()
    t = types.SimpleNamespace(spike_factor=0.0, grad_clip=0.0, gradient_accumulation=micro)
    rule = step_control.StepRule.of(t, SLOTS, dp.ranks if dp else 1, zero=dp is not None)
    stepper = Stepper(model, FakeOptim(model), rule, cuda_graph=graph, dp=dp)
    Capture.arrays = [stepper.record, stepper.control, *model.mem.values(),
                      *((dp.loss, dp.squares) if dp else ())]
    real = stepper.device._capture

    def capture(work):   # the stand-in stream learns what the graph replays
        stepper.device.stream._work = work
        return real(work)
    stepper.device._capture = capture
    results = []
    for step in range(1, steps + 1):
        batches = [(np.full((2, 3), 10 * step + i), np.full((2, 3), step)) for i in range(micro)]
        stepper.launch(step, batches, lr=0.5 * step)
        if step > 1:   # a step late, as the trainer reads them
            results.append(stepper.result())
    results.append(stepper.result())
    return stepper, model, results


def test_each_step_reads_its_own_tokens_and_lr_and_results_come_back_in_order(monkeypatch):
    stepper, model, results = _run(monkeypatch, graph=True)
    assert [r.step for r in results] == [1, 2, 3, 4, 5]
    assert [r.loss for r in results] == [(10 * s + 10 * s + 1) / 2 for s in range(1, 6)]
    assert [r.norm for r in results] == [1.0, 2, 3, 4, 5] and results[0].seconds == 2e-3
    assert model.mem["weight"][0] == sum(0.5 * s for s in range(1, 6))
    assert stepper.state()[0] == 5


def test_the_first_step_runs_eagerly_then_each_stage_is_captured_once_and_replayed(monkeypatch):
    stepper, model, _ = _run(monkeypatch, graph=True, steps=5, micro=2)
    assert set(stepper.device.graphs) == {("micro", True, False), ("micro", False, False),
                                          ("update",)}
    assert Capture.counts == {"captures": 3, "replays": 3 * 4}
    # eager step 1; at step 2 each micro-step runs captured (undone), then replayed
    assert model.calls == [False, True] + [False, False, True, True] + [False, True] * 3


def test_a_graphed_run_gives_the_eager_runs_records(monkeypatch):
    graphed = _run(monkeypatch, graph=True)
    eager = _run(monkeypatch, graph=False)
    assert Capture.counts == {"captures": 0, "replays": 0}
    assert graphed[2] == eager[2]
    np.testing.assert_array_equal(graphed[0].record, eager[0].record)
    assert graphed[0].control.dtype == np.float32   # as the GPU's kernels read it


def test_the_record_is_read_between_steps_only(monkeypatch):
    stepper, _, _ = _run(monkeypatch, graph=True, steps=1)
    stepper.launch(2, [(np.zeros((2, 3)), np.zeros((2, 3)))] * 2, lr=0.1)
    with pytest.raises(RuntimeError, match="between steps"):
        stepper.state()


def test_data_parallel_the_last_micro_step_reduces_and_the_update_gathers(monkeypatch):
    """The buckets' hook and the loss's collective belong to the step's last micro-step, a
    stage of its own; ZeRO's sum of squares and gather to the update; the host waits for
    a step through the collective (which watches the other ranks). The loss is the ranks'
    mean, the norm the root of their summed squares."""
    dp = FakeDataParallel()
    stepper, model, results = _run(monkeypatch, graph=True, steps=3, micro=2, dp=dp)
    assert set(stepper.device.graphs) == {("micro", True, False), ("micro", False, True),
                                          ("update",)}
    step = ["after", "finish", "sumsq", "gather"]
    # step 2 captures each stage (run, then undone) and replays it
    assert dp.log == (step + ["after", "finish"] * 2 + ["sumsq", "gather"] * 2 + ["step 1"]
                      + step + ["step 2", "step 3"])
    assert model.calls == [False, True] + [False, False, True, True] + [False, True]
    assert [r.loss for r in results] == [(10 * s + 10 * s + 1) / 2 for s in range(1, 4)]
    assert [r.norm for r in results] == [2.0] * 3
    eager = _run(monkeypatch, graph=False, steps=3, micro=2, dp=FakeDataParallel())
    assert eager[2] == results
