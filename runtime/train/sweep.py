"""`eulergen sweep`: the grid of every comma-listed `--set` times the seeds, run one after
another in this process (a Trainer a run, over one op library), each run in its own folder
under one sweep folder.

The sweep folder is a run folder as runtime/train/run_dir.py rules them (marked, locked
while a sweep runs in it, a folder of files eulergen did not write refused) and holds
sweep.json: the grid, and each run's folder, resolved config and status, rewritten
atomically at every change. Every run's config is resolved before the first run starts, so
a value its key cannot take is refused before any work. A sweep resumed (`--resume`) skips
the runs that finished, continues an interrupted one from its latest checkpoint as
`eulergen train --resume` does (or starts it again when it saved none), and retries a
failed one; the configs come from sweep.json, not from the files that made them.
"""
from __future__ import annotations

import gc
import itertools
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

from eulergen.errors import EulerError
from eulergen.files import write_atomic
from eulergen.runtime.model.arch import ops_used
from eulergen.runtime.train import checkpoint, run_dir
from eulergen.runtime.train.compare import RunSummary, read_runs
from eulergen.runtime.train.config import RunConfig, as_dict, config_from_dict, fresh_dir
from eulergen.runtime.train.resolve import resolve
from eulergen.runtime.train.start import run_config
from eulergen.runtime.train.sweep_stats import SettingStats, setting_stats
from eulergen.runtime.train.trainer import Trainer, resume_config
from eulergen.userfiles import load_json, read_text

MANIFEST = "sweep.json"
FORMAT = 1
STATUSES = ("pending", "running", "done", "failed")
SEED_KEY = "training.seed"


@dataclass(frozen=True)
class Trial:
    dir: str                                  # its run folder, in the sweep folder
    setting: tuple[tuple[str, str], ...]      # (key, value as given) of every swept key
    seed: int
    config: RunConfig


@dataclass(frozen=True)
class Sweep:
    path: Path
    axes: tuple[tuple[str, tuple[str, ...]], ...]   # the swept keys and their values
    seeds: tuple[int, ...]
    trials: tuple[Trial, ...]                 # in run order: every setting, seed by seed

    def settings(self) -> list[tuple[tuple[str, str], ...]]:
        """Every setting of the grid, the first (every key's first value) first."""
        return _settings(self.axes)

    def ops(self) -> tuple[str, ...]:
        """The ops the runs call, each once: what the sweep builds before it starts."""
        return tuple(dict.fromkeys(n for t in self.trials
                                   for n in ops_used(t.config.model, t.config.training.optimizer)))


@dataclass(frozen=True)
class Ran:
    trial: Trial
    how: str            # "new", "restarted" (no checkpoint yet), "resumed at step N", "skipped"
    seconds: float      # the Trainer's, built and run; 0 for a skipped one
    error: str | None   # a run that failed: its one line


def new_sweep(config_path, sets, seeds: int, out=None, device=None) -> Sweep:
    """The sweep `sets` describe (KEY=A,B,… a swept key, KEY=V a fixed one) over `seeds`
    seeds from the config's training.seed, in `out` (default runs/sweep-<date>-<time>),
    every run's config loaded and checked; `out` refused when it holds anything."""
    fixed, axes = _parse(sets)
    if not axes and seeds == 1:
        raise EulerError("nothing to sweep: give a --set KEY=A,B,… or --seeds N", key="--set")
    path = Path(out or fresh_dir("runs/sweep"))
    _check_new(path)
    settings = _settings(axes)
    base = _point(config_path, fixed, settings[0], [], None, device).training.seed
    seed_list = tuple(range(base, base + seeds))
    trials = []
    for seed in seed_list:
        for setting in settings:
            name = _name(len(trials), setting, seed)
            cfg = _point(config_path, fixed, setting, [f"{SEED_KEY}={seed}"],
                         str(path / name), device)
            trials.append(Trial(name, setting, seed, cfg))
    if len({t.config.training.device for t in trials}) > 1:   # one library, one backend
        raise EulerError("differs between the runs: a sweep runs on one device",
                         key="training.device")
    for trial in trials:
        _check_scored(trial)
    return Sweep(path, axes, seed_list, tuple(trials))


def _settings(axes) -> list[tuple[tuple[str, str], ...]]:
    return [tuple(zip((k for k, _ in axes), values))
            for values in itertools.product(*(v for _, v in axes))]


def _parse(sets) -> tuple[list[str], tuple[tuple[str, tuple[str, ...]], ...]]:
    fixed, axes, seen = [], [], set()
    for item in sets:
        key, sep, text = item.partition("=")
        key = key.strip()
        if key in seen:
            raise EulerError("given twice: one --set a key (list its values A,B,…)",
                             file="--set", key=key)
        seen.add(key)
        if key == "run_dir":
            raise EulerError("the sweep names its runs' folders: give --out", file="--set",
                             key=key)
        if not sep or "," not in text:
            fixed.append(item)   # load_config reads it, and names what is wrong with it
            continue
        if key == SEED_KEY:
            raise EulerError("seeds are swept by --seeds N (from the config's seed)",
                             file="--set", key=key)
        values = tuple(v.strip() for v in text.split(","))
        if "" in values or len(set(values)) < len(values):
            raise EulerError(f"{text!r}: want distinct values A,B,… none empty", file="--set",
                             key=key)
        axes.append((key, values))
    return fixed, tuple(axes)


