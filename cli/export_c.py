"""`eulergen export-c` (runtime/interop/c_export.py; --train: c_train.py)."""
from __future__ import annotations

from pathlib import Path

import click

from eulergen.cli.common import ops_option


@click.command("export-c")
@click.argument("run", metavar="RUN_OR_CKPT")
@click.option("--out", required=True, type=click.Path(path_type=Path),
              help="The folder to write (new, empty, or an earlier export-c).")
@click.option("--train", is_flag=True,
              help="Also a training program that continues the run from the checkpoint.")
@ops_option
def export_c(run, out, train, ops_dirs) -> None:
    """Write a checkpoint (or a transformers folder) as a C program: its weights, its
    tokenizer, the model as C from its graph, the generated C and CUDA of its ops, a
    Makefile (`make cpu`, `make cuda`) and a README. No Python at run time. With --train,
    `make cpu` also builds train_cpu, which continues the run's training in C (float32,
    one process) and writes checkpoints `eulergen sample` reads."""
    from eulergen.generator.build import ensure_built
    from eulergen.runtime.engine.backend import NUMPY
    from eulergen.runtime.engine.ops import OpLibrary
    from eulergen.runtime.interop.c_export import export_c as write
    from eulergen.runtime.model.arch import arch_of, ops_used
    from eulergen.runtime.train.continued import checkpoint_of, continued
    from eulergen.runtime.train.evaluate import checkpoint_weights, open_model, tokenizer_of

    ck = checkpoint_of(run) if train else None   # before a transformers folder is read
    weights = checkpoint_weights(ck) if train else open_model(run)   # the checkpoint read once
    cfg = weights.cfg
    tok = tokenizer_of(weights)
    lib = OpLibrary(NUMPY, ensure_built(ops_used(cfg.model), ops_dirs))
    run_state = continued(ck, lib) if train else None
    no_cuda = write(arch_of(cfg.model, lib), weights.params, tok, out,
                    context=cfg.training.seq_len, run=run_state)
    cuda = f"; no CUDA build ({no_cuda})" if no_cuda else ", `make cuda`"
    then = f"{out / 'run_cpu'} --prompt TEXT"
    if run_state is not None:
        then += f", {out / 'train_cpu'} --steps N --run-dir DIR"
    click.echo(f"wrote {out}: `make cpu`{cuda}; then {then}")
