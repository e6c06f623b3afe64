"""Ranks and their launcher (runtime/distributed/workers.py): a rank `train --nproc` starts
ends with its launcher, however the launcher ends."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest


def _gone(pid: int) -> bool:
    """Whether process `pid` has ended (a zombie no one has reaped yet counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_rank_dies_with_its_launcher_even_by_kill_9():
    rank = ("import time; from eulergen.runtime.distributed.workers import follow_launcher; "
            "follow_launcher(); print('following', flush=True); time.sleep(60)")
    launcher = ("import os, subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
                f"{rank!r}], env={{**os.environ, 'EULERGEN_LAUNCHER_PID': str(os.getpid())}}); "
                "print(p.pid, flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    try:
        child = int(proc.stdout.readline())
        assert proc.stdout.readline().strip() == "following"
        proc.kill()   # no handler runs: only the kernel's parent-death signal can end the rank
        proc.wait()
        deadline = time.monotonic() + 10
        while not _gone(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(child), "the rank outlived its launcher"
    finally:
        proc.kill()
