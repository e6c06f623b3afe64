"""`eulergen check` and `eulergen build` (generator/check.py, build.py); `build --compile`
joins the generator to the runtime's NVRTC cache."""
from __future__ import annotations

import sys
from pathlib import Path

import click

from eulergen.cli.common import ops_option
from eulergen.errors import EulerError


@click.command()
@click.argument("names", nargs=-1)
@ops_option
def check(names: tuple[str, ...], ops_dirs: tuple[Path, ...]) -> None:
    """Check derived backward passes against central differences, and extreme inputs."""
    from eulergen.generator.check import run_check
    sys.exit(run_check(names, ops_dirs))


@click.command()
@click.option("--check", "check_only", is_flag=True,
              help="Write nothing; exit non-zero when generated/ is stale.")
@click.option("--compile", "compile_", is_flag=True,
              help="Also compile every kernel into the runtime's NVRTC cache (needs a GPU).")
@ops_option
def build(check_only: bool, compile_: bool, ops_dirs: tuple[Path, ...]) -> None:
    """Regenerate CUDA kernels, numpy modules and the manifest from the op specs."""
    from eulergen.generator.build import build_sets, display_path, run_build
    status = run_build(ops_dirs, check=check_only, echo=click.echo)
    if compile_ and not check_only:
        # The generator never imports the runtime: the CLI builds, then has it compile.
        try:
            from eulergen.runtime.engine.compile import compile_manifest
            for root, _, _ in build_sets(ops_dirs):
                click.echo(f"compiling kernels of {display_path(root, 'manifest.json')}")
                compile_manifest(root / "manifest.json")
        except ImportError as err:   # CuPy (or the runtime's compile) is not importable
            raise EulerError(f"--compile needs CuPy and a GPU ({err}); install "
                             "'eulergen[cuda13]' (or [cuda12]), or build without --compile"
                             ) from None
    sys.exit(status)
