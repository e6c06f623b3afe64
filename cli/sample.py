"""`eulergen sample` and `eulergen chat` (runtime/generate/sample.py) over a checkpoint or a
transformers folder."""
from __future__ import annotations

import sys
from pathlib import Path

import click

from eulergen.cli.common import COUNT, SEED, library, limit_blas_threads, ops_option, warn
from eulergen.errors import EulerError
from eulergen.progress import Bar


def _checkpoint_sampler(run, device, ops_dirs, num_samples: int, dtype: str):
    """The tokenizer and a KV-cache Sampler over a run folder's latest checkpoint (or one
    checkpoint folder, or a transformers folder or Hub id), with the config it was trained
    with (runtime/train/evaluate.py open_sampler)."""
    limit_blas_threads()
    from eulergen.runtime.train.evaluate import open_model, open_sampler, tokenizer_of
    from eulergen.runtime.generate.sample import sampling_dtype

    with Bar("load", unit="tensors") as bar:
        weights = open_model(run, device, bar=bar)
    cfg = weights.cfg
    tok = tokenizer_of(weights)
    lib = library(cfg, ops_dirs)
    sampler = open_sampler(weights, lib, batch=num_samples,
                           dtype=sampling_dtype(dtype, lib.backend),
                           notify=lambda m: click.echo(m, err=True))
    return tok, sampler


def _sampling_options(f):
    for option in reversed([
            click.option("--max-new-tokens", type=COUNT, default=200, show_default=True,
                         help="At most 100,000 unless --unlimited."),
            click.option("--unlimited", is_flag=True,
                         help="Let --max-new-tokens pass 100,000 (a turn may then run for hours)."),
            click.option("--temperature", default=0.8, show_default=True,
                         help="0: greedy (always the most likely token)."),
            click.option("--top-k", type=click.IntRange(0, 2**31 - 1), default=40,
                         show_default=True, help="Draw from the k most likely tokens (0: all)."),
            click.option("--top-p", default=1.0, show_default=True,
                         help="Nucleus: the fewest tokens whose probability reaches p (1: all)."),
            click.option("--seed", type=SEED, default=0, show_default=True),
            click.option("--device", type=click.Choice(["auto", "cuda", "numpy"])),
            click.option("--dtype", type=click.Choice(["auto", "bf16", "fp32"]), default="auto",
                         show_default=True,
                         help="Weights and KV cache: auto is bf16 on a GPU with bf16 (sm_80+)."),
            ops_option]):
        f = option(f)
    return f


def _settings(temperature, top_k, top_p, seed, max_new_tokens, unlimited) -> dict:
    """Sampler.samples' settings from the options, checked before a model is loaded."""
    from eulergen.runtime.generate.sample import MAX_NEW_TOKENS, check_settings
    settings = dict(temperature=temperature, top_k=top_k or None,
                    top_p=None if top_p == 1 else top_p, seed=seed)
    check_settings(settings["temperature"], settings["top_k"], settings["top_p"], max_new_tokens)
    if max_new_tokens > MAX_NEW_TOKENS and not unlimited:
        raise EulerError(f"{max_new_tokens:,} tokens: at most {MAX_NEW_TOKENS:,} a sample or "
                         "turn (--unlimited lifts it)", key="--max-new-tokens")
    return settings


def _prompt_ids(tok, text: str, key: str) -> list[int]:
    """`text` as ids, refusing text the tokenizer can only encode as its unknown token."""
    at = tok.unknown(text)
    if at is not None:
        raise EulerError(f"character {at} ({text[at]!r}) is not in the tokenizer's vocabulary "
                         f"({tok.name} would encode it as its unknown token)", key=key)
    return tok.encode(text)


