"""`eulergen train --nproc N`: N worker processes on this machine, each a plain
`python -m eulergen train …` under torchrun's environment variables (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so that the workers take the same path as under
torchrun or srun."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from eulergen.errors import EulerError
from eulergen.runtime.distributed.collective import collective_timeout, free_port
from eulergen.runtime.distributed.nccl import ENV as NCCL_ENV

POLL_S = 0.1


def check_gpus(nproc: int, device: str) -> None:
    """--nproc larger than the visible GPUs, on the CuPy backend: refused before starting."""
    from eulergen.runtime.engine.backend import get_backend
    backend = get_backend(device, notice=lambda line: None)
    if backend.is_gpu:
        visible = backend.xp.cuda.runtime.getDeviceCount()
        if nproc > visible:
            raise EulerError(f"{nproc} ranks, one per GPU, but {visible} GPUs are visible",
                             key="--nproc")


def run_workers(nproc: int, args: list[str]) -> int:
    """Start the ranks, wait for all; when one fails, the others stop on their own (their
    next collective names it) and are ended after the collective timeout. Returns the exit
    status: 0, or the first failed rank's."""
    timeout = collective_timeout(os.environ)   # a bad value: one line, before any rank starts
    env = {**os.environ, "WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), **NCCL_ENV}
    procs = [subprocess.Popen([sys.executable, "-m", "eulergen", "train", *args],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
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
