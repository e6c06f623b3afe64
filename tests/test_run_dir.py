"""Run folders: a folder of the user's own files is refused and left as it was, a folder
a trainer holds is refused to a second trainer (in process, and across processes) while
the first runs on, and a lock left by a killed trainer does not block the next resume."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from eulergen.cli import main
from eulergen.errors import EulerError
from eulergen.runtime.train import checkpoint, run_dir
from eulergen.runtime.engine.backend import NUMPY
from eulergen.runtime.train.config import load_config
from eulergen.runtime.engine.ops import OpLibrary
from eulergen.runtime.train.trainer import Trainer, resume_config


def tiny(shard: Path, run: Path, **training) -> list[str]:
    t = dict(batch_size=2, seq_len=16, total_steps=4, warmup_steps=1, eval_every=0,
             checkpoint_every=2, log_every=1, sample_tokens=0)
    t.update(training)
    return [f"run_dir={run}", f"data.dataset={shard}", "data.val_dataset=null",
            "model.hidden_dim=32", "model.num_layers=1", "model.num_heads=1",
            "model.num_kv_heads=1", "model.max_seq_len=16", "model.mlp_hidden=32",
            *(f"training.{k}={v}" for k, v in t.items())]


def cli_sets(sets: list[str]) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


def tree_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def lib():
    return OpLibrary(NUMPY)


def test_a_folder_of_the_users_own_files_is_refused_and_left_as_it_was(shard, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    for name in ("config.json", "metrics.jsonl", "loss.png"):
        (mine / name).write_text(f"the user's {name}\n")
    before = tree_digest(mine)
    got = CliRunner().invoke(main, ["train", "--device", "numpy",
                                    *cli_sets(tiny(shard, mine))])
    assert got.exit_code == 2, got.output
    assert "eulergen did not write" in got.output and str(mine) in got.output
    assert got.output.count("\n") == 1 and "Traceback" not in got.output
    assert tree_digest(mine) == before


def test_a_file_given_as_the_run_folder_is_one_line(shard, tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("mine")
    got = CliRunner().invoke(main, ["train", "--device", "numpy",
                                    *cli_sets(tiny(shard, path))])
    assert got.exit_code == 2 and "is not a folder" in got.output, got.output
    assert path.read_text() == "mine"


def test_plot_never_writes_over_a_loss_png_it_did_not_make(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "train_loss": 2.0}\n')
    (tmp_path / "loss.png").write_bytes(b"the user's picture")
    got = CliRunner().invoke(main, ["plot", str(tmp_path)])
    assert got.exit_code == 2 and "not overwritten" in got.output, got.output
    assert (tmp_path / "loss.png").read_bytes() == b"the user's picture"


def test_a_second_trainer_is_refused_while_the_first_holds_the_folder(lib, shard, tmp_path):
    run = tmp_path / "run"
    first = Trainer(load_config(None, tiny(shard, run)), lib, progress=False, tensorboard=False)
    with pytest.raises(EulerError, match="in use by another trainer"):
        Trainer(load_config(None, tiny(shard, run)), lib, progress=False, tensorboard=False)
    with pytest.raises(EulerError, match="in use by another trainer"):
        Trainer(resume_config(run), lib, resume=True, progress=False, tensorboard=False)
    result = first.run()
    assert list(result.losses) == [1, 2, 3, 4]
    assert [p.name for _, p in checkpoint._checkpoints(run)] == ["ckpt_00000002",
                                                                  "ckpt_00000004"]
    # released at the end of the run: the folder can be continued
    more = Trainer(resume_config(run, ["training.total_steps=5"]), lib, resume=True,
                   progress=False, tensorboard=False).run()
    assert list(more.losses) == [5]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-c", "from eulergen.cli import main; main()", *args]


def _wait_for_lock(run: Path, proc: subprocess.Popen) -> None:
    """Until `proc` has written its pid into the run's marker (it holds the lock then)."""
    marker = run / run_dir.MARKER
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if marker.is_file() and f'"pid": {proc.pid}' in marker.read_text():
            return
        time.sleep(0.02)
    raise AssertionError(f"the first trainer never locked {run} (exit {proc.poll()})")


def test_two_trainer_processes_on_one_folder_the_second_refused_the_first_finishes(shard,
                                                                                   tmp_path):
    run = tmp_path / "run"
    sets = tiny(shard, run, total_steps=6, checkpoint_every=2)
    first = subprocess.Popen(_cli("train", "--device", "numpy", *cli_sets(sets)),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_lock(run, first)
        os.kill(first.pid, signal.SIGSTOP)   # held still, mid-run: no race with its end
        for args in (["train", "--resume", str(run)],
                     ["train", "--device", "numpy", *cli_sets(sets)]):
            got = CliRunner().invoke(main, args)
            assert got.exit_code == 2, got.output
            assert f"in use by another trainer (pid {first.pid})" in got.output, got.output
            assert got.output.count("\n") == 1
        os.kill(first.pid, signal.SIGCONT)
        out, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, err
    assert checkpoint.latest(run).name == "ckpt_00000006"
    assert checkpoint.load(run).step == 6
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_a_lock_left_by_a_killed_trainer_does_not_block_the_next_resume(lib, shard, tmp_path):
    run = tmp_path / "run"
    Trainer(load_config(None, tiny(shard, run, total_steps=2)), lib, progress=False,
            tensorboard=False).run()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from eulergen.runtime.train.run_dir import RunLock;"
         f"lock = RunLock({str(run)!r}).acquire(); print('locked', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(EulerError, match=f"pid {holder.pid}"):
            run_dir.check(run)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    rest = Trainer(resume_config(run, ["training.total_steps=3"]), lib, resume=True,
                   progress=False, tensorboard=False).run()
    assert list(rest.losses) == [3]
