"""The run logger: metrics.jsonl (one JSON record per logged step), TensorBoard event
files (tensorboardX), the progress bar (eulergen/progress.py: a line a record where stderr
is no terminal); the loss plot; model FLOPs for MFU.

Standard record keys: step, train_loss, val_loss, lr, grad_norm, tokens_per_s,
ms_per_step, mfu, and elapsed_s (wall seconds since the run began, which the logger adds:
a resume carries on from the last record it keeps). Any other numeric key is written too
(the trainer's tokens, skipped updates).
"""
from __future__ import annotations

import io
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from eulergen import outputs
from eulergen.errors import EulerError
from eulergen.progress import Bar
from eulergen.files import write_atomic
from eulergen.userfiles import load_json, read_text

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"
PLOT_FILE = "loss.png"
METRICS_LIMIT = 256 << 20   # a record a logged step, ~200 bytes: a million of them
METRIC_KEYS = ("step", "train_loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "ms_per_step",
               "mfu", "elapsed_s")

# Dense peak FLOP/s by (device-name fragment, precision), for MFU. Matched in order.
PEAK_FLOPS = {
    ("H200", "tf32"): 494.7e12, ("H200", "fp32"): 66.9e12, ("H200", "bf16"): 989.4e12,
    ("H100", "tf32"): 494.7e12, ("H100", "fp32"): 66.9e12, ("H100", "bf16"): 989.4e12,
    ("A100", "tf32"): 156e12, ("A100", "fp32"): 19.5e12, ("A100", "bf16"): 312e12,
}


class RunLogger:
    """Writes each `log(step, …)` to metrics.jsonl, TensorBoard and the progress line.

    `resume_step`: continuing a run, records past that step (written after the
    checkpoint the run resumes from) are dropped from metrics.jsonl and purged from the
    TensorBoard events, so no step appears twice. None: a fresh run, old metrics removed."""

    def __init__(self, run_dir: str | Path, total_steps: int, *, resume_step: int | None = None,
                 tensorboard: bool = True, progress: bool = True):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.total_steps = total_steps
        self.path = self.run_dir / METRICS_FILE
        kept = [r for r in read_metrics(self.run_dir) if r["step"] <= resume_step] \
            if resume_step is not None and self.path.exists() else []
        _write_records(self.path, kept)
        last = kept[-1].get("elapsed_s") if kept else None
        self._began = time.perf_counter() - (last if isinstance(last, (int, float)) else 0.0)
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = _tb_writer(self.run_dir / TB_DIR, resume_step) if tensorboard else None
        self._progress = Bar("train", total_steps, unit="steps", every=0,
                             completed=resume_step or 0) if progress else None
        self._last: dict[str, Any] = {}

    def log(self, step: int, **values: float | int | bool | None) -> dict[str, Any]:
        """Record the given metrics at `step`; None values are left out."""
        record: dict[str, Any] = {"step": int(step)}
        for key, value in values.items():
            if value is None:
                continue
            if not isinstance(value, (int, float)):
                raise TypeError(f"metric {key} is {type(value).__name__}, expected a number")
            record[key] = value if isinstance(value, (bool, int)) else float(value)
        record["elapsed_s"] = time.perf_counter() - self._began
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and math.isfinite(value):
                    self._tb.add_scalar(_tb_tag(key), value, step)
        if self._progress is not None:
            self._last.update({k: v for k, v in record.items() if k != "step"})
            self._progress.update(record["step"], status=_status(self._last))
        return record

    def start(self) -> None:
        """The progress bar from here (what was printed before stays above it)."""
        if self._progress is not None:
            self._progress.start()

    def done(self) -> None:
        """The bar's last frame: the steps are over, what is printed next comes below it."""
        if self._progress is not None:
            self._progress.stop()

    def print(self, text: str) -> None:
        """Print above the progress line (samples, notices) without breaking it."""
        if self._progress is not None:
            self._progress.print(text)
        else:
            print(text)

    def close(self) -> None:
        self.done()
        if self._tb is not None:
            self._tb.close()
        self._file.close()

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of a run's metrics.jsonl; a line cut short by a kill is dropped."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        raise EulerError(f"no {METRICS_FILE} here (not a run folder?)", file=str(run_dir))
    lines = read_text(path, "metrics file", METRICS_LIMIT).splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = load_json(line, str(path))
        except EulerError:
            if number == len(lines):
                break  # the last line, half-written when the run was killed
            raise EulerError("corrupt metrics record", file=str(path), line=number) from None
        step = record.get("step") if isinstance(record, dict) else None
        if isinstance(step, bool) or not isinstance(step, int):
            raise EulerError("not a metrics record (a JSON object with an integer step)",
                             file=str(path), line=number)
        wrong = next((k for k in METRIC_KEYS if not isinstance(record.get(k, 0), (int, float))
                      or isinstance(record.get(k), bool)), None)
        if wrong:   # what plot and resume read: numbers
            raise EulerError(f"expected a number, got {type(record[wrong]).__name__}",
                             file=str(path), line=number, key=wrong)
        records.append(record)
    return records


