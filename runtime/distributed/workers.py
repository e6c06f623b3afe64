"""`eulergen train --nproc N`: N worker processes on this machine, each a plain
`python -m eulergen train …` under torchrun's environment variables (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so that the workers take the same path as under
torchrun or srun. The ranks die with their launcher, however it ends (`follow_launcher`)."""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

from eulergen import env
from eulergen.errors import EulerError
from eulergen.runtime.distributed.collective import TIMEOUT_ENV, free_port
from eulergen.runtime.distributed.nccl import ENV as NCCL_ENV

POLL_S = 0.1
LAUNCHER_ENV = "EULERGEN_LAUNCHER_PID"
PR_SET_PDEATHSIG = 1   # linux/prctl.h


def check_ranks(nproc: int, device: str) -> None:
    """--nproc against what its ranks run on, refused before any starts: one rank a GPU on
    CuPy, one a core on numpy (more only contend, and a thousand bury the machine)."""
    from eulergen.runtime.engine.backend import get_backend
    backend = get_backend(device, notice=lambda line: None)
    if backend.is_gpu:
        visible = backend.xp.cuda.runtime.getDeviceCount()
        if nproc > visible:
            raise EulerError(f"{nproc:,} ranks, one per GPU, but {visible} GPUs are visible",
                             key="--nproc")
        return
    cores = len(os.sched_getaffinity(0))
    if nproc > cores:
        raise EulerError(f"{nproc:,} ranks on numpy, one a core, but this machine gives "
                         f"{cores}", key="--nproc")


def follow_launcher() -> None:
    """In a rank `--nproc` started (LAUNCHER_ENV names the launcher): die with the launcher.
    The kernel sends this process SIGTERM when the launcher ends, even by kill -9
    (PR_SET_PDEATHSIG, through libc's prctl on Linux), and a launcher already gone when
    the rank asks ends it at once. Without prctl (not Linux) a rank that outlives its
    launcher stops at its next collective once its peers have gone."""
    launcher = env.get(LAUNCHER_ENV)
    if launcher is None:
        return
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != launcher:   # it died before the signal was asked for
        raise SystemExit(f"eulergen: the launcher (pid {launcher}) has gone; rank stopped")


def run_workers(nproc: int, args: list[str]) -> int:
    """Start the ranks, wait for all; when one fails, the others stop on their own (their
    next collective names it) and are ended after the collective timeout. Returns the exit
    status: 0, or the first failed rank's."""
    timeout = env.get(TIMEOUT_ENV)   # a bad value: one line, before any rank starts
    base = {**os.environ, "WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()), LAUNCHER_ENV: str(os.getpid()), **NCCL_ENV}
    procs = [subprocess.Popen([sys.executable, "-m", "eulergen", "train", *args],
                              env={**base, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(nproc)]
    failed, deadline = None, None
    while any(p.poll() is None for p in procs):
        if failed is None:
            failed = next((r for r, p in enumerate(procs) if p.poll()), None)
            if failed is not None:
                deadline = time.monotonic() + timeout
        elif time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(POLL_S)
    failed = failed if failed is not None else next(
        (r for r, p in enumerate(procs) if p.returncode), None)
    if failed is None:
        return 0
    print(f"eulergen: rank {failed} exited with status {procs[failed].returncode}",
          file=sys.stderr)
    return procs[failed].returncode or 1
