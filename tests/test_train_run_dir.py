"""`eulergen train` twice in a row: without --run-dir each run writes a new folder; a named
folder that holds checkpoints is refused, never overwritten."""
from __future__ import annotations

import dataclasses
import json

from click.testing import CliRunner

from eulergen.cli import main
from eulergen.runtime.train.config import load_config

SHORT = ["--set", "training.total_steps=2", "--set", "training.warmup_steps=1",
         "--set", "training.eval_every=0", "--set", "training.sample_tokens=0",
         "--device", "numpy"]


def test_a_fresh_run_dir_is_stamped_and_never_an_existing_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = load_config(None, fresh_run_dir=True).run_dir
    assert first.startswith("runs/default-") and first != "runs/default"
    (tmp_path / first).mkdir(parents=True)
    assert load_config(None, fresh_run_dir=True).run_dir != first
    # a run_dir that is given anywhere is kept as given
    assert load_config(None, ["run_dir=mine"], fresh_run_dir=True).run_dir == "mine"
    assert load_config(None).run_dir == "runs/default"


def test_train_twice_writes_two_run_folders_and_refuses_a_used_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    for _ in range(2):
        got = runner.invoke(main, ["train", *SHORT])
        assert got.exit_code == 0, got.output
        header = [line for line in got.output.splitlines() if line.startswith("eulergen train:")]
        assert "the built-in CPU default" in header[0], got.output
    runs = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert len(runs) == 2 and all(r.startswith("default-") for r in runs)
    saved = json.loads((tmp_path / "runs" / runs[0] / "config.json").read_text())
    assert saved["model"] == dataclasses.asdict(load_config(None).model), "every key, saved"
    assert all(any((tmp_path / "runs" / r).glob("ckpt_*")) for r in runs)
    used = runner.invoke(main, ["train", "--run-dir", f"runs/{runs[0]}", *SHORT])
    assert used.exit_code == 2 and "holds checkpoints" in used.output
