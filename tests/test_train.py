"""The training loop on numpy: schedules, loss falling, resume exactness (in process and
after `kill -9`), a NaN loss, and config errors reaching the CLI. (The spike guard:
tests/test_step_control.py.)"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from eulergen.cli import main
from eulergen.errors import EulerError
from eulergen.runtime.train import checkpoint
from eulergen.runtime.engine.backend import NUMPY
from eulergen.runtime.train.config import load_config
from eulergen.runtime.engine.ops import OpLibrary
from eulergen.runtime.train.trainer import Trainer, learning_rate, resume_config
from runs import kill_minus_nine_then_resume, losses


@pytest.fixture(scope="module")
def lib():
    return OpLibrary(NUMPY)


def _overrides(shard: Path, run_dir: Path, **training) -> list[str]:
    t = dict(batch_size=4, seq_len=32, total_steps=8, warmup_steps=2, learning_rate=3e-3,
             eval_every=4, eval_steps=2, checkpoint_every=3, log_every=1, sample_tokens=0)
    t.update(training)
    return [f"run_dir={run_dir}", f"data.dataset={shard}", f"data.val_dataset={shard}",
            "model.hidden_dim=32", "model.num_layers=2", "model.num_heads=2",
            "model.max_seq_len=32", "model.mlp_hidden=64",
            *(f"training.{k}={v}" for k, v in t.items())]


def _trainer(lib, shard, run_dir, resume=False, **training):
    cfg = load_config(None, _overrides(shard, run_dir, **training))
    return Trainer(cfg, lib, resume=resume, progress=False, tensorboard=False)


# -- schedules ---------------------------------------------------------------------------

def test_cosine_schedule_warms_up_then_decays_to_min_lr():
    t = load_config(None, ["training.learning_rate=1.0", "training.min_lr=0.1",
                           "training.warmup_steps=10", "training.total_steps=110"]).training
    assert learning_rate(t, 5) == pytest.approx(0.5)
    assert learning_rate(t, 10) == pytest.approx(1.0)
    assert learning_rate(t, 60) == pytest.approx(0.55)
    assert learning_rate(t, 110) == pytest.approx(0.1)


@pytest.mark.parametrize("schedule, midway", [("linear", 0.55), ("constant", 1.0)])
def test_linear_and_constant_schedules(schedule, midway):
    t = load_config(None, ["training.learning_rate=1.0", "training.min_lr=0.1",
                           "training.warmup_steps=10", "training.total_steps=110",
                           f"training.schedule={schedule}"]).training
    assert learning_rate(t, 60) == pytest.approx(midway)


# -- training -----------------------------------------------------------------------------

def test_loss_falls_and_run_folder_has_metrics_checkpoints_and_plot(lib, shard, tmp_path):
    result = _trainer(lib, shard, tmp_path / "run", total_steps=24, eval_every=8,
                      sample_tokens=16).run()
    assert result.val_losses[24] < result.val_losses[8] - 0.3, result.val_losses
    assert result.sample
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 25))
    assert checkpoint.latest(run).name == "ckpt_00000024"
    assert (run / "loss.png").is_file()


def test_resume_repeats_the_uninterrupted_losses_bitwise(lib, shard, tmp_path):
    straight = _trainer(lib, shard, tmp_path / "a").run()
    first = _trainer(lib, shard, tmp_path / "b")
    first.run(stop_after=5)                       # checkpoints at 3; steps 4-5 are lost
    assert first.result.losses == {s: straight.losses[s] for s in range(1, 6)}, \
        "two runs with one seed must agree"
    assert checkpoint.latest(tmp_path / "b").name == "ckpt_00000003"
    cfg = resume_config(tmp_path / "b")
    resumed = Trainer(cfg, lib, resume=True, progress=False, tensorboard=False)
    assert resumed.step == 3
    rest = resumed.run()
    assert list(rest.losses) == list(range(4, 9))
    for step in range(4, 9):
        assert rest.losses[step] == straight.losses[step], f"step {step}"
    assert rest.val_losses[8] == straight.val_losses[8]


@pytest.mark.slow
def test_kill_minus_nine_then_resume_matches_an_uninterrupted_run(shard, tmp_path):
    args = [sys.executable, "-c", "from eulergen.cli import main; main()", "train",
            "--device", "numpy"]
    kill_minus_nine_then_resume(
        args, lambda run: _overrides(shard, run, total_steps=40, checkpoint_every=2), tmp_path,
        timeout=600, wait=300, poll=0.05)
    assert losses(tmp_path / "killed") == losses(tmp_path / "straight")


def test_nan_loss_stops_naming_the_step_and_keeps_the_last_checkpoint(lib, shard, tmp_path):
    _trainer(lib, shard, tmp_path / "nan").run(stop_after=3)
    trainer = _trainer(lib, shard, tmp_path / "nan", resume=True)
    trainer.model.params["ln_f.weight"][0] = np.nan
    with pytest.raises(EulerError, match="at step 4.*ckpt_00000003"):
        trainer.run()
    assert checkpoint.latest(tmp_path / "nan").name == "ckpt_00000003"


def test_a_fresh_run_refuses_a_folder_with_checkpoints(lib, shard, tmp_path):
    _trainer(lib, shard, tmp_path / "r", total_steps=3).run()
    with pytest.raises(EulerError, match="--resume"):
        _trainer(lib, shard, tmp_path / "r", total_steps=3)


# -- the CLI ------------------------------------------------------------------------------

@pytest.mark.parametrize("setting, says", [
    ("model.num_heads=5", "model.num_heads"),
    ("training.learnig_rate=1e-3", "did you mean 'learning_rate'"),
    ("model.activation=gelux", "model.activation"),
])
def test_config_errors_reach_the_cli_as_one_line(setting, says, tmp_path):
    result = CliRunner().invoke(main, ["train", "--device", "numpy", "--run-dir",
                                       str(tmp_path / "run"), "--set", setting])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and says in lines[0], result.output


def test_sample_command_continues_the_prompt_from_a_run(lib, shard, tmp_path):
    _trainer(lib, shard, tmp_path / "s", total_steps=3).run()
    args = ["sample", str(tmp_path / "s"), "--prompt", "def ", "--max-new-tokens", "12",
            "--device", "numpy"]
    first = CliRunner().invoke(main, args)
    assert first.exit_code == 0, first.output
    assert first.output.startswith("def ") and len(first.output) > len("def \n")
    assert CliRunner().invoke(main, args).output == first.output, "same seed, same text"


def test_resume_with_more_steps_continues_past_the_old_end(lib, shard, tmp_path):
    _trainer(lib, shard, tmp_path / "m", total_steps=4, warmup_steps=1).run()
    cfg = resume_config(tmp_path / "m", ["training.total_steps=6"])
    rest = Trainer(cfg, lib, resume=True, progress=False, tensorboard=False).run()
    assert list(rest.losses) == [5, 6]


def test_plan_command_prints_every_buffer_and_the_total(tmp_path):
    result = CliRunner().invoke(main, ["plan", "--set", "model.num_layers=2"])
    assert result.exit_code == 0, result.output
    for name in ("wte.weight", "h.1.mlp.c_proj.weight", "adamw.v", "h.1.act", "d.x", "total"):
        assert name in result.output


@pytest.fixture
def fake_gpu(monkeypatch):
    """get_backend('auto') finds a GPU here (the resolution logic's view of one)."""
    from eulergen.runtime.engine import backend
    monkeypatch.setattr(backend, "_cuda_backend",
                        lambda: backend.Backend("cuda", np, True, "fake GPU (sm_90)", 90))


def _plan_title(args) -> str:
    result = CliRunner().invoke(main, ["plan", *args])
    assert result.exit_code == 0, result.output
    return next(line for line in result.output.splitlines() if "memory plan" in line)


def test_plan_shows_the_default_of_the_device_the_run_resolves_to(fake_gpu):
    gpu = load_config(None, finds_gpu=lambda: True)
    t = gpu.training
    title = _plan_title([])
    assert "the built-in GPU default" in title and f"B={t.batch_size}, T={t.seq_len}" in title
    assert "the built-in CPU default" in _plan_title(["--set", "training.device=numpy"])
    # --set values win over the device's default
    assert "B=3," in _plan_title(["--set", "training.batch_size=3"])


def test_plan_on_a_machine_without_a_gpu_takes_the_cpu_default_or_plans_the_gpu_one():
    cpu = load_config(None)
    title = _plan_title([])   # this machine: no CuPy, or no device
    assert "the built-in CPU default" in title
    assert f"B={cpu.training.batch_size}, T={cpu.training.seq_len}" in title
    assert "the built-in GPU default" in _plan_title(["--set", "training.device=cuda"])

