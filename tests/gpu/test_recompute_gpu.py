"""training.recompute on the GPU (`pytest -m gpu tests/gpu/test_recompute_gpu.py`): a block's
forward run again in its backward gives the loss and every gradient of recompute none bit
for bit, in fp32, bf16 and autocast; a run whose steps replay CUDA graphs repeats none's
run (losses, master weights, their bf16 copy, moments); the step's pool stays within its
plan, which is smaller, so its peak is lower. (On the CPU: tests/test_recompute.py.)"""
from __future__ import annotations

import gc

import numpy as np
import pytest

from eulergen.runtime.train.config import load_config
from test_model_gpu import COMMON, STRUCTURES, _batch, _three_planned_steps  # noqa: E402

pytestmark = pytest.mark.gpu

# three layers: a first block, a middle one and the last, whose forward is not run again
THREE = [*COMMON, "model.num_layers=3"]


def _cfg(structure, *sets):
    return load_config(None, [*STRUCTURES[structure], *THREE, *sets])


def _bits(lib, cfg, dtype, precision, recompute):
    """The losses and gradient arena of two micro-steps from seeded weights."""
    from eulergen.runtime.model.gpt import build
    t = cfg.training
    model = build(cfg.model, lib, t.batch_size, t.seq_len, dtype=dtype, precision=precision,
                  recompute=recompute, tf32=False)
    model.init_weights(1)
    losses = []
    for seed in (0, 1):
        model.load_tokens(*_batch(cfg, seed))
        losses.append(float(model.loss_and_grad(accumulate=seed == 1)[0]))
    return losses, lib.backend.asnumpy(model.mem.arenas["grads"]).copy()


@pytest.mark.parametrize("dtype, precision", [("float32", "bf16"), ("bf16", "bf16"),
                                              ("bf16", "autocast")])
@pytest.mark.parametrize("structure", sorted(STRUCTURES))
def test_recomputing_blocks_gives_the_loss_and_every_gradient_bit_for_bit(libs, structure,
                                                                          dtype, precision):
    cuda, _ = libs
    cfg = _cfg(structure)
    want_loss, want = _bits(cuda, cfg, dtype, precision, "none")
    got_loss, got = _bits(cuda, cfg, dtype, precision, "blocks")
    assert got_loss == want_loss
    assert got.dtype == want.dtype and np.array_equal(got, want), \
        f"{int((got != want).sum()):,} of {got.size:,} gradient elements differ"


def _trainer(lib, shard, run_dir, recompute):
    from eulergen.runtime.train.trainer import Trainer
    sets = [f"run_dir={run_dir}", f"data.dataset={shard}", f"data.val_dataset={shard}",
            *STRUCTURES["nanoeuler"], *THREE, "training.total_steps=8",
            "training.warmup_steps=2", "training.eval_every=4", "training.eval_steps=2",
            "training.checkpoint_every=0", "training.log_every=1", "training.sample_tokens=0",
            "training.device=cuda", "training.dtype=bf16", "training.precision=bf16",
            "training.cuda_graph=true",
            "training.gradient_accumulation=2", f"training.recompute={recompute}"]
    return Trainer(load_config(None, sets), lib, progress=False, tensorboard=False)


def test_a_recomputing_run_of_cuda_graphs_repeats_the_run_without(libs, cp, shard, tmp_path):
    """bf16, two micro-steps a step, evaluation between replays: every stage captured, and
    the run's bits none's."""
    cuda = libs[0]
    runs = {}
    for mode in ("none", "blocks"):
        trainer = _trainer(cuda, shard, tmp_path / mode, mode)
        result = trainer.run()
        assert set(trainer.stepper.device.graphs) == {("micro", True, False),
                                                      ("micro", False, False), ("update",)}
        runs[mode] = (result.losses, result.val_losses, trainer.model.state_dict(),
                      trainer.optim.state_dict(),
                      cp.asnumpy(trainer.model.mem.arenas["params_bf16"]))
    none, blocks = runs["none"], runs["blocks"]
    assert list(none[0]) == list(range(1, 9))
    assert blocks[0] == none[0] and blocks[1] == none[1]
    for i, what in ((2, "weights"), (3, "moments")):
        bad = [k for k, v in none[i].items() if not np.array_equal(blocks[i][k], v)]
        assert not bad, f"{what} differ: {bad[:4]}"
    np.testing.assert_array_equal(blocks[4], none[4])


def test_recomputing_lowers_the_step_s_peak_memory(libs, cp):
    """bf16 steps as CUDA graphs at B=16, T=128, four layers: each mode's pool (which keeps
    every block it held: its peak) within 5 % of its plan and steady after the first step,
    and the recomputing one lower by at least half what its plan saves (a fifth of the
    plan here, where cuBLAS's 32 MiB workspace is a third of it)."""
    cuda, _ = libs
    cfg = _cfg("nanoeuler", "model.num_layers=4", "training.batch_size=16")
    pool = cp.get_default_memory_pool()
    used, planned = {}, {}
    for mode in ("none", "blocks"):
        gc.collect()
        pool.free_all_blocks()
        before = pool.total_bytes()
        model, stepper, sizes = _three_planned_steps(cuda, cp, cfg, dtype="bf16",
                                                     cuda_graph=True, recompute=mode)
        used[mode], planned[mode] = pool.total_bytes() - before, model.mem.plan.total_bytes
        assert used[mode] <= 1.05 * planned[mode], (mode, used[mode], planned[mode])
        assert sizes[-1] == sizes[0], f"{mode}: steps 2-3 grew the pool"
        del model, stepper
    saved = planned["none"] - planned["blocks"]
    assert saved > 0.2 * planned["none"], planned
    assert used["none"] - used["blocks"] >= saved / 2, (used, planned)
