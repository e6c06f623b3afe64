"""The `eulergen` command line. Each command is a thin shell over a module function;
bad input arrives here as EulerError and is printed as one line (`--debug` shows the
traceback)."""
from __future__ import annotations

import sys
from pathlib import Path

import click

from eulergen.errors import EulerError

ops_option = click.option(
    "--ops", "ops_dirs", multiple=True, type=click.Path(path_type=Path),
    help="Extra directory of op specs (repeatable); also EULERGEN_OPS_PATH.")


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except EulerError as err:
            if ctx.params.get("debug"):
                raise
            click.echo(f"error: {err}", err=True)
            sys.exit(2)


@click.group(cls=_Group)
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
@click.version_option(package_name="eulergen")
def main(debug: bool) -> None:
    """eulergen: CUDA kernels generated from declarative op specs."""


@main.command()
@click.argument("names", nargs=-1)
@ops_option
def check(names: tuple[str, ...], ops_dirs: tuple[Path, ...]) -> None:
    """Check derived backward passes against central differences, and extreme inputs."""
    from eulergen.generator.check import run_check
    sys.exit(run_check(names, ops_dirs))


@main.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
def plot(run_dir: Path) -> None:
    """Write RUN_DIR/loss.png: train and validation loss against step."""
    from eulergen.runtime.metrics import plot_run
    click.echo(f"wrote {plot_run(run_dir)}")
