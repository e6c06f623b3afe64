"""A run folder's ownership and lock.

eulergen marks each run folder it creates with a small file, MARKER, and a trainer holds an
exclusive `flock` on it for as long as it trains. So a folder holding the user's own files
(their config.json, metrics.jsonl, loss.png) is refused instead of overwritten, and a second
trainer on a folder in use (`train --resume RUN` while RUN trains) is refused instead of
deleting the first one's save in progress. The kernel drops the lock when its process dies,
so a trainer killed with `kill -9` leaves a marker that the next resume simply locks again.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
from pathlib import Path

from eulergen import outputs
from eulergen.errors import EulerError
from eulergen.runtime.train import checkpoint

MARKER = outputs.marker("", "run").name   # .eulergen-run


def check(run_dir: str | Path) -> None:
    """Refuse, writing nothing, a run folder this trainer may not use: a file, a folder of
    files eulergen did not write (outputs.py's rule), or one another trainer holds."""
    run_dir = Path(run_dir)
    if outputs.marked(run_dir, "run"):
        RunLock(run_dir).acquire(mark=False).release()
        return
    # before the marker existed (or from another tool): a folder with a checkpoint is an
    # earlier eulergen run, which --resume may continue and a fresh run refuses (Trainer)
    if run_dir.is_dir() and checkpoint.latest(run_dir) is not None:
        return
    outputs.check_folder(run_dir, lambda name: False, by="eulergen")


class RunLock:
    """The exclusive lock on a run folder's MARKER (created, with the folder, on acquire)."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / MARKER
        self._file = None

    def acquire(self, *, mark: bool = True) -> RunLock:
        """Lock the folder (creating it), and with `mark` write this process's id into the
        marker, which a refused trainer's message names."""
        if self._file is not None:
            return self
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            f = open(self.path, "a+", encoding="utf-8")
        except OSError as err:
            raise EulerError(f"cannot create the run folder: {err.strerror}",
                             file=str(err.filename or self.run_dir)) from None
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            f.seek(0)
            holder = _pid(f.read())
            f.close()
            if err.errno not in (errno.EAGAIN, errno.EACCES):
                raise EulerError(f"cannot lock the run folder: {err.strerror}",
                                 file=str(self.path)) from None
            raise EulerError("in use by another trainer" + (f" (pid {holder})" if holder else "")
                             + ": wait for it to finish, or stop it first",
                             file=str(self.run_dir)) from None
        try:
            if mark:
                f.seek(0)
                f.truncate()
                f.write(json.dumps({"written_by": "eulergen", "pid": os.getpid()}) + "\n")
                f.flush()
        except OSError as err:
            f.close()
            raise EulerError(f"cannot write to the run folder: {err.strerror}",
                             file=str(self.path)) from None
        self._file = f
        return self

    def release(self) -> None:
        if self._file is not None:
            self._file.close()   # closing the descriptor drops the flock
            self._file = None


def _pid(text: str) -> int | None:
    try:
        return int(json.loads(text)["pid"])
    except (ValueError, KeyError, TypeError):
        return None