def plot_run(run_dir: str | Path, x: str = "step") -> Path:
    """Write RUN/loss.png: train and val loss against `x` (a key of X_AXES; outputs.py's rule)."""
    plt = pyplot()
    records = read_metrics(run_dir)
    train, val = curve(records, "train_loss", x, run_dir), curve(records, "val_loss", x, run_dir)
    if not train and not val:
        raise EulerError("no loss recorded yet", file=str(Path(run_dir) / METRICS_FILE))
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    if train:
        ax.plot(*zip(*train), label="train", color="tab:blue", linewidth=1)
    if val:
        ax.plot(*zip(*val), label="val", color="tab:orange", marker="o", markersize=3)
    ax.set_xlabel(X_LABELS[x])
    ax.set_ylabel("loss")
    ax.set_title(Path(run_dir).resolve().name)
    ax.grid(alpha=0.3)
    ax.legend()
    # replaced in a run folder; elsewhere written only where the user has no loss.png
    return outputs.write_into(run_dir, PLOT_FILE, png_bytes(fig), command="run", by="plot")


# what a plot's x axis may be: the record key it reads, and the axis label
X_AXES = {"step": "step", "tokens": "tokens", "time": "elapsed_s"}
X_LABELS = {"step": "step", "tokens": "tokens", "time": "wall time (s)"}


def curve(records: list[dict[str, Any]], y: str, x: str, run_dir) -> list[tuple[float, float]]:
    """(x, y) of every record holding `y`, x read by X_AXES[x]; a run whose records lack it
    (written before eulergen recorded it) is an error naming the run."""
    key = X_AXES[x]
    points = [(r.get(key), r[y]) for r in records if y in r]
    if any(p is None for p, _ in points):
        raise EulerError(f"no {key} in its records (a run from before eulergen recorded it): "
                         "plot it against step", file=str(Path(run_dir) / METRICS_FILE))
    return points


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def png_bytes(fig, metadata: dict[str, str] | None = None) -> bytes:
    """`fig` as PNG bytes (closed after)."""
    png = io.BytesIO()
    try:
        fig.savefig(png, format="png", metadata=metadata)
    finally:
        pyplot().close(fig)
    return png.getvalue()


def save_png(fig, out: Path, metadata: dict[str, str] | None = None) -> Path:
    """Save `fig` as the PNG `out` atomically and close it."""
    write_atomic(out, png_bytes(fig, metadata))
    return out


def flops_per_token(num_params: int, num_layers: int, num_heads: int, head_dim: int, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), as in the PaLM appendix and nanoGPT:
    6 per parameter used in matmuls plus attention's 12·L·H·hd·T (QKᵀ and PV over the full
    T×T square, H query heads: not halved for the causal mask, so at long T a causal kernel
    does about half of what this counts). Pass num_params without the learned position
    table (a lookup, no FLOPs); the tied token table counts (LM head)."""
    return 6.0 * num_params + 12.0 * num_layers * num_heads * head_dim * seq_len


def peak_flops(device_name: str, precision: str) -> float | None:
    """Dense peak FLOP/s of a known GPU at `precision` ("fp32", "tf32", "bf16"), else None."""
    for (fragment, prec), flops in PEAK_FLOPS.items():
        if fragment in device_name and prec == precision:
            return flops
    return None


# -- internals ------------------------------------------------------------------------------

def _write_records(path: Path, records: list[dict[str, Any]]) -> None:
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in records).encode("utf-8"))


def _tb_tag(key: str) -> str:
    group = "loss" if key.endswith("_loss") else "perf" if key in ("tokens_per_s", "ms_per_step", "mfu") else "train"
    return f"{group}/{key}"


def _import_summary_writer():
    """tensorboardX's SummaryWriter, imported without torch: its writer module imports torch
    when it can, only to accept torch tensors (we log floats), and that import was most of
    a run's start (benchmarks/RESULTS.md, Start-up). A torch already loaded is used."""
    if "torch" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None   # `import torch` raises ImportError while this is here
    try:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    finally:
        del sys.modules["torch"]


def _tb_writer(folder: Path, resume_step: int | None):
    try:
        SummaryWriter = _import_summary_writer()
    except ImportError:
        print("note: tensorboardX is not installed; no TensorBoard events (pip install tensorboardX)",
              file=sys.stderr)
        return None
    if resume_step is None and folder.is_dir():
        for old in folder.glob("events.out.tfevents.*"):
            old.unlink()  # a fresh run in an old folder: its curves must not mix with ours
    # purge_step hides events at steps >= it that an earlier, interrupted process wrote.
    # The suffix keeps a resume within the same second from reusing (and truncating) the
    # earlier event file, whose name is otherwise only the time in seconds and the host.
    # flush_secs: a live TensorBoard sees a step within seconds, not the default 2 minutes.
    return SummaryWriter(logdir=str(folder), purge_step=None if resume_step is None else resume_step + 1,
                         filename_suffix=f".{time.time_ns()}", flush_secs=10)


def _status(last: dict[str, Any]) -> str:
    parts = []
    if "train_loss" in last:
        parts.append(f"loss {last['train_loss']:.4f}")
    if "val_loss" in last:
        parts.append(f"val {last['val_loss']:.4f}")
    if "lr" in last:
        parts.append(f"lr {last['lr']:.2e}")
    if "tokens_per_s" in last:
        parts.append(f"{last['tokens_per_s']:,.0f} tok/s")
    return " | ".join(parts)
