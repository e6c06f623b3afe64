"""`eulergen sweep`: a grid of settings times seeds, run in this process one after another
(runtime/train/sweep.py), ending in the compare table and each setting's verdict
(runtime/train/sweep_stats.py)."""
from __future__ import annotations

import time
from pathlib import Path

import click

from eulergen.cli.common import console, library, limit_blas_threads, ops_option, warn
from eulergen.errors import EulerError


@click.command()
@click.option("--config", "config_path", type=click.Path(path_type=Path),
              help="NanoEuler JSON or YAML config (default: the device's built-in default).")
@click.option("--set", "sets", multiple=True, metavar="SECTION.KEY=A[,B,…]",
              help="A value with commas is swept (its values A, B, …); one without is fixed "
                   "for every run (repeatable).")
@click.option("--seeds", type=click.IntRange(min=1), metavar="N",
              help="Run every setting with N seeds: training.seed, seed+1, … [default: 1]")
@click.option("--out", type=click.Path(path_type=Path), metavar="SWEEPDIR",
              help="The sweep's folder, new or empty (default: a new runs/sweep-<date>-<time>).")
@click.option("--resume", type=click.Path(path_type=Path), metavar="SWEEPDIR",
              help="Continue the sweep in SWEEPDIR where it stopped.")
@click.option("--device", type=click.Choice(["auto", "cuda", "numpy"]))
@ops_option
def sweep(config_path, sets, seeds, out, resume, device, ops_dirs) -> None:
    """Train every setting of a grid with several seeds and say which differences are real.

    The grid is the product of every --set whose value lists several values (for example
    --set model.activation=gelu,relu2), each setting trained with --seeds seeds, seed by
    seed, one run after another in this process on one device. Every run's config is
    resolved first, so a value its key cannot take is refused before any run starts; each
    run must evaluate (training.eval_every, a validation set). Each run gets a folder in
    SWEEPDIR (NN_<values>_s<seed>); SWEEPDIR/sweep.json records the grid and each run's
    config and status. A run that fails (a loss that is not finite) is marked failed and
    the sweep goes on; the command then exits with status 1.

    --resume SWEEPDIR continues an interrupted sweep: a run that finished is skipped, a run
    that was interrupted resumes from its latest checkpoint (as `eulergen train --resume`),
    or starts again from step 0 when it saved none, and a failed run is tried again.

    The end is a table of the runs (as `eulergen compare` prints it), a table of the
    settings (the mean and sample std of the final val loss over the seeds, and the
    difference from the first setting in standard errors of the difference, SE =
    sqrt(s0^2/n0 + s^2/n): real when |difference| > 2 SE), SWEEPDIR/compare.png, and the
    sweep's own time beyond its runs."""
    began = time.perf_counter()
    limit_blas_threads()
    from eulergen.runtime.train import sweep as sweeps
    from eulergen.runtime.train.compare import COMPARE_PLOT, plot_runs, runs_table
    from eulergen.runtime.train.sweep_stats import RULE, settings_table

    if resume is not None:
        if config_path or sets or seeds or out or device:
            raise EulerError("--resume continues a sweep with its saved grid: give only --ops",
                             key="--resume")
        grid, status = sweeps.load_sweep(resume)
    else:
        grid, status = sweeps.new_sweep(config_path, sets, seeds or 1, out, device), None
    lib = library(grid.trials[0].config, ops_dirs, names=grid.ops())
    built = time.perf_counter()   # the ops built and loaded once, as a lone run's would be
    ran = sweeps.run_sweep(grid, lib, status, say=lambda line: click.echo(line, err=True))
    runs, stats = sweeps.report(grid, ran)
    show = console()
    if runs:
        show.print(runs_table(runs, f"sweep {grid.path}: {len(runs)} runs"))
        show.print(settings_table(stats))
        click.echo(RULE)
        click.echo(f"wrote {plot_runs(runs, grid.path / COMPARE_PLOT)}")
    trained = [r for r in ran if r.how != "skipped"]
    if trained:
        own = time.perf_counter() - built - sum(r.seconds for r in trained)
        click.echo(f"{len(trained)} runs trained in {sum(r.seconds for r in trained):.1f} s; "
                   f"the sweep's own time {own:.2f} s ({own / len(trained):.2f} s a run), "
                   f"besides {built - began:.2f} s to load eulergen and its ops once")
    failed = [r for r in ran if r.error]
    for r in failed:
        warn(f"run {r.trial.dir} failed: {r.error}")
    if failed:
        raise SystemExit(1)