def _utf8(text: str, key: str) -> str:
    """Text from the command line or a terminal that must be UTF-8: bytes that are not
    arrive as lone surrogates (Python's surrogateescape), which no tokenizer encodes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        bad = ord(text[err.start]) - 0xDC00 if 0xDC80 <= ord(text[err.start]) <= 0xDCFF else None
        raise EulerError("not UTF-8 text" + (f" (byte 0x{bad:02x} at character {err.start})"
                                             if bad is not None else ""), key=key) from None
    return text


def _printer(tok):
    """(stream, on_step): a TextStream over `tok` and the on_step that prints the first
    row's tokens through it as they come (its end of text not shown); flush at the end."""
    from eulergen.runtime.generate.sample import TextStream
    stream = TextStream(tok.decode)

    def show(tokens):
        if tokens[0] != tok.eot:
            click.echo(stream.push(tokens[0]), nl=False)

    return stream, show


@click.command()
@click.argument("run", type=click.Path(path_type=Path))
@click.option("--prompt", default="\n", show_default=True)
@click.option("--num-samples", type=COUNT, default=1, show_default=True,
              help="Samples of the prompt, generated as one batch.")
@_sampling_options
def sample(run, prompt, num_samples, max_new_tokens, unlimited, temperature, top_k, top_p, seed,
           device, dtype, ops_dirs) -> None:
    """Continue a prompt with a run folder's latest checkpoint (or one checkpoint folder),
    printing the text as it comes (one sample), or each sample in turn (several); a sample
    ends at the tokenizer's end of text or after --max-new-tokens."""
    settings = _settings(temperature, top_k, top_p, seed, max_new_tokens, unlimited)
    _utf8(prompt, "--prompt")
    tok, sampler = _checkpoint_sampler(run, device, ops_dirs, num_samples, dtype)
    ids = _prompt_ids(tok, prompt, "--prompt")
    stream, show = _printer(tok)
    live = num_samples == 1
    if live:
        click.echo(prompt, nl=False)
    rows = sampler.samples(ids, max_new_tokens, stop=tok.eot, on_step=show if live else None,
                           **settings)
    if live:
        click.echo(stream.flush())
    else:
        for n, row in enumerate(rows, 1):
            click.echo(f"--- sample {n} of {num_samples}")
            click.echo(prompt + tok.decode(row))
    empty = sum(not row for row in rows)
    if empty:
        warn(f"{'the sample is' if live else f'{empty} of the samples are'} empty: the model "
              "drew its end of text first")


@click.command()
@click.argument("run", type=click.Path(path_type=Path))
@_sampling_options
def chat(run, max_new_tokens, unlimited, temperature, top_k, top_p, seed, device, dtype,
         ops_dirs) -> None:
    """Talk with a checkpoint: each line you type joins the conversation and the model
    continues it until its end of text or --max-new-tokens. Ctrl-D or /quit ends."""
    import itertools

    settings = _settings(temperature, top_k, top_p, seed, max_new_tokens, unlimited)
    tok, sampler = _checkpoint_sampler(run, device, ops_dirs, 1, dtype)
    click.echo("eulergen chat: type a line and press Enter, and the model goes on from it; "
               "Ctrl-D or /quit leaves", err=True)
    for turn in itertools.count():
        click.echo("> ", nl=False)
        raw = sys.stdin.buffer.readline() if hasattr(sys.stdin, "buffer") else sys.stdin.readline()
        try:
            line = raw.decode("utf-8") if isinstance(raw, bytes) else _utf8(raw, "stdin")
        except (UnicodeDecodeError, EulerError):
            warn("that line is not UTF-8 text: left out")
            continue
        if not line or line.strip() == "/quit":
            click.echo()
            return
        try:
            ids = _prompt_ids(tok, line if line.endswith("\n") else line + "\n", "stdin")
        except EulerError as err:
            warn(f"{err.message}: that line is left out")
            continue
        stream, show = _printer(tok)
        # the conversation so far stays in the KV cache: each turn appends to it
        sampler.samples(ids, max_new_tokens, stop=tok.eot, on_step=show, append=turn > 0,
                        **{**settings, "seed": seed + turn})
        click.echo(stream.flush())
