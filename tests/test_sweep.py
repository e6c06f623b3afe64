"""`eulergen sweep` on numpy with a tiny model: a 3-setting x 2-seed grid runs to its
tables (its runs the runs a lone trainer makes), a sweep interrupted mid-way resumes running
only what was left (the interrupted run from its checkpoint, or again from step 0 when it
saved none), a run that fails leaves the others to run, and the rule that calls a
difference real."""
from __future__ import annotations

import hashlib
import json
import statistics
from pathlib import Path

import pytest
from click.testing import CliRunner

from eulergen.cli import main
from eulergen.errors import EulerError
from eulergen.runtime.engine.backend import NUMPY
from eulergen.runtime.engine.ops import OpLibrary
from eulergen.runtime.train import sweep as sweeps
from eulergen.runtime.train.metrics import read_metrics
from eulergen.runtime.train.sweep_stats import setting_stats
from eulergen.runtime.train.trainer import Trainer
from runs import losses


def _sets(shard: Path, **training) -> list[str]:
    t = dict(batch_size=2, seq_len=16, total_steps=4, warmup_steps=1, eval_every=2,
             eval_steps=2, checkpoint_every=2, log_every=1, sample_tokens=0, device="numpy")
    t.update(training)
    return [f"data.dataset={shard}", f"data.val_dataset={shard}", "model.hidden_dim=32",
            "model.num_layers=1", "model.num_heads=1", "model.num_kv_heads=1",
            "model.max_seq_len=16", "model.mlp_hidden=32",
            *(f"training.{k}={v}" for k, v in t.items())]


def _digest(folder: Path) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(folder.rglob("*"))
                                   if p.is_file())).hexdigest()


def test_a_three_by_two_sweep_runs_every_point_and_prints_its_tables(shard, tmp_path):
    out = tmp_path / "sw"
    args = ["sweep", "--out", str(out), "--seeds", "2",
            "--set", "model.activation=gelu,relu2,silu",
            *(a for s in _sets(shard) for a in ("--set", s))]
    got = CliRunner().invoke(main, args)
    assert got.exit_code == 0, got.output
    manifest = json.loads((out / sweeps.MANIFEST).read_text())
    assert [(r["setting"], r["seed"], r["status"]) for r in manifest["runs"]] == \
        [([["model.activation", act]], seed, "done")
         for seed in (1337, 1338) for act in ("gelu", "relu2", "silu")]
    final = {}
    for run in manifest["runs"]:
        config = json.loads((out / run["dir"] / "config.json").read_text())
        assert config["training"]["seed"] == run["seed"]
        assert config["model"]["activation"] == run["setting"][0][1]
        last = read_metrics(out / run["dir"])[-1]
        final.setdefault(run["setting"][0][1], []).append(last["val_loss"])
    stdout = got.stdout
    for act, vals in final.items():   # the settings table: mean and sample std over seeds
        row = next(line for line in stdout.splitlines() if f"│ {act} " in line and "±" not in line
                   and line.count("│") == 8)
        assert f"{statistics.fmean(vals):.4f}" in row and f"{statistics.stdev(vals):.4f}" in row
    assert "(first)" in stdout and "real: |Δ| > 2 standard errors" in stdout
    assert (out / "compare.png").read_bytes()[:4] == b"\x89PNG"
    assert "the sweep's own time" in stdout
    # in one process, one run after another: each is the run a lone trainer makes
    grid, _ = sweeps.load_sweep(out)
    alone = Trainer(sweeps.config_from_dict({**sweeps.as_dict(grid.trials[4].config),
                                             "run_dir": str(tmp_path / "alone")}),
                    OpLibrary(NUMPY), progress=False, tensorboard=False).run()
    assert losses(out / grid.trials[4].dir) == alone.losses   # bit for bit


@pytest.mark.parametrize("stop, how", [(3, "resumed at step 2"), (1, "restarted")])
def test_an_interrupted_sweep_resumes_running_only_what_was_left(shard, tmp_path, monkeypatch,
                                                                 stop, how):
    grid = sweeps.new_sweep(None, [*_sets(shard), "model.activation=gelu,relu2,silu"], 1,
                            tmp_path / "sw")
    lib = OpLibrary(NUMPY)
    real_run = Trainer.run

    def interrupted(self, stop_after=None):   # the second run is stopped part way
        if self.run_dir.name == grid.trials[1].dir:
            real_run(self, stop_after=stop)
            raise KeyboardInterrupt
        return real_run(self, stop_after)

    monkeypatch.setattr(Trainer, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sweeps.run_sweep(grid, lib, say=lambda line: None, progress=False, tensorboard=False)
    monkeypatch.setattr(Trainer, "run", real_run)
    finished = _digest(grid.path / grid.trials[0].dir)
    again, status = sweeps.load_sweep(grid.path)
    assert [status[t.dir]["status"] for t in again.trials] == ["done", "running", "pending"]
    ran = sweeps.run_sweep(again, lib, status, say=lambda line: None, progress=False,
                           tensorboard=False)
    assert [r.how for r in ran] == ["skipped", how, "new"]
    assert _digest(grid.path / grid.trials[0].dir) == finished
    assert [r["step"] for r in read_metrics(grid.path / grid.trials[1].dir)] == [1, 2, 3, 4]
    runs, stats = sweeps.report(again, ran)
    assert len(runs) == 3 and [len(s.losses) for s in stats] == [1, 1, 1]


def test_a_run_that_fails_is_marked_failed_and_the_sweep_goes_on(shard, tmp_path, monkeypatch):
    grid = sweeps.new_sweep(None, [*_sets(shard), "model.activation=gelu,relu2"], 1,
                            tmp_path / "sw")
    real_run = Trainer.run

    def diverges(self, stop_after=None):
        if self.run_dir.name == grid.trials[0].dir:
            raise EulerError("loss nan at step 1; stopped", key="training")
        return real_run(self, stop_after)

    monkeypatch.setattr(Trainer, "run", diverges)
    ran = sweeps.run_sweep(grid, OpLibrary(NUMPY), say=lambda line: None, progress=False,
                           tensorboard=False)
    assert [r.error for r in ran] == ["training: loss nan at step 1; stopped", None]
    _, status = sweeps.load_sweep(grid.path)
    assert [s["status"] for s in status.values()] == ["failed", "done"]
    runs, stats = sweeps.report(grid, ran)
    assert [r.name for r in runs] == [grid.trials[1].dir] and stats[0].losses == ()


def test_the_difference_is_real_beyond_two_standard_errors():
    gelu, near, far = (2.00, 2.02, 2.04), (2.01, 2.03, 2.05), (1.80, 1.82, 1.84)
    stats = setting_stats([((("k", "a"),), gelu), ((("k", "b"),), near), ((("k", "c"),), far)])
    se = (2 * statistics.variance(gelu) / 3) ** 0.5
    assert stats[0].first and stats[0].diff is None
    assert stats[1].z == pytest.approx(0.01 / se) and stats[1].real is False
    assert stats[2].z == pytest.approx(-0.2 / se) and stats[2].real is True
    one_seed = setting_stats([((("k", "a"),), (2.0,)), ((("k", "b"),), (1.0,))])
    assert one_seed[1].diff == pytest.approx(-1.0) and one_seed[1].real is None
