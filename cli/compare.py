"""`eulergen compare` and `eulergen plot`: runs side by side (runtime/train/compare.py) and
their loss curves (runtime/train/metrics.py)."""
from __future__ import annotations

from pathlib import Path

import click

from eulergen.cli.common import console

out_option = click.option(
    "--out", type=click.Path(path_type=Path), metavar="FILE.png",
    help="Where the plot of every run goes (default: compare.png here); a file eulergen did "
         "not write is refused, never overwritten.")
x_option = click.option(
    "--x", "x", type=click.Choice(["step", "tokens", "time"]), default="step", show_default=True,
    help="The plot's x axis: optimizer steps, tokens trained on, or wall seconds.")


@click.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path(path_type=Path))
@out_option
@x_option
def compare(runs, out, x) -> None:
    """Print a table of RUNS (run folders) and plot their train and val curves overlaid.

    For each run: its parameters, the tokens it trained on, its wall time and tok/s (the
    median logged step's, without start-up and evaluation), its final and best val loss,
    and the config keys whose values differ between the runs. Runs compare when they score
    the same text with the same tokenizer (data.val_dataset, data.tokenizer)."""
    from eulergen.runtime.train.compare import COMPARE_PLOT, plot_runs, read_runs, runs_table
    found = read_runs(runs)
    written = plot_runs(found, out or Path(COMPARE_PLOT), x)
    console().print(runs_table(found))
    click.echo(f"wrote {written}")


@click.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path(path_type=Path))
@out_option
@x_option
def plot(runs, out, x) -> None:
    """Plot the train and validation loss of RUNS. One run without --out: RUN/loss.png;
    several: one plot of them all, as `eulergen compare` draws it."""
    from eulergen.runtime.train.compare import COMPARE_PLOT, plot_runs, read_runs
    from eulergen.runtime.train.metrics import plot_run
    if len(runs) == 1 and out is None:
        click.echo(f"wrote {plot_run(runs[0], x)}")
        return
    click.echo(f"wrote {plot_runs(read_runs(runs), out or Path(COMPARE_PLOT), x)}")
