"""`eulergen plan` (runtime/model/memory.py): the memory plan of a run's training step or of
its sampler."""
from __future__ import annotations

from pathlib import Path

import click

from eulergen.cli.common import default_named, ops_option, run_config


@click.command()
@click.option("--config", "config_path", type=click.Path(path_type=Path))
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE")
@click.option("--inference", is_flag=True,
              help="Plan the sampler's KV-cache model (no grads, no AdamW; k and v per layer; "
                   "bf16 with training.dtype=bf16, the default on a bf16 GPU).")
@click.option("--nproc", type=click.IntRange(min=1), default=1, show_default=True,
              help="Plan one rank of this many data-parallel ranks (with training.zero=1 each "
                   "holds a share of AdamW's moments).")
@ops_option
def plan(config_path, overrides, inference, nproc, ops_dirs) -> None:
    """Print the memory plan of a run: every buffer, its shape, dtype and bytes, and totals."""
    from rich.console import Console

    from eulergen.runtime.model.arch import arch_of
    from eulergen.runtime.engine.attention import PLAN_SMS
    from eulergen.runtime.engine.backend import NUMPY
    from eulergen.runtime.distributed.buckets import plan_buckets
    from eulergen.runtime.engine.cublas import WORKSPACE_BYTES
    from eulergen.runtime.engine.cuda_ops import workspace_elements
    from eulergen.runtime.generate.decoder import plan_decoder
    from eulergen.runtime.model.memory import plan_table, storage
    from eulergen.runtime.model.gpt import plan_model
    from eulergen.runtime.engine.ops import OpLibrary
    from eulergen.runtime.model.params import param_count

    from eulergen.runtime.train.budget import check_config

    cfg = run_config(config_path, overrides)
    check_config(cfg)   # a million layers would be a million-layer table
    manifests = []
    if ops_dirs:
        from eulergen.generator.build import ensure_built
        manifests = ensure_built((), ops_dirs) or []
    arch = arch_of(cfg.model, OpLibrary(NUMPY, manifests))   # the manifest alone: no GPU needed
    t = cfg.training
    # a GPU run's plan (a GPU with bf16 tensor cores: training.dtype auto is bf16), the
    # kernels' and cuBLASLt's workspaces included, whatever this machine runs on
    dtype = "float32" if t.dtype == "fp32" else "bf16"
    buckets = None if inference or nproc == 1 else plan_buckets(
        arch, nproc, zero=bool(t.zero), bucket_mb=t.bucket_mb, itemsize=storage(dtype).itemsize)
    p = (plan_decoder(arch, t.batch_size, t.seq_len, dtype=dtype, sms=PLAN_SMS) if inference
         else plan_model(arch, t.batch_size, t.seq_len, workspace=workspace_elements,
                         dtype=dtype, gemm_workspace=WORKSPACE_BYTES, buckets=buckets))
    ranks = "" if buckets is None else \
        f", one rank of {nproc}{' with ZeRO-1' if buckets.zero else ''}"
    title = (f"memory plan{default_named(cfg)}: {param_count(arch):,} parameters, "
             f"B={t.batch_size}, T={t.seq_len}, "
             f"{'inference (KV cache)' if inference else f'training, {t.dtype}'}{ranks}")
    console = Console()
    if not console.is_terminal:   # piped or captured: never cut a buffer name short
        console = Console(width=120)
    console.print(plan_table(p, title))
