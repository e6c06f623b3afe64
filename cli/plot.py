"""`eulergen plot` (runtime/train/metrics.py)."""
from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
def plot(run_dir: Path) -> None:
    """Write RUN_DIR/loss.png: train and validation loss against step."""
    from eulergen.runtime.train.metrics import plot_run
    click.echo(f"wrote {plot_run(run_dir)}")
