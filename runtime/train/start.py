"""Where a training run starts: its config (a file or the built-in default of the device it
runs on, with --set overrides; a resumed run's saved one; an imported model's) and the
weights an imported model brings. What `eulergen train` and `eulergen plan` read before
anything is built; the Trainer takes it from here (runtime/train/resolve.py resolves it).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eulergen.errors import EulerError
from eulergen.runtime.train.config import RunConfig


@dataclass(frozen=True)
class Start:
    cfg: RunConfig
    initial: dict | None = None   # an imported model's weights (eulergen names), else None
    source: dict | None = None    # where they came from, as the Trainer records it


def start(config_path, overrides, *, resume=None, run_dir=None, device=None, init_from=None,
          fresh_run_dir: bool = True, bar=None) -> Start:
    """A run's config and its imported weights: a resumed run's saved config (and, where
    it started from an imported model and has no checkpoint yet, those weights again), an
    imported model's (its config.json the model's, read and checked in full before the run
    folder is touched), or the file's or built-in default's. `fresh_run_dir`: without
    `run_dir`, a new folder per run (False under a launcher: every rank names the same).
    `bar` (progress.Bar, started by the caller) counts an imported model's tensors read."""
    if resume is not None:
        if config_path is not None or run_dir is not None or init_from is not None:
            raise EulerError("--resume continues a run with its saved config and weights: give "
                             "--set overrides, not --config, --run-dir or --init-from",
                             key="--resume")
        return Start(resumed_config(resume, overrides, device), *_resume_import(resume, bar))
    if init_from is not None:
        from eulergen.runtime.interop import hf
        imported = hf.load_folder(hf.locate(init_from), bar)
        source = {"init_from": str(init_from), "folder": str(imported.folder.resolve())}
        given = run_config(config_path, [*hf.model_sets(imported), *overrides], run_dir, device,
                           per_device=False)
        sets = hf.run_overrides(imported, given, overrides)
        cfg = run_config(config_path, [*sets, *overrides], run_dir, device,
                         fresh_run_dir=fresh_run_dir, per_device=False)
        return Start(cfg, imported.params, source)
    # no run folder named: a new one per run, so running the same command twice works; a
    # named folder that holds checkpoints is refused by the Trainer (never overwritten)
    return Start(run_config(config_path, overrides, run_dir, device, fresh_run_dir=fresh_run_dir))


def run_config(config_path, overrides, run_dir=None, device=None, *, fresh_run_dir=False,
               per_device=True) -> RunConfig:
    """The run's config; without a file, the built-in default of the device the run resolves
    to (`per_device`; an --init-from run brings its own model)."""
    from eulergen.runtime.train.config import load_config
    extra = [f"run_dir={run_dir}"] if run_dir else []
    extra += [f"training.device={device}"] if device else []
    return load_config(config_path, [*overrides, *extra], fresh_run_dir=fresh_run_dir,
                       finds_gpu=_finds_gpu if per_device else None)


def _finds_gpu() -> bool:
    """Whether training.device auto runs on a GPU here. Quiet: the run's own get_backend
    says why not, once."""
    from eulergen.runtime.engine.backend import get_backend
    return get_backend("auto", notice=lambda line: None).is_gpu


def resumed_config(resume, overrides, device=None) -> RunConfig:
    """A resumed run's saved config, with the --set overrides and --device."""
    from eulergen.runtime.train.trainer import resume_config
    return resume_config(resume, [*overrides, *([f"training.device={device}"] if device else [])])


def _resume_import(run: Path, bar):
    """(imported weights, their record) for a resume of an --init-from run that has no
    checkpoint yet (it restarts from those weights, not from its seed), else (None, None)."""
    from eulergen.runtime.interop import hf
    from eulergen.runtime.train import checkpoint
    from eulergen.runtime.train.trainer import recorded_init
    source = recorded_init(run)
    if source is None or checkpoint.latest(run) is not None:
        return None, None
    folder = Path(source["folder"])
    return hf.load_folder(folder if folder.is_dir() else hf.locate(source["init_from"]),
                          bar).params, source
