"""`eulergen sweep` on the GPU (`pytest -m gpu tests/gpu`): a 2-setting x 2-seed sweep runs
its trainers one after another in one process, each run the run a lone trainer makes, the
sweep's own time under 3 s a run (issue 35's target), and no run's device memory kept by the
next."""
from __future__ import annotations

import gc
import re

import pytest
from click.testing import CliRunner

from eulergen.cli import main
from eulergen.runtime.train import sweep as sweeps
from eulergen.runtime.train.resolve import resolve
from eulergen.runtime.train.trainer import Trainer
from runs import losses  # tests/ is on the path

pytestmark = pytest.mark.gpu


def test_gpu_sweep_runs_in_process_with_little_overhead(cp, libs, shard, tmp_path):
    sets = [f"data.dataset={shard}", f"data.val_dataset={shard}", "model.vocab_size=256",
            "model.hidden_dim=128", "model.num_layers=2", "model.num_heads=2",
            "model.max_seq_len=128", "model.mlp_hidden=256", "training.batch_size=4",
            "training.total_steps=20", "training.warmup_steps=2", "training.eval_every=10",
            "training.eval_steps=2", "training.checkpoint_every=10", "training.sample_tokens=0",
            "model.activation=gelu,relu2"]
    out = tmp_path / "sw"
    got = CliRunner().invoke(main, ["sweep", "--device", "cuda", "--out", str(out), "--seeds",
                                    "2", *(a for s in sets for a in ("--set", s))])
    assert got.exit_code == 0, got.output
    own = re.search(r"the sweep's own time [\d.]+ s \(([\d.]+) s a run\)", got.stdout)
    assert own and float(own.group(1)) < 3.0, got.stdout
    print(own.group(0))
    grid, status = sweeps.load_sweep(out)
    assert [s["status"] for s in status.values()] == ["done"] * 4
    gc.collect()
    one_run = resolve(grid.trials[0].config, libs[0]).plan.total_bytes
    assert cp.get_default_memory_pool().used_bytes() < one_run, "a run's arrays outlived it"
    alone = Trainer(sweeps.config_from_dict({**sweeps.as_dict(grid.trials[3].config),
                                             "run_dir": str(tmp_path / "alone")}),
                    libs[0], progress=False, tensorboard=False).run()
    assert alone.losses                                          # the lone run trained
    # bit for bit at every step either run logged (the GPU logs every log_every steps)
    assert losses(out / grid.trials[3].dir) == losses(tmp_path / "alone")
