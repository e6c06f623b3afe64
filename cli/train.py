"""`eulergen train`: where the run starts (runtime/train/start.py: a file, a resumed run or an
imported model), its ops built, then the Trainer (runtime/train/trainer.py) in one process,
a rank of a launcher's, or --nproc ranks of its own (runtime/distributed/workers.py)."""
from __future__ import annotations

from pathlib import Path

import click

from eulergen.cli.common import (RANKS, default_named, library, limit_blas_threads,
                                 ops_option, precision_label)
from eulergen.errors import EulerError
from eulergen.progress import Bar


@click.command()
@click.option("--config", "config_path", type=click.Path(path_type=Path),
              help="NanoEuler JSON or YAML config (default: the built-in small model).")
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE",
              help="Override one config value (repeatable).")
@click.option("--resume", type=click.Path(path_type=Path), metavar="RUN",
              help="Continue the run in folder RUN from its latest checkpoint.")
@click.option("--run-dir", type=click.Path(path_type=Path),
              help="Where the run writes (default: a new runs/<config>-<date>-<time>).")
@click.option("--device", type=click.Choice(["auto", "cuda", "numpy"]))
@click.option("--init-from", metavar="PATH",
              help="Start from a transformers save_pretrained folder (GPT2LMHeadModel or "
                   "LlamaForCausalLM) or a Hub id such as gpt2; the model config is its config.json.")
@click.option("--nproc", type=RANKS, default=1, show_default=True,
              help="Data-parallel ranks on this machine, one per GPU on CuPy (training.batch_size "
                   "is each rank's); under torchrun or srun leave it out.")
@ops_option
def train(config_path, overrides, resume, run_dir, device, init_from, ops_dirs, nproc) -> None:
    """Train a GPT on generated kernels (no arguments: a small byte-level model on the
    standard library's source, a few minutes on a CPU)."""
    limit_blas_threads()
    from eulergen.runtime.distributed import collective as coll
    from eulergen.runtime.distributed.workers import follow_launcher
    from eulergen.runtime.engine import gemm
    from eulergen.runtime.distributed.data_parallel import connect
    from eulergen.runtime.model.memory import format_bytes
    from eulergen.runtime.train.start import start
    from eulergen.runtime.train.trainer import Trainer

    rv = coll.Rendezvous.from_env()
    if rv is not None:
        follow_launcher()   # a rank of --nproc's dies with it
    if nproc > 1:
        _start_ranks(nproc, rv, config_path, overrides, resume, run_dir, device, init_from,
                     ops_dirs)
        return
    # under a launcher every rank must name the same folder: the config's, not a fresh one
    with Bar("import", unit="tensors", enabled=init_from is not None) as bar:
        begin = start(config_path, overrides, resume=resume, run_dir=run_dir, device=device,
                      init_from=init_from, fresh_run_dir=rv is None, bar=bar)
    cfg = begin.cfg
    if rv is not None and cfg.training.device != "numpy":
        coll.select_gpu(rv)   # GPU LOCAL_RANK, before any kernel touches a device
    lib = library(cfg, ops_dirs)
    if rv is not None and rv.rank == 0:   # said before the first wait, however long it is
        click.echo(f"eulergen: rank 0 of {rv.world_size} waits at {rv.master_addr}:"
                   f"{rv.master_port} for the others, each wait at most {rv.timeout:g} s "
                   f"({coll.TIMEOUT_ENV})", err=True)
    collective = connect(rv, lib.backend) if rv is not None else None
    try:
        trainer = Trainer(cfg, lib, resume=resume is not None, initial=begin.initial,
                          init_from=begin.source, collective=collective)
        if rv is not None and rv.rank:
            trainer.run()   # rank 0 reports
            return
        t = trainer.cfg.training   # training.dtype auto resolved
        ranks = "" if rv is None else \
            f"{rv.world_size} ranks{' (ZeRO-1)' if t.zero else ''} x "
        click.echo(f"eulergen train: {lib.backend.device}{default_named(cfg)}, "
                   f"{trainer.model.param_total:,} "
                   f"parameters, {ranks}B={t.batch_size} T={t.seq_len} x{t.gradient_accumulation}, "
                   f"{precision_label(t)}, GEMMs {gemm.describe(lib.backend)}, memory plan "
                   f"{format_bytes(trainer.model.mem.plan.total_bytes)}, run {cfg.run_dir}"
                   + (f", resuming at step {trainer.step}" if resume is not None else ""), err=True)
        result = trainer.run()
    finally:
        if collective is not None:
            collective.close()
    if result.val_losses:
        steps = sorted(result.val_losses)
        click.echo(f"val loss {result.val_losses[steps[0]]:.4f} (step {steps[0]}) -> "
                   f"{result.val_losses[steps[-1]]:.4f} (step {steps[-1]})")
    if result.skipped:
        click.echo(f"updates skipped by the spike guard at steps {result.skipped}")
    click.echo(f"run folder {cfg.run_dir} (continue it: eulergen train --resume {cfg.run_dir} "
               "--set training.total_steps=N)")


def _start_ranks(nproc, rv, config_path, overrides, resume, run_dir, device, init_from,
                 ops_dirs) -> None:
    """--nproc: one run folder named here (each rank would otherwise pick its own), the GPU
    count checked, then the ranks as `python -m eulergen train` (runtime/distributed/workers.py)."""
    from eulergen.runtime.distributed.workers import check_ranks, run_workers
    from eulergen.runtime.train.start import resumed_config, run_config
    if rv is not None:
        raise EulerError(f"--nproc starts its own ranks, but this process is already rank "
                         f"{rv.rank} of {rv.world_size} (torchrun, srun): leave --nproc out",
                         key="--nproc")
    cfg = resumed_config(resume, overrides, device) if resume \
        else run_config(config_path, overrides, run_dir, device, fresh_run_dir=True)
    run_dir = None if resume else cfg.run_dir
    check_ranks(nproc, cfg.training.device)
    args = [*(["--config", str(config_path)] if config_path else []),
            *(a for o in overrides for a in ("--set", o)),
            *(["--resume", str(resume)] if resume else []),
            *(["--run-dir", str(run_dir)] if run_dir else []),
            *(["--device", device] if device else []),
            *(["--init-from", init_from] if init_from else []),
            *(a for d in ops_dirs for a in ("--ops", str(d)))]
    status = run_workers(nproc, args)
    if status:
        raise SystemExit(status)
