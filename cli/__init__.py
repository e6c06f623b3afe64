"""The `eulergen` command line: the click group, and a module per command or small family
of them (build and check, data, train, sweep, plan, sample and chat, hf's export and eval,
export-c, compare and plot).
Each command is a thin shell over a module function; bad input arrives here as EulerError
and is printed as one line (`--debug` shows the traceback). The command modules import
only click at the top, so that `eulergen --help` loads nothing else."""
from __future__ import annotations

import sys

import click

from eulergen.cli import build, compare, data, export_c, hf, plan, sample, sweep, train
from eulergen.errors import EulerError


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.UsageError as err:
            if ctx.params.get("debug") or err.ctx is None:
                raise
            # a bad flag or argument of a command: one line, as every other refusal
            click.echo(f"error: {err.format_message()} (see `{err.ctx.command_path} --help`)",
                       err=True)
            sys.exit(err.exit_code)
        except EulerError as err:
            if ctx.params.get("debug"):
                raise
            click.echo(f"error: {err}", err=True)
            sys.exit(2)
        except OSError as err:
            # the machine's refusals (disk full, a read-only folder, no permission) wherever
            # a command writes or reads that no closer handler names: one line, the file first
            if ctx.params.get("debug") or err.strerror is None:
                raise
            where = f"{err.filename}: " if err.filename else ""
            click.echo(f"error: {where}{err.strerror}", err=True)
            sys.exit(2)


@click.group(cls=_Group)
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
@click.version_option(package_name="eulergen")
def main(debug: bool) -> None:
    """eulergen: CUDA kernels generated from declarative op specs."""
    from eulergen import env
    from eulergen.cli.common import warn
    for line in env.check_own():   # a bad EULERGEN_* value: one line, before any work
        warn(line)


for _command in (build.check, build.build, compare.plot, compare.compare, data.prepare,
                 data.tokenizer, train.train, sweep.sweep, plan.plan, sample.sample, sample.chat,
                 hf.export, hf.eval_, export_c.export_c):
    main.add_command(_command)
