"""Resume on the GPU (`pytest -m gpu tests/gpu`): a run stopped after its checkpoint and
resumed repeats the uninterrupted run's losses bit for bit, in fp32 and in bf16 (of either
training.precision: bf16 or autocast), its steps
replayed as CUDA graphs (training.cuda_graph, the default) and its step control's state
(update count, spike guard) read back from the device into the checkpoint. This
holds only because every kernel on the path is deterministic (no float atomics: weight
gradients, embedding and attention backward reduce in a fixed order) and cuBLAS runs the
same algorithms; in bf16 also because the checkpoint holds the float32 master weights and
the bf16 copy is rounded from them, on resume as after every update."""
from __future__ import annotations

import numpy as np
import pytest

from eulergen.runtime.train import checkpoint
from eulergen.runtime.train.config import load_config
from eulergen.runtime.train.trainer import Trainer, resume_config
from runs import kill_minus_nine_then_resume, losses  # tests/ is on the path

pytestmark = pytest.mark.gpu


# a run's dtype: its training.dtype and training.precision
PRECISIONS = {"fp32": ["training.dtype=fp32"],
              "bf16": ["training.dtype=bf16", "training.precision=bf16"],
              "autocast": ["training.dtype=bf16", "training.precision=autocast"]}


def _trainer(lib, shard, run_dir, preset, dtype, resume=False):
    # head dim 64 (a size the flash kernels take); TF32 stays on, as a real run has it
    sets = [f"run_dir={run_dir}", f"data.dataset={shard}", f"data.val_dataset={shard}",
            f"model.preset={preset}", "model.vocab_size=256", "model.hidden_dim=128",
            "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
            "model.max_seq_len=128", "model.mlp_hidden=256", "training.batch_size=4",
            "training.seq_len=128", "training.total_steps=8", "training.warmup_steps=2",
            "training.eval_every=4", "training.eval_steps=2", "training.checkpoint_every=3",
            "training.log_every=1", "training.sample_tokens=0", "training.device=cuda",
            *PRECISIONS[dtype]]
    cfg = resume_config(run_dir) if resume else load_config(None, sets)
    return Trainer(cfg, lib, resume=resume, progress=False, tensorboard=False)


@pytest.mark.parametrize("dtype", sorted(PRECISIONS))
@pytest.mark.parametrize("preset", ["gpt2", "nanoeuler"])
def test_gpu_resume_repeats_the_uninterrupted_losses_bitwise(libs, shard, tmp_path, preset,
                                                             dtype):
    lib = libs[0]
    straight = _trainer(lib, shard, tmp_path / "a", preset, dtype).run()
    first = _trainer(lib, shard, tmp_path / "b", preset, dtype)
    first.run(stop_after=5)                       # checkpoints at 3; steps 4-5 are lost
    assert first.result.losses == {s: straight.losses[s] for s in range(1, 6)}, \
        "two GPU runs with one seed must agree bit for bit"
    assert checkpoint.latest(tmp_path / "b").name == "ckpt_00000003"
    resumed = _trainer(lib, shard, tmp_path / "b", preset, dtype, resume=True)
    assert resumed.step == 3
    rest = resumed.run()
    assert list(rest.losses) == list(range(4, 9))
    assert {s: rest.losses[s] for s in range(4, 9)} == {s: straight.losses[s] for s in range(4, 9)}
    assert rest.val_losses[8] == straight.val_losses[8]


def test_gpu_bf16_kill_minus_nine_then_resume_matches_an_uninterrupted_run(cp, shard, tmp_path):
    """`eulergen train --set training.dtype=bf16` (its steps CUDA graphs) killed by SIGKILL
    after a checkpoint and resumed with --resume: its metrics equal an uninterrupted run's,
    step for step, and so do its last checkpoint's weights and moments."""
    import sys

    def sets(run_dir):
        return [f"run_dir={run_dir}", f"data.dataset={shard}", f"data.val_dataset={shard}",
                "model.vocab_size=256", "model.hidden_dim=128", "model.num_layers=2",
                "model.num_heads=2", "model.max_seq_len=128", "model.mlp_hidden=256",
                "training.batch_size=16", "training.seq_len=128", "training.total_steps=600",
                "training.warmup_steps=10", "training.eval_every=0",
                "training.checkpoint_every=20", "training.log_every=1",
                "training.sample_tokens=0", "training.dtype=bf16", "training.precision=bf16",
                "training.cuda_graph=true"]

    args = [sys.executable, "-c", "from eulergen.cli import main; main()", "train",
            "--device", "cuda"]
    kill_minus_nine_then_resume(args, sets, tmp_path, timeout=300, wait=120, poll=0.02)
    assert losses(tmp_path / "killed") == losses(tmp_path / "straight")
    ends = [checkpoint.load(tmp_path / run) for run in ("straight", "killed")]
    assert ends[0].step == ends[1].step == 600 and ends[0].state["spike_guard"] == \
        ends[1].state["spike_guard"] and ends[0].state["adam_updates"] == ends[1].state["adam_updates"]
    for part in ("params", "optim"):
        a, b = (getattr(ck, part) for ck in ends)
        assert all(np.array_equal(a[k], b[k]) for k in a), part
