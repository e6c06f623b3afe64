"""Runs side by side: each run folder read into a RunSummary (its saved config, its
metrics records, the weights of its latest checkpoint), the table `eulergen compare`
prints of them (with only the config keys that differ between the runs), and one plot of
every run's train and val curves overlaid.

Runs compare when their losses measure the same thing: the same tokenizer and the same
text scored (the validation set, or the training set of a run without one).
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eulergen.errors import EulerError
from eulergen.runtime.train import checkpoint, metrics, run_dir
from eulergen.runtime.train.trainer import CONFIG_FILE
from eulergen.userfiles import load_json, read_text

COMPARE_PLOT = "compare.png"
_SOFTWARE = "eulergen"   # the PNG text chunk that marks a plot as eulergen's to overwrite
_YARDSTICK = ("data.tokenizer", "data.val_dataset")


@dataclass(frozen=True)
class RunSummary:
    path: Path
    name: str                      # how the table and the legend name it
    config: dict[str, Any]         # "section.key" -> value, as its config.json gives it
    records: tuple[dict[str, Any], ...]
    params: int | None             # weights in its latest checkpoint; None before the first

    def _last(self, key: str):
        return next((r[key] for r in reversed(self.records) if key in r), None)

    @property
    def final_val(self) -> float | None:
        return self._last("val_loss")

    @property
    def best_val(self) -> float | None:
        return min((r["val_loss"] for r in self.records if "val_loss" in r), default=None)

    @property
    def tokens(self) -> int | None:
        return self._last("tokens")

    @property
    def wall_s(self) -> float | None:
        return self._last("elapsed_s")

    @property
    def tokens_per_s(self) -> float | None:
        """The median logged step's tokens a second (every rank's): the training step's own
        speed, without start-up, compilation and evaluation, which wall_s includes."""
        steps = [r["ms_per_step"] for r in self.records if "ms_per_step" in r and "tokens" in r]
        if not steps:
            return None
        last = next(r for r in reversed(self.records) if "tokens" in r)
        return last["tokens"] / last["step"] / (statistics.median(steps) / 1e3)


def read_runs(paths) -> tuple[RunSummary, ...]:
    """The runs in `paths`, refused (one line) where a folder is not a run or where two
    runs' losses do not measure the same thing."""
    paths = [Path(p) for p in paths]
    if not paths:
        raise EulerError("give one run folder or more", key="RUN")
    names = [p.name for p in paths]
    if len(set(names)) < len(names):   # runs of the same name in different folders
        names = [str(p) for p in paths]
    runs = tuple(_read_run(p, n) for p, n in zip(paths, names))
    first = runs[0]
    for run in runs[1:]:
        for key in _YARDSTICK:
            mine, theirs = _scored(first, key), _scored(run, key)
            if mine != theirs:
                raise EulerError(f"nothing in common with {first.path}: {json.dumps(theirs)} "
                                 f"here, {json.dumps(mine)} there (their losses measure "
                                 "different things)", file=str(run.path), key=key)
    return runs


def _scored(run: RunSummary, key: str):
    """The run's value of a yardstick key; a run without a validation set scores its
    training set."""
    value = run.config.get(key)
    return run.config.get("data.dataset") if key == "data.val_dataset" and value is None \
        else value


def _read_run(path: Path, name: str) -> RunSummary:
    if not path.is_dir():
        raise EulerError("not a run folder", file=str(path))
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise EulerError(f"no {CONFIG_FILE} here (not a run folder?)", file=str(path))
    saved = load_json(read_text(config_file, CONFIG_FILE), str(config_file))
    if not isinstance(saved, dict):
        raise EulerError("not a run's config (a JSON object of sections)", file=str(config_file))
    config = {}
    for section, values in saved.items():   # {"model": {...}, …, "run_dir": …}
        if isinstance(values, dict):
            config.update((f"{section}.{key}", value) for key, value in values.items())
        else:
            config[section] = values
    records = metrics.read_metrics(path)
    ckpt = checkpoint.latest(path)
    return RunSummary(path, name, config, tuple(records),
                      checkpoint.param_total(ckpt) if ckpt is not None else None)


def differing_keys(runs) -> list[str]:
    """The config keys whose values are not the same in every run (the run folder aside), in
    config order."""
    keys = dict.fromkeys(k for run in runs for k in run.config if k != "run_dir")
    return [k for k in keys if len({repr(run.config.get(k)) for run in runs}) > 1]


def runs_table(runs, title: str = "runs"):
    """The rich Table of the runs: size, tokens, time and speed, the final and best
    validation loss, and the config keys that differ between them."""
    from rich.table import Table

    keys = differing_keys(runs)
    table = Table(title=title)
    table.add_column("run")
    for column in ("params", "tokens", "wall", "tok/s", "final val", "best val"):
        table.add_column(column, justify="right")
    for key in keys:
        table.add_column(key)
    for run in runs:
        table.add_row(run.name, _count(run.params), _count(run.tokens),
                      "–" if run.wall_s is None else f"{run.wall_s:.1f} s",
                      "–" if run.tokens_per_s is None else f"{run.tokens_per_s:,.0f}",
                      _loss(run.final_val), _loss(run.best_val),
                      *(_value(run.config.get(k, "–")) for k in keys))
    return table


def _count(n: int | None) -> str:
    if n is None:
        return "–"
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def _loss(value: float | None) -> str:
    return "–" if value is None else f"{value:.4f}"


def _value(value) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) \
        else str(value)


def plot_runs(runs, out: str | Path, x: str = "step") -> Path:
    """One PNG of every run's train loss (thin) and val loss (dots) against `x`
    (metrics.X_AXES), a colour a run; `out` refused where it is a file eulergen did not write."""
    out = Path(out)
    check_out(out)
    curves = [(run, metrics.curve(list(run.records), "train_loss", x, run.path),
               metrics.curve(list(run.records), "val_loss", x, run.path)) for run in runs]
    if not any(train or val for _, train, val in curves):
        raise EulerError("no loss recorded yet in any of the runs", file=str(runs[0].path))
    plt = metrics.pyplot()
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=120)
    for i, (run, train, val) in enumerate(curves):
        color = f"C{i % 10}"
        if train:
            ax.plot(*zip(*train), color=color, linewidth=0.8, alpha=0.45)
        if val:
            ax.plot(*zip(*val), color=color, marker="o", markersize=3, label=run.name)
        elif train:
            ax.plot([], [], color=color, label=run.name)
    ax.set_xlabel(metrics.X_LABELS[x])
    ax.set_ylabel("loss")
    ax.set_title("train loss (thin) and val loss (dots)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return metrics.save_png(fig, out, metadata={"Software": _SOFTWARE})


def check_out(out: Path) -> None:
    """Refuse, writing nothing, a plot file that is not a new PNG or one eulergen wrote (a
    PNG marked by plot_runs, or a file in a folder eulergen made)."""
    if out.is_dir():
        raise EulerError("is a folder: --out names the plot's file", file=str(out))
    if out.suffix.lower() != ".png":
        raise EulerError("the plot is a PNG: name a .png file", file=str(out), key="--out")
    if out.exists() and not _marked(out) and not (out.parent / run_dir.MARKER).is_file():
        raise EulerError("a file eulergen did not write: not overwritten (name another --out)",
                         file=str(out))


def _marked(path: Path) -> bool:
    with open(path, "rb") as f:   # matplotlib writes the text chunks first, after the header
        head = f.read(4096)
    return head.startswith(b"\x89PNG\r\n\x1a\n") and \
        b"tEXtSoftware\x00" + _SOFTWARE.encode() in head
