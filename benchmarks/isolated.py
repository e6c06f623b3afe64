"""A benchmark configuration in a fresh process, so that compile caches, the allocators'
pools and a crash stay with the configuration that made them, and one failure is a line
in the table while the rest goes on.

The child adds JSON records to the file its `--result` names (`emit`: a line each,
flushed, so what it wrote before dying is kept); `run_child` returns them with the one
line that says why the child failed, if it did: its last error line, the signal that
killed it, or the time it ran out of. A `Deadline` for the whole benchmark caps each
child, so a call with a hard limit (a lent GPU's 10 minutes) still ends with its table.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


@dataclass
class Outcome:
    records: list[dict] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0


def emit(path: str, record: dict) -> None:
    """Add `record` to the JSON lines file `path`, flushed to disk at once."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_records(path: str) -> list[dict]:
    """The records of a JSON lines file; a last line cut short by a kill is dropped."""
    records = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    break
    except FileNotFoundError:
        pass
    return records


def run_child(argv: list[str], timeout: float, env: dict | None = None) -> Outcome:
    """Run `argv --result FILE` in a process group of its own (in `env`, default this
    process's environment), its stderr passed through; kill the group after `timeout`
    seconds."""
    if timeout < 1:
        return Outcome(error="not run: the benchmark's deadline had passed")
    fd, path = tempfile.mkstemp(prefix="eulergen-bench-", suffix=".jsonl")
    os.close(fd)
    started = time.monotonic()
    proc = subprocess.Popen([*argv, "--result", path], stderr=subprocess.PIPE, text=True,
                            errors="replace", start_new_session=True, env=env)
    tail: deque[str] = deque(maxlen=40)

    def pump() -> None:
        for line in proc.stderr:
            sys.stderr.write(line)
            tail.append(line.rstrip())
    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout)
        error = None if rc == 0 else _why(tail, rc)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)   # the child and its compile workers
        proc.wait()
        error = f"timed out after {timeout:.0f} s"
    reader.join(timeout=5)
    records = read_records(path)
    os.unlink(path)
    return Outcome(records, error, time.monotonic() - started)


def _why(tail, rc: int) -> str:
    """The child's last error line (a traceback's last line), else how it ended."""
    lines = [line.strip() for line in tail if line.strip()]
    errors = [line for line in lines if "Error" in line.split(":")[0] or line.startswith("error:")]
    how = f"killed by signal {-rc}" if rc < 0 else f"exit {rc}"
    last = errors[-1] if errors else lines[-1] if lines else ""
    return f"{last[:200]} ({how})" if last else how
