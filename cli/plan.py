"""`eulergen plan` (runtime/model/memory.py): the memory plan of a run's training step or of
its sampler."""
from __future__ import annotations

import math

from dataclasses import replace
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
    lib, world = OpLibrary(NUMPY, manifests), None if nproc == 1 else nproc
    run = resolve(cfg, lib, ranks=world, for_gpu=True, inference=inference)
    t, buckets = cfg.training, run.buckets
    ranks = "" if buckets is None else \
        f", one rank of {nproc}{' with ZeRO-1' if buckets.zero else ''}"
    what = "inference (KV cache)" if inference else f"training, {precision_label(t)}"
    title = (f"memory plan{default_named(cfg)}: {param_count(run.arch):,} parameters, "
             f"B={t.batch_size}, T={t.seq_len}, {what}{ranks}")
    console().print(plan_table(run.plan, title))
    if not inference:
        console().print(optimizer_line(run))
        other = resolve(replace(cfg, training=replace(t, recompute=_other(t.recompute))),
                        lib, ranks=world, for_gpu=True)
        console().print(recompute_line(run, other))


def optimizer_line(run) -> str:
    """Which update op steps which parameters (runtime/model/optimizer_plan.py): with a
    rest op, the Linear weights the main op's and the others the rest op's."""
    from eulergen.runtime.model.optimizer_plan import plan_optimizer
    from eulergen.runtime.model.params import param_count
    a, ops = run.arch, run.optimizer
    owner = dict(plan_optimizer(a, ops).owner)
    line = f"training.optimizer {ops.main.name}: "
    if ops.rest is None:
        return line + f"every parameter ({param_count(a):,} elements)"

    def of(op) -> str:
        specs = [s for s, _ in a.param_layout.entries if owner[s.name] == op.name]
        n = sum(math.prod(s.shape) for s in specs)
        return f"{len(specs)} parameters, {n:,} elements"
    return line + (f"the Linear weights ({of(ops.main)}); its rest op {ops.rest.name}: the "
                   f"embeddings and the 1-D parameters ({of(ops.rest)})")


def _other(mode: str) -> str:
    from eulergen.runtime.model.recompute import BLOCKS, NONE
    return NONE if mode == BLOCKS else BLOCKS


def recompute_line(run, other) -> str:
    """What training.recompute blocks saves and costs against none, from the two runs'
    resolved plans (`run` the config's, `other` the same run in the other mode): the
    bytes the blocks keep for the backward, the plans' totals, the FLOPs of the forwards
    run twice (a third of a block's training FLOPs, as runtime/train/trainer.py counts
    them: 2 of the 6 a weight, 4 of attention's 12)."""
    from eulergen.runtime.model.memory import format_bytes
    from eulergen.runtime.model.recompute import BLOCKS, kept_bytes, rerun_layers
    from eulergen.runtime.train.trainer import flops_per_token
    t, a = run.cfg.training, run.arch
    blocks, none = (run, other) if t.recompute == BLOCKS else (other, run)
    kept = {r: format_bytes(kept_bytes(a.graph, r.plan)) for r in (blocks, none)}
    total = {r: format_bytes(r.plan.total_bytes) for r in (blocks, none)}
    tokens = t.batch_size * t.seq_len
    one, two = (flops_per_token(replace(a, layers=n), t.seq_len) for n in (1, 2))
    again = rerun_layers(a.layers, BLOCKS)
    extra, step = again * (two - one) / 3 * tokens, flops_per_token(a, t.seq_len) * tokens
    cost = (f"the forward of {again} of {a.layers} blocks run again in the backward, "
            f"+{_flops(extra)} a step (+{100 * extra / step:.0f}% of {_flops(step)})")
    if run is blocks:
        return (f"training.recompute blocks: the blocks keep {kept[blocks]} for the backward "
                f"(none: {kept[none]}), the plan {total[blocks]} (none: {total[none]}), for "
                f"{cost}")
    return (f"training.recompute none: the blocks keep {kept[none]} for the backward; blocks "
            f"would keep {kept[blocks]} (the plan {total[blocks]}, not {total[none]}) for "
            f"{cost}")


def _flops(n: float) -> str:
    for unit in ("FLOP", "kFLOP", "MFLOP", "GFLOP", "TFLOP"):
        if n < 1000 or unit == "TFLOP":
            return f"{n:.3g} {unit}"
        n /= 1000