def _point(config_path, fixed, setting, extra, run_dir_, device) -> RunConfig:
    """One grid point's config; an error in it names the point."""
    try:
        return run_config(config_path, [*fixed, *(f"{k}={v}" for k, v in setting), *extra],
                          run_dir_, device)
    except EulerError as err:
        raise _at(err, setting) from None


def _at(err: EulerError, setting) -> EulerError:
    if not setting:
        return err
    point = ", ".join(f"{k}={v}" for k, v in setting)
    swept = err.key in dict(setting)   # a value from the command line
    return EulerError(f"{err.message} (at the sweep's {point})",
                      file=err.file or ("--set" if swept else None), line=err.line, key=err.key)


def _name(index: int, setting, seed: int) -> str:
    """The run folder's name: its place in the run order, its values and seed (the keys are
    sweep.json's), e.g. 03_gelu_s1338."""
    values = "_".join(re.sub(r"[^A-Za-z0-9.+-]", "-", value) for _, value in setting)
    return f"{index:02d}_{values[:60]}{'_' if values else ''}s{seed}"


def _check_scored(trial: Trial) -> None:
    """The sweep compares final validation losses: every run must evaluate."""
    if not trial.config.training.eval_every:
        raise _at(EulerError("is 0, but a sweep compares the runs' final val losses: every "
                             "run must evaluate", key="training.eval_every"), trial.setting)
    if trial.config.data.val_dataset is None:
        raise _at(EulerError("is null, but a sweep compares the runs' final val losses: every "
                             "run needs a validation set", key="data.val_dataset"), trial.setting)


def _check_new(path: Path) -> None:
    """A new sweep's folder: new, or empty but for eulergen's marker."""
    run_dir.check(path)   # a file, files eulergen did not write, one in use
    if not path.is_dir() or not {p.name for p in path.iterdir()} - {run_dir.MARKER}:
        return
    if (path / MANIFEST).is_file():
        raise EulerError(f"holds a sweep: continue it with `eulergen sweep --resume {path}`",
                         file=str(path))
    raise EulerError("holds eulergen's files, not a new sweep: pick a new or empty --out",
                     file=str(path))


# -- the manifest ----------------------------------------------------------------------

def write_manifest(sweep: Sweep, status: dict[str, dict]) -> None:
    """sweep.json, atomically: the grid and, run by run, its folder, setting, seed, status
    (with its seconds once done, its error once failed) and config."""
    runs = [{"dir": t.dir, "setting": [list(kv) for kv in t.setting], "seed": t.seed,
             **status[t.dir], "config": as_dict(t.config)} for t in sweep.trials]
    body = {"format": FORMAT, "written_by": "eulergen sweep",
            "axes": [[key, list(values)] for key, values in sweep.axes],
            "seeds": list(sweep.seeds), "runs": runs}
    write_atomic(sweep.path / MANIFEST, json.dumps(body, indent=1).encode())


def load_sweep(path) -> tuple[Sweep, dict[str, dict]]:
    """The sweep in folder `path` and each run's status record, read from its sweep.json."""
    path = Path(path)
    run_dir.check(path)
    file = path / MANIFEST
    if not file.is_file():
        raise EulerError(f"no {MANIFEST} here: not a sweep folder", file=str(path))
    body = load_json(read_text(file, MANIFEST), str(file))

    def need(ok: bool, key: str, want: str):
        if not ok:
            raise EulerError(f"corrupt sweep: want {want}", file=str(file), key=key)

    need(isinstance(body, dict) and body.get("format") == FORMAT, "format", f"format {FORMAT}")
    axes, seeds, runs = body.get("axes"), body.get("seeds"), body.get("runs")
    need(isinstance(axes, list) and all(_keyed(a, list) for a in axes), "axes",
         "[[key, [values…]], …]")
    need(isinstance(seeds, list) and all(_int(s) for s in seeds), "seeds", "a list of seeds")
    need(isinstance(runs, list) and runs, "runs", "a list of runs")
    trials, status = [], {}
    for i, run in enumerate(runs):
        key = f"runs[{i}]"
        need(isinstance(run, dict), key, "an object")
        name = run.get("dir")
        need(isinstance(name, str) and re.fullmatch(r"[A-Za-z0-9._+-]+", name or "") is not None
             and name not in (".", ".."), f"{key}.dir", "a folder name in the sweep folder")
        setting = run.get("setting")
        need(isinstance(setting, list) and all(_keyed(s, str) for s in setting),
             f"{key}.setting", "[[key, value], …]")
        need(_int(run.get("seed")), f"{key}.seed", "an integer")
        need(run.get("status") in STATUSES, f"{key}.status", " or ".join(STATUSES))
        need(isinstance(run.get("config"), dict), f"{key}.config", "a run's config")
        cfg = config_from_dict({**run["config"], "run_dir": str(path / name)},
                               source=f"{file}: {key}.config")
        trials.append(Trial(name, tuple(map(tuple, setting)), run["seed"], cfg))
        need(name not in status, f"{key}.dir", "a folder no other run has")
        status[name] = {k: run[k] for k in ("status", "seconds", "error") if k in run}
    sweep = Sweep(path, tuple((k, tuple(v)) for k, v in axes), tuple(seeds), tuple(trials))
    return sweep, status


