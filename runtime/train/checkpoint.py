"""Checkpoints: `ckpt_<step>/` holding model.safetensors (weights), optim.safetensors
(optimizer state) and state.json (step, data position, RNG, config, metrics), written
atomically and pruned to the last K. No pickle anywhere.

Atomicity: everything is written into a hidden temp folder beside the final one, each
file fsynced, then the folder is renamed into place and the run folder fsynced. A
`kill -9` leaves at worst a temp folder: `latest()` ignores it, and the run's next `save()`
removes it. Only the writer removes temp folders: a reader (a sampler, a resume check) that
did could delete a running trainer's save in progress.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from eulergen.errors import EulerError
from eulergen.userfiles import load_json, read_safetensors, read_text

MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optim.safetensors"
STATE_FILE = "state.json"
FORMAT = 1
_CKPT = re.compile(r"ckpt_(\d+)\Z")
_TEMP_PREFIX = ".tmp-ckpt_"


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    params: dict[str, np.ndarray]
    optim: dict[str, np.ndarray]
    state: dict[str, Any]


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / f"ckpt_{step:08d}"


def save(run_dir: str | Path, step: int, params: dict[str, np.ndarray],
         optim: dict[str, np.ndarray], state: dict[str, Any], keep: int = 3) -> Path:
    """Write checkpoint `step` atomically and keep only the newest `keep` checkpoints.

    `state` must be JSON-serialisable (data position, RNG state, config, metrics so far);
    `step` and a format number are added to it."""
    from safetensors import SafetensorError

    run_dir = Path(run_dir)
    final = checkpoint_dir(run_dir, step)
    try:
        _write(run_dir, step, final, params, optim, state)
    except (OSError, SafetensorError) as err:
        # disk full, a read-only or vanished folder: the earlier checkpoints are untouched
        # (nothing is renamed or pruned before the new one is whole)
        why = err.strerror if isinstance(err, OSError) and err.strerror else \
            str(err).rpartition("I/O error: ")[2]
        kept = latest(run_dir)
        raise EulerError(f"checkpoint of step {step} not saved: {why}; the latest saved one "
                         f"is {kept.name if kept else 'none'}", file=str(final)) from None
    _prune(run_dir, keep)
    return final


def _write(run_dir: Path, step: int, final: Path, params, optim, state) -> None:
    from safetensors.numpy import save_file

    run_dir.mkdir(parents=True, exist_ok=True)
    _remove_temps(run_dir)
    tmp = run_dir / f"{_TEMP_PREFIX}{step:08d}-{os.getpid()}"
    tmp.mkdir()
    try:
        save_file(_contiguous(params, "params"), str(tmp / MODEL_FILE))
        save_file(_contiguous(optim, "optim"), str(tmp / OPTIM_FILE))
        (tmp / STATE_FILE).write_text(json.dumps({**state, "step": step, "format": FORMAT}, indent=1))
        for name in (MODEL_FILE, OPTIM_FILE, STATE_FILE):
            _fsync_file(tmp / name)
        _fsync_dir(tmp)
        if final.exists():
            # Saving a step again (a resumed run reaching it twice): the new one replaces it.
            old = run_dir / f"{_TEMP_PREFIX}old-{step:08d}-{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
        _fsync_dir(run_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def latest(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint folder in `run_dir`, or None. Temp folders (a save in
    progress, or one a kill interrupted) and folders missing a file are skipped."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return None
    for _, path in reversed(_checkpoints(run_dir)):
        if all((path / name).exists() for name in (MODEL_FILE, OPTIM_FILE, STATE_FILE)):
            return path
    return None


def load(path: str | Path, require: tuple[str, ...] = ()) -> Checkpoint:
    """Read a checkpoint folder (or a run folder: its latest checkpoint). `require`: the
    caller's keys state.json must hold."""
    path = Path(path)
    if not path.is_dir():
        raise EulerError("checkpoint not found", file=str(path))
    if not _CKPT.match(path.name):
        found = latest(path)
        if found is None:
            raise EulerError("no checkpoint in this run folder", file=str(path))
        path = found
    for name in (MODEL_FILE, OPTIM_FILE, STATE_FILE):
        if not (path / name).exists():   # one that is there but no file: its reader says
            raise EulerError(f"incomplete checkpoint: {name} is missing", file=str(path))
    state_file = str(path / STATE_FILE)
    try:
        state = load_json(read_text(path / STATE_FILE, "state.json"), state_file)
    except EulerError as err:
        raise EulerError(f"corrupt state: {err.message}", file=state_file, line=err.line,
                         key=err.key) from None
    if not isinstance(state, dict):
        raise EulerError("corrupt state: not a JSON object", file=state_file)
    if state.get("format") != FORMAT:
        raise EulerError(f"checkpoint format {state.get('format')} is not {FORMAT}", file=state_file)
    step = state.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise EulerError(f"corrupt state: step {json.dumps(step)} is not a step number",
                         file=state_file, key="step")
    missing = [k for k in require if k not in state]
    if missing:
        raise EulerError(f"corrupt state: no {', '.join(missing)}", file=state_file)
    tensors = {}
    for name in (MODEL_FILE, OPTIM_FILE):
        try:
            tensors[name] = read_safetensors(path / name, "checkpoint file")
        except EulerError as err:
            raise EulerError(f"corrupt tensors: {err.message}", file=str(path / name),
                             key=err.key) from None
    return Checkpoint(path=path, step=step, params=tensors[MODEL_FILE],
                      optim=tensors[OPTIM_FILE], state=state)


def param_total(path: str | Path) -> int:
    """The number of weights in a checkpoint folder's model.safetensors, read from its
    header alone."""
    from safetensors import SafetensorError, safe_open

    file = Path(path) / MODEL_FILE
    try:
        with safe_open(str(file), "numpy") as f:
            return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    except (SafetensorError, OSError) as err:
        raise EulerError(f"corrupt tensors: {err}", file=str(file)) from None


def _checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    found = [(int(m.group(1)), p) for p in run_dir.iterdir()
             if p.is_dir() and (m := _CKPT.match(p.name))]
    return sorted(found)


def _prune(run_dir: Path, keep: int) -> None:
    for _, path in _checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(path)


def _remove_temps(run_dir: Path) -> None:
    for p in run_dir.iterdir():
        if p.name.startswith(_TEMP_PREFIX):
            shutil.rmtree(p, ignore_errors=True)


def _contiguous(tensors: dict[str, np.ndarray], what: str) -> dict[str, np.ndarray]:
    out = {}
    for name, value in tensors.items():
        if not isinstance(value, np.ndarray):
            raise TypeError(f"checkpoint {what}[{name!r}] is {type(value).__name__}, expected a "
                            "numpy array (copy GPU arrays to the host first)")
        out[name] = np.ascontiguousarray(value)
    return out


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
