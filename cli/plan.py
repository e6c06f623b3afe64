"""`eulergen plan` (runtime/model/memory.py): the memory plan of a run's training step or of
its sampler."""
from __future__ import annotations

from pathlib import Path

import click

from eulergen.cli.common import RANKS, console, default_named, ops_option, precision_label


@click.command()
@click.option("--config", "config_path", type=click.Path(path_type=Path))
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE")
@click.option("--inference", is_flag=True,
              help="Plan the sampler's KV-cache model (no grads, no optimizer state; k and v "
                   "per layer; bf16 with training.dtype=bf16, the default on a bf16 GPU).")
@click.option("--nproc", type=RANKS, default=1, show_default=True,
              help="Plan one rank of this many data-parallel ranks (with training.zero=1 each "
                   "holds a share of the optimizer's state).")
@ops_option
def plan(config_path, overrides, inference, nproc, ops_dirs) -> None:
    """Print the memory plan of a run: every buffer, its shape, dtype and bytes, and totals."""
    from eulergen.runtime.engine.backend import NUMPY
    from eulergen.runtime.engine.ops import OpLibrary
    from eulergen.runtime.model.memory import plan_table
    from eulergen.runtime.model.params import param_count
    from eulergen.runtime.train.resolve import resolve
    from eulergen.runtime.train.start import run_config

    cfg = run_config(config_path, overrides)
    manifests = []
    if ops_dirs:
        from eulergen.generator.build import ensure_built
        manifests = ensure_built((), ops_dirs) or []
    # a GPU run's plan (a GPU with bf16 tensor cores: training.dtype auto is bf16), the
    # kernels' and cuBLASLt's workspaces included, whatever this machine runs on: the
    # manifest alone, no GPU needed
    run = resolve(cfg, OpLibrary(NUMPY, manifests), ranks=None if nproc == 1 else nproc,
                  for_gpu=True, inference=inference)
    t, buckets = cfg.training, run.buckets
    ranks = "" if buckets is None else \
        f", one rank of {nproc}{' with ZeRO-1' if buckets.zero else ''}"
    what = "inference (KV cache)" if inference else f"training, {precision_label(t)}"
    title = (f"memory plan{default_named(cfg)}: {param_count(run.arch):,} parameters, "
             f"B={t.batch_size}, T={t.seq_len}, {what}{ranks}")
    console().print(plan_table(run.plan, title))
