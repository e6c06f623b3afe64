"""What the tests that run `eulergen train` share: a run folder's losses from its
metrics.jsonl (read strictly: a corrupt line fails the test), and the kill -9 then --resume
sequence, for the numpy (tests/test_train.py) and the GPU (tests/gpu/test_resume_gpu.py) runs."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path


def losses(run: Path) -> dict[int, float]:
    """{step: train_loss} of every record in the run's metrics.jsonl."""
    return {r["step"]: r["train_loss"] for r in
            map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def first_loss(run: Path) -> float:
    return json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["train_loss"]


def kill_minus_nine_then_resume(args: list[str], sets_of, tmp_path: Path, timeout: float,
                                wait: float, poll: float) -> None:
    """Runs `args` (ending in `--device D`) with the --set overrides `sets_of(run_dir)` in
    tmp_path/straight to the end, and in tmp_path/killed until its first checkpoint, kills
    that one with SIGKILL and resumes it with --resume; every run must succeed. `timeout`
    bounds each run, `wait` the wait for the checkpoint, polled every `poll` seconds."""
    from eulergen.runtime.train import checkpoint
    killed = tmp_path / "killed"
    done = subprocess.run(args + [a for s in sets_of(tmp_path / "straight") for a in ("--set", s)],
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr
    proc = subprocess.Popen(args + [a for s in sets_of(killed) for a in ("--set", s)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + wait
    while checkpoint.latest(killed) is None and time.time() < deadline:
        time.sleep(poll)
    # killed mid-run, with a checkpoint to resume from (else the resume below starts over
    # and matches trivially)
    assert checkpoint.latest(killed) is not None and proc.poll() is None, \
        "the run ended before it could be killed mid-way: give it more steps"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    resumed = subprocess.run(args[:-2] + ["--resume", str(killed)],
                             capture_output=True, text=True, timeout=timeout)
    assert resumed.returncode == 0, resumed.stderr
