"""`eulergen prepare` and `eulergen tokenizer train` (runtime/data/prepare.py, sources.py,
tokenizer.py)."""
from __future__ import annotations

from pathlib import Path

import click

from eulergen.cli.common import RANKS, warn
from eulergen.errors import EulerError
from eulergen.progress import BYTES, Bar


class _TokenCount(click.ParamType):
    """A count of tokens: 20000, 10M, 1.5G."""
    name = "count"
    _SCALE = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9}
    MAX = 2**31 - 1

    def convert(self, value, param, ctx):
        import re
        match = re.fullmatch(r"(\d+(?:\.\d+)?)([KMG]?)", str(value).strip().upper())
        number = float(match[1]) * self._SCALE[match[2]] if match else 0.0
        if number < 1 or not number.is_integer():
            self.fail(f"{value!r} is not a positive token count (e.g. 20000, 10M, 1.5G)", param, ctx)
        if number > self.MAX:
            self.fail(f"{value} tokens: a shard holds at most {self.MAX:,} (its header counts "
                      "them in an int32)", param, ctx)
        return int(number)


_on_bad_text = click.option(
    "--on-bad-text", type=click.Choice(["stop", "skip"]), default="stop", show_default=True,
    help="A document that is not UTF-8: stop, naming its file and byte offset, or leave it out.")
_text_key = click.option("--text-key", default="text", show_default=True,
                         help="The .jsonl field, .parquet column or dataset field holding the text.")


def _sources(sources, dataset, subset, split, text_key):
    from eulergen.runtime.data.sources import HubDataset, LocalFiles
    if dataset and sources:
        raise EulerError("give local SOURCES or --dataset, not both", key="--dataset")
    return HubDataset(dataset, subset, split, text_key) if dataset else LocalFiles(list(sources), text_key)


@click.command()
@click.argument("sources", nargs=-1)
@click.option("--out", required=True, type=click.Path(path_type=Path),
              help="Folder for the shards and prepare.json (a rerun continues it).")
@click.option("--dataset", help="Stream a Hugging Face dataset instead, e.g. HuggingFaceFW/fineweb-edu.")
@click.option("--subset", help="The dataset's configuration, e.g. sample-10BT.")
@click.option("--split", default="train", show_default=True)
@_text_key
@click.option("--tokenizer", "tokenizer_spec", default="gpt2", show_default=True,
              help="gpt2, byte, or a tokenizer.json (e.g. from `eulergen tokenizer train`).")
@click.option("--workers", type=RANKS, help="Tokenizing processes [default: cores].")
@click.option("--shard-tokens", type=_TokenCount(), default="100M", show_default=True)
@click.option("--val-tokens", type=_TokenCount(), default="10M", show_default=True,
              help="Tokens in the validation shard, shard 0.")
@_on_bad_text
@click.option("--name", help="Shard file prefix [default: the folder's name].")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def prepare(sources, out, dataset, subset, split, text_key, tokenizer_spec, workers, shard_tokens,
            val_tokens, on_bad_text, name, quiet) -> None:
    """Tokenize text into llm.c shards: SOURCES are .txt (a document a file), .jsonl (a
    document a line), .parquet (a document a row), folders or globs of them."""
    import shlex

    from eulergen.runtime.data.prepare import Settings, shown, train_glob
    from eulergen.runtime.data.prepare import prepare as run_prepare
    from eulergen.runtime.data.tokenizer import tokenizer_named

    source = _sources(sources, dataset, subset, split, text_key)
    tok = tokenizer_named(tokenizer_spec, key="--tokenizer")
    settings = Settings(shard_tokens, val_tokens, on_bad_text, name)
    with Bar("prepare", source.total_bytes, unit=BYTES, enabled=not quiet) as bar:
        state = run_prepare(source, out, tok, settings, workers=workers, progress=shown(bar),
                            warn=lambda message: warn(message, bar))
    skipped = f", {state.skipped} left out as not UTF-8" if state.skipped else ""
    click.echo(f"{out}: {len(state.shards)} shards (1 val, {len(state.shards) - 1} train), "
               f"{state.tokens:,} tokens from {state.documents:,} documents{skipped}")
    click.echo("train on it: eulergen train"
               f" --set data.dataset={shlex.quote(train_glob(out, state.settings['name']))}"
               f" --set data.tokenizer={shlex.quote(tok.name)} --set model.vocab_size={tok.vocab_size}")


@click.group()
def tokenizer() -> None:
    """Tokenizers of one's own."""


@tokenizer.command("train")
@click.argument("sources", nargs=-1, required=True)
@click.option("--vocab-size", type=int, required=True, help="Ids, including 256 bytes and <|endoftext|>.")
@click.option("--out", default="tokenizer.json", show_default=True, type=click.Path(path_type=Path))
@_text_key
@_on_bad_text
def tokenizer_train(sources, vocab_size, out, text_key, on_bad_text) -> None:
    """Train a byte-level BPE (GPT-2's kind, Hugging Face tokenizers) on SOURCES, the
    files `eulergen prepare` reads; write it as a tokenizer.json."""
    from eulergen.runtime.data.sources import checked
    from eulergen.runtime.data.tokenizer import train_bpe

    source = _sources(sources, None, None, "train", text_key)

    def texts(bar):   # read as the trainer takes them; then it merges, in Rust
        for doc in checked(source.documents(), on_bad_text, lambda m: warn(m, bar)):
            bar.update(advance=doc.advance, status="reading")
            if doc.text:
                yield doc.text
        bar.update(status=f"merging to {vocab_size:,} ids")

    with Bar("tokenizer", source.total_bytes, unit=BYTES) as bar:
        tok = train_bpe(texts(bar), vocab_size, out)
    click.echo(f"wrote {out}: byte-level BPE, {tok.vocab_size} ids, <|endoftext|> = {tok.eot}")
    click.echo(f"use it: eulergen prepare --tokenizer {out} …, and --set data.tokenizer={out}")