def _keyed(item, of: type) -> bool:
    """[key, value] (a setting's: `of` str) or [key, [values…]] (an axis's: `of` list)."""
    if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
        return False
    value = item[1]
    return isinstance(value, str) if of is str else \
        isinstance(value, list) and all(isinstance(v, str) for v in value)


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# -- running ---------------------------------------------------------------------------

def run_sweep(sweep: Sweep, lib, status: dict[str, dict] | None = None, *, say=print,
              progress: bool = True, tensorboard: bool = True) -> list[Ran]:
    """Run every trial that has not finished, in order, holding the sweep folder's lock.
    `status`: a resumed sweep's records (None: a new sweep, every run pending). Every run
    still to do is resolved against `lib` first. A run whose trainer refuses to go on (an
    EulerError: a loss that is not finite, a disk that is full) is marked failed and the
    sweep goes on to the next; any other exception stops the sweep, its run left
    `running` for a resume."""
    status = dict(status or {t.dir: {"status": "pending"} for t in sweep.trials})
    todo = [t for t in sweep.trials if status[t.dir]["status"] != "done"]
    later = {t.dir for t in todo}
    for trial in todo:   # before any run: a config the ops or the machine cannot take
        try:
            resolve(trial.config, lib)
        except EulerError as err:
            raise _at(err, trial.setting) from None
    lock = run_dir.RunLock(sweep.path).acquire()
    ran = []
    try:
        write_manifest(sweep, status)
        for number, trial in enumerate(sweep.trials, 1):
            if trial.dir not in later:
                ran.append(Ran(trial, "skipped", 0.0, None))
                continue
            status[trial.dir] = {"status": "running"}
            write_manifest(sweep, status)
            ran.append(_run(trial, Path(trial.config.run_dir), lib, progress, tensorboard,
                            lambda how: say(f"sweep run {number}/{len(sweep.trials)}: "
                                            f"{trial.dir} ({how})")))
            last = ran[-1]
            status[trial.dir] = {"status": "failed", "error": last.error} if last.error \
                else {"status": "done", "seconds": round(last.seconds, 3)}
            write_manifest(sweep, status)
    finally:
        lock.release()
    return ran


def _run(trial: Trial, folder: Path, lib, progress: bool, tensorboard: bool, say) -> Ran:
    """One trial: resumed from its latest checkpoint, else started (again) from its seed."""
    ckpt = checkpoint.latest(folder)
    how = "new" if not folder.exists() else "restarted" if ckpt is None else "resumed"
    began = time.perf_counter()
    trainer = error = None
    try:
        trainer = Trainer(resume_config(folder) if ckpt else trial.config, lib,
                          resume=ckpt is not None, progress=progress, tensorboard=tensorboard)
        if ckpt is not None:
            how = f"resumed at step {trainer.step}"
        say(how)
        trainer.run()
    except EulerError as err:
        error = str(err)
        say(f"failed: {error}")
    finally:
        trainer = None
    seconds = time.perf_counter() - began
    # the run's arrays go before the next one is planned: on a GPU its budget counts the
    # memory pool's free blocks, which a trainer held in a reference cycle would keep
    gc.collect()
    return Ran(trial, how, seconds, error)


# -- the verdict -------------------------------------------------------------------------

def report(sweep: Sweep, ran: list[Ran]) -> tuple[tuple[RunSummary, ...], list[SettingStats]]:
    """The finished runs, grouped by setting (in grid order, seed by seed), and each
    setting's statistics over its seeds."""
    ok = {r.trial.dir for r in ran if r.error is None}
    by_setting = {setting: [t for t in sweep.trials if t.setting == setting and t.dir in ok]
                  for setting in sweep.settings()}
    order = [t for trials in by_setting.values() for t in trials]
    runs = read_runs([sweep.path / t.dir for t in order]) if order else ()
    loss = {t.dir: run.final_val for t, run in zip(order, runs)}
    return runs, setting_stats(
        (setting, [loss[t.dir] for t in trials if loss[t.dir] is not None])
        for setting, trials in by_setting.items())
