"""The training step as CUDA graphs (`pytest -m gpu tests/gpu/test_step_graph_gpu.py`):
a run whose steps replay captured graphs (training.cuda_graph, the default) repeats the
run of the same kernels launched eagerly bit for bit, in fp32 and bf16 (of either
training.precision), with adamw, muon (its matrices on one stream or on four) and lion,
with gradient accumulation and with updates the spike guard skips: losses, validation
losses, master weights, their bf16 copy, the optimizer's state and the step control's
state. Replays allocate
nothing, and an allocation while capturing is refused. (kill -9 and resume of a graphed
run: tests/gpu/test_resume_gpu.py.)"""
from __future__ import annotations

import numpy as np
import pytest

from eulergen.errors import EulerError
from eulergen.runtime.train.config import load_config
from eulergen.runtime.train.trainer import Trainer
from test_model_gpu import _cfg, _three_planned_steps  # noqa: E402  (tests/gpu is on the path)

pytestmark = pytest.mark.gpu


# a dtype beside fp32 and bf16: bf16 in training.precision autocast (float32 gradients)
PRECISIONS = {"autocast": ["training.dtype=bf16", "training.precision=autocast"]}


def _trainer(lib, shard, run_dir, *, dtype, graph, accumulation, spike, optimizer="adamw"):
    # head dim 64 (a size the flash kernels take), GQA; evaluation between replays at 7
    sets = [f"run_dir={run_dir}", f"data.dataset={shard}", f"data.val_dataset={shard}",
            "model.preset=nanoeuler", "model.vocab_size=256", "model.hidden_dim=128",
            "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
            "model.max_seq_len=128", "model.mlp_hidden=256", "training.batch_size=4",
            "training.seq_len=128", "training.total_steps=14", "training.warmup_steps=2",
            "training.eval_every=7", "training.eval_steps=2", "training.checkpoint_every=0",
            "training.log_every=1", "training.sample_tokens=0", "training.device=cuda",
            *PRECISIONS.get(dtype, [f"training.dtype={dtype}"]),
            f"training.cuda_graph={str(graph).lower()}",
            f"training.gradient_accumulation={accumulation}", f"training.spike_factor={spike}",
            f"training.optimizer={optimizer}"]
    return Trainer(load_config(None, sets), lib, progress=False, tensorboard=False)


def _finished(trainer: Trainer) -> dict:
    result = trainer.run()
    mem = trainer.model.mem
    return {"losses": result.losses, "val": result.val_losses, "skipped": result.skipped,
            "weights": trainer.model.state_dict(), "moments": trainer.optim.state_dict(),
            "state": trainer.stepper.state(),
            "copy": mem.arenas["params_bf16"].get() if trainer.model.bf16 else None}


# spike factor 0.1: past the guard's warm-up (10 steps) every loss is above 0.1 x its mean,
# so steps 11-14 are skipped (0.9 skipped none: the loss falls faster than its mean)
# muon: its Newton-Schulz GEMMs on the model's cuBLAS handle inside the update's graph
# (autocast: its f32 step and autocast apply, its rest op's autocast step)
@pytest.mark.parametrize("dtype, accumulation, spike, optimizer", [
    ("fp32", 1, 4.0, "adamw"), ("bf16", 1, 4.0, "adamw"), ("bf16", 2, 0.1, "adamw"),
    ("fp32", 2, 0.1, "adamw"), ("bf16", 1, 4.0, "muon"), ("fp32", 1, 4.0, "muon"),
    ("bf16", 1, 4.0, "lion"), ("autocast", 1, 4.0, "muon"), ("autocast", 1, 4.0, "lion")])
