"""`eulergen export` and `eulergen eval` (runtime/interop/hf.py, runtime/train/evaluate.py)."""
from __future__ import annotations

from pathlib import Path

import click

from eulergen.cli.common import COUNT, library, limit_blas_threads, ops_option, warn
from eulergen.errors import EulerError
from eulergen.progress import Bar


@click.command()
@click.argument("run", metavar="RUN_OR_CKPT")
@click.option("--out", required=True, type=click.Path(path_type=Path),
              help="The folder to write (new, empty, or an earlier export).")
def export(run, out) -> None:
    """Write a checkpoint as a transformers folder (GPT2LMHeadModel or LlamaForCausalLM,
    tied embeddings, the vocab unpadded) with the run's tokenizer as tokenizer.json."""
    import json

    from eulergen.runtime.interop import hf
    from eulergen.runtime.train.evaluate import open_model, tokenizer_of
    from eulergen.runtime.data.tokenizer import hf_tokenizer_json

    with Bar("export", unit="tensors") as bar:   # read and checked, then converted
        weights = open_model(run, bar=bar)
        files, eot = {}, None
        try:
            tok = tokenizer_of(weights)
            eot = tok.eot
            text = hf_tokenizer_json(tok)
            files = {hf.TOKENIZER: text,
                     "tokenizer_config.json": json.dumps(hf.tokenizer_config(text, eot)).encode()}
        except EulerError as err:
            warn(f"no tokenizer written: {err}", bar)
        arch = hf.export_folder(weights.cfg.model, weights.params, out, tokenizer_files=files,
                                eot=eot, bar=bar)
    click.echo(f"wrote {out}: {arch}{' with its tokenizer' if files else ''} "
               f"(transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}))")


@click.command("eval")
@click.argument("run", metavar="RUN_OR_CKPT")
@click.option("--data", "dataset", required=True,
              help="A data.dataset value: a glob of token shards, a .bin file, builtin:stdlib.")
@click.option("--batch-size", type=COUNT, default=8, show_default=True)
@click.option("--seq-len", type=COUNT, help="[default: the run's training.seq_len]")
@click.option("--max-batches", type=COUNT, help="Stop after N batches [default: all].")
@click.option("--device", type=click.Choice(["auto", "cuda", "numpy"]))
@ops_option
def eval_(run, dataset, batch_size, seq_len, max_batches, device, ops_dirs) -> None:
    """Mean cross-entropy and perplexity of a checkpoint (or a transformers folder) over
    every whole window of a dataset (builtin:stdlib: its held-out split)."""
    limit_blas_threads()
    from eulergen.runtime.train.evaluate import evaluate, open_model

    with Bar("load", unit="tensors") as bar:
        weights = open_model(run, device, bar=bar)
    seq = seq_len or weights.cfg.training.seq_len
    lib = library(weights.cfg, ops_dirs)   # its notices (no GPU: numpy) before the bar
    with Bar("eval", unit="batches") as bar:
        result = evaluate(weights, lib, dataset, batch=batch_size, seq=seq,
                          max_batches=max_batches, bar=bar)
    click.echo(f"loss {result.loss:.4f}  perplexity {result.perplexity:.3f}  "
               f"({result.tokens:,} tokens, {result.windows:,} windows of {seq})")
