"""`ensure_built` started in a second process, so that an edited op's derivation (importing
sympy, then deriving and rendering: seconds of one core) runs while the caller starts its
GPU (CuPy, cuBLASLt's probe); the caller's own `ensure_built` then finds the build current.

The second process only saves time. Whatever it does, the caller's `ensure_built` derives
what is still stale and raises its errors as it always does, so the child's output is
dropped; builds are written atomically, so a child that is killed or dies leaves nothing
half-written. The wait for it is bounded by WAIT_S. Where the interpreter writes no
bytecode, the child keeps its own under $EULERGEN_CACHE/pycache (sympy's import: 2.0 s
from source on the lent H200 machine, benchmarks/RESULTS.md).

    child = start(names, ops_dirs)   # None: nothing to derive
    ...                              # the caller's own start
    finish(child)
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from eulergen import cache_dir
from eulergen.generator.build import ensure_built, stale

WAIT_S = 120.0   # a derivation takes seconds; past this the caller derives it itself


def start(names, ops_dirs) -> subprocess.Popen | None:
    """The child building what `ensure_built(names, ops_dirs)` would, if anything is stale."""
    if not stale(names, ops_dirs):
        return None
    payload = json.dumps({"names": list(names), "ops": [str(d) for d in ops_dirs]})
    return subprocess.Popen([sys.executable, "-m", __name__, payload],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def finish(child: subprocess.Popen | None, timeout: float = WAIT_S) -> None:
    """Wait for the child at most `timeout` seconds; past that it is killed."""
    if child is None:
        return
    try:
        child.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


if __name__ == "__main__":
    if sys.dont_write_bytecode and sys.pycache_prefix is None:
        # An interpreter told to write no bytecode (PYTHONDONTWRITEBYTECODE, as container
        # images set it) often has none for sympy either, and compiles it from source on
        # every import: this process keeps its own bytecode in eulergen's cache instead,
        # never beside the sources.
        sys.pycache_prefix = str(cache_dir() / "pycache")
        sys.dont_write_bytecode = False
    args = json.loads(sys.argv[1])
    try:
        ensure_built(args["names"], [Path(d) for d in args["ops"]])
    except Exception:   # the caller's ensure_built meets it again and reports it
        sys.exit(1)