def test_a_graphed_run_repeats_the_eager_run_bitwise(libs, shard, tmp_path, dtype,
                                                     accumulation, spike, optimizer):
    cuda = libs[0]
    eager_trainer = _trainer(cuda, shard, tmp_path / "eager", dtype=dtype, graph=False,
                             accumulation=accumulation, spike=spike, optimizer=optimizer)
    eager = _finished(eager_trainer)
    assert eager_trainer.stepper.device.graphs is None
    graphed_trainer = _trainer(cuda, shard, tmp_path / "graph", dtype=dtype, graph=True,
                               accumulation=accumulation, spike=spike, optimizer=optimizer)
    graphed = _finished(graphed_trainer)
    want = {("micro", True, False), ("update",)} | (
        {("micro", False, False)} if accumulation > 1 else set())
    assert set(graphed_trainer.stepper.device.graphs) == want
    assert list(eager["losses"]) == list(range(1, 15))
    for key in ("losses", "val", "skipped", "state"):
        assert graphed[key] == eager[key], key
    for key in ("weights", "moments"):
        bad = [k for k, v in eager[key].items() if not np.array_equal(graphed[key][k], v)]
        assert not bad, f"{key} differ: {bad[:4]}"
    if dtype != "fp32":
        np.testing.assert_array_equal(graphed["copy"], eager["copy"])
    if spike < 1:
        assert graphed["skipped"] == [11, 12, 13, 14], graphed["skipped"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_muon_on_lanes_repeats_muon_on_one_stream_bitwise(libs, shard, tmp_path, monkeypatch,
                                                         dtype):
    """The matrices' Newton-Schulz steps on 4 CUDA streams (runtime/engine/lanes.py), graphed,
    give the bits of all of them on the step's one stream, eager."""
    from eulergen.runtime.model import optimizer_plan
    cuda = libs[0]
    monkeypatch.setattr(optimizer_plan, "LANES", 1)
    one = _trainer(cuda, shard, tmp_path / "one", dtype=dtype, graph=False, accumulation=1,
                   spike=4.0, optimizer="muon")
    assert one.optim.plan.lanes == 1
    want = _finished(one)
    monkeypatch.setattr(optimizer_plan, "LANES", 4)
    four = _trainer(cuda, shard, tmp_path / "four", dtype=dtype, graph=True, accumulation=1,
                    spike=4.0, optimizer="muon")
    assert four.optim.plan.lanes == 4 and len(four.optim.lanes.streams) == 3
    got = _finished(four)
    assert got["losses"] == want["losses"]
    for key in ("weights", "moments"):
        bad = [k for k, v in want[key].items() if not np.array_equal(got[key][k], v)]
        assert not bad, f"{key} differ: {bad[:4]}"


def test_replays_allocate_nothing(libs, cp):
    """Capturing and replaying the step (bf16, the default model shape of the pool tests)
    grows CuPy's pool by nothing once the first, eager, step has run."""
    cuda = libs[0]
    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()
    before = pool.total_bytes()
    model, stepper, sizes = _three_planned_steps(cuda, cp, _cfg("nanoeuler"), dtype="bf16",
                                                 cuda_graph=True, steps=8)
    assert set(stepper.device.graphs) == {("micro", True, False), ("update",)}
    assert sizes[-1] == sizes[0], f"capture and replays grew the pool: {sizes}"
    assert pool.total_bytes() - before <= 1.05 * model.mem.plan.total_bytes


def test_an_allocation_while_capturing_is_refused(libs, cp):
    cuda = libs[0]
    model, stepper, _ = _three_planned_steps(cuda, cp, _cfg("gpt2"), cuda_graph=True, steps=1)
    update = stepper.update

    def allocating():
        cp.zeros(1000, cp.float32)
        update()
    stepper.update = allocating
    with pytest.raises(EulerError, match="allocation while capturing the training step"):
        stepper.launch(2, [(np.zeros((2, 128), np.int64),) * 2], 1e-3)


def test_garbage_the_collector_finds_while_capturing_cannot_invalidate_the_capture(cp):
    """A cuBLAS handle left in a reference cycle (an earlier run's) is destroyed when the
    cyclic collector runs, and cublasDestroy synchronizes the device: inside a capture that
    invalidates it. cuda_graph.capture collects before and not during."""
    from eulergen.runtime.engine.cublas import Cublas
    from eulergen.runtime.engine.cuda_graph import capture
    x = cp.zeros(1 << 16, cp.float32)
    x += 1   # compiled and loaded before any capture

    def work():
        for _ in range(3):
            x.__iadd__(1)
            _ = [[] for _ in range(5000)]   # new containers enough to set the collector off
    for _ in range(3):
        cycle = [Cublas()]
        cycle.append(cycle)
        del cycle
        capture(cp.cuda.Stream(non_blocking=True), work).launch()
    assert float(x[0]) == 10
