"""What `eulergen eval`, `sample`, `chat` and `export` read, the evaluation itself, and the
sampler over what they read.

A model comes from a run folder (its latest checkpoint), one checkpoint folder, or a
transformers save_pretrained folder or Hub id (runtime/interop/hf.py), as a config and weights.
`evaluate` is the mean cross-entropy over every whole window of a dataset: the files in
order, windows of T + 1 tokens at stride T (each token a target once), B windows a
batch, the last partial batch left out; its exp is the perplexity.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eulergen import outputs
from eulergen.errors import EulerError
from eulergen.progress import Bar, hidden
from eulergen.runtime.train import budget, checkpoint
from eulergen.runtime.interop import hf
from eulergen.runtime.train.config import RunConfig, config_from_dict
from eulergen.runtime.data.loader import open_tokens, resolve_files
from eulergen.runtime.data.prepared import check_prepared_with
from eulergen.runtime.data.tokenizer import Tokenizer, check_fits, digest_of, load_tokenizer
from eulergen.runtime.generate.decoder import decode_sms, plan_decoder
from eulergen.runtime.generate.sample import Sampler
from eulergen.runtime.model.arch import arch_of
from eulergen.runtime.model.gpt import build
from eulergen.runtime.model.plan import plan_on
from eulergen.userfiles import Fields

HF_CONTEXT = 1024   # an imported model's default context: Llama configs allow 128k positions


@dataclass(frozen=True)
class Weights:
    cfg: RunConfig
    params: dict        # eulergen names -> host arrays, every value finite
    file: str           # where they came from, for errors
    tokenizer_digest: str | None = None   # the tokenizer the run trained with, as it recorded


def is_hf_folder(path: Path) -> bool:
    """A save_pretrained folder: a config.json, and none of a run's marks (its marker, a
    checkpoint; a run folder's config.json is eulergen's own)."""
    return os.path.lexists(path / hf.CONFIG) and not outputs.marked(path, "run") \
        and checkpoint.latest(path) is None


def open_model(spec: str | Path, device: str | None = None, bar: Bar | None = None) -> Weights:
    """The config and weights of a run, a checkpoint, an HF folder (with a tokenizer
    eulergen reads: hf.tokenizer_of) or a Hub id. Weights that hold a NaN or an Inf are
    refused here, naming the tensor: nothing eulergen exports, samples or evaluates comes
    of them. `bar` (started by the caller) counts the tensors read and checked."""
    bar = bar or hidden()
    path = Path(spec)
    if path.exists() and not is_hf_folder(path):
        return checkpoint_weights(checkpoint.load(path, require=("config",)), device, bar)
    imported = hf.load_folder(hf.locate(spec, key="RUN_OR_CKPT"), bar)
    raw = {"model": imported.model, "data": {"tokenizer": hf.tokenizer_of(imported)},
           "training": {"seq_len": min(imported.model["max_seq_len"], HF_CONTEXT),
                        **({"device": device} if device else {})}}
    config = str(imported.folder / hf.CONFIG)
    return _finite(Weights(config_from_dict(raw, source=config), imported.params, config), bar)


def checkpoint_weights(ck: checkpoint.Checkpoint, device: str | None = None,
                       bar: Bar | None = None) -> Weights:
    """open_model of a checkpoint read already (export-c --train reads one once, for its
    optimizer state too)."""
    recorded = Fields(ck.state, str(ck.path / checkpoint.STATE_FILE))
    raw = dict(recorded.fields("config").data)
    if device and isinstance(raw.get("training", {}), dict):   # else config_from_dict says
        raw["training"] = {**raw.get("training", {}), "device": device}
    cfg = config_from_dict(raw, source=str(ck.path / checkpoint.STATE_FILE))
    return _finite(Weights(cfg, ck.params, str(ck.path / checkpoint.MODEL_FILE),
                           recorded.text("tokenizer_digest", None)), bar or hidden())


def _finite(weights: Weights, bar: Bar) -> Weights:
    """`weights`, refused where a tensor holds a NaN or an Inf."""
    bar.update(total=(bar.total or 0) + len(weights.params), status="checking for NaN and Inf")
    for name, value in weights.params.items():
        bar.update(advance=1)
        bad = value.size - int(np.count_nonzero(np.isfinite(value)))
        if bad:
            raise EulerError(f"{bad:,} of its {value.size:,} values are NaN or Inf: eulergen "
                             "exports, samples and evaluates finite weights only",
                             file=weights.file, key=name)
    return weights


def tokenizer_of(weights: Weights) -> Tokenizer:
    """The tokenizer the weights were trained with: the config's, which must still be the
    one the run recorded (a tokenizer.json changed since would encode into other ids), and
    fit the model's vocabulary."""
    tok = load_tokenizer(weights.cfg.data)
    _check_recorded(weights, tok.digest)
    check_fits(tok, weights.cfg.model.vocab_size)
    return tok


def _check_recorded(weights: Weights, digest: str) -> None:
    if weights.tokenizer_digest not in (None, digest):
        raise EulerError(f"{weights.cfg.data.tokenizer} is not the tokenizer these weights "
                         f"were trained with (digest {digest[:19]}…, the run recorded "
                         f"{weights.tokenizer_digest[:19]}…)", file=weights.file,
                         key="data.tokenizer")


def load_into(model, weights: Weights) -> None:
    """model.load_state_dict, with a misfit named by the weights' file."""
    try:
        model.load_state_dict(weights.params)
    except EulerError as err:
        raise EulerError(err.message, file=weights.file, key=err.key) from None


def open_sampler(weights: Weights, lib, *, batch: int, dtype: str, notify) -> Sampler:
    """A KV-cache Sampler of `batch` rows (--num-samples) over `weights`, in the context
    they were trained on (learned positions past training.seq_len never moved). A batch
    the cache cannot hold is refused before the cache is planned in full or allocated;
    weights that do not fit the config's model (another architecture, an unpadded vocab)
    are one error naming the weights file and the tensor."""
    cfg = weights.cfg
    seq = cfg.training.seq_len
    arch = arch_of(cfg.model, lib)
    budget.check_batch(cfg, arch, lib.backend,
                       lambda a: plan_decoder(a, batch, seq, dtype=dtype,
                                              sms=decode_sms(lib.backend)),
                       what="sampling", batch=("--num-samples", batch, 1), seq=seq)
    sampler = Sampler(arch, lib, batch=batch, seq_len=seq, dtype=dtype, notify=notify)
    load_into(sampler.decoder, weights)
    return sampler


@dataclass(frozen=True)
class EvalResult:
    loss: float          # mean cross-entropy per token, nats
    tokens: int          # targets evaluated
    windows: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)


def windows(files, seq: int, vocab: int):
    """Every [T + 1] window of the token files in order, each id checked against the
    vocab."""
    for file in files:
        tokens = open_tokens(file)
        for start in range(0, len(tokens) - seq, seq):
            row = np.asarray(tokens[start:start + seq + 1], dtype=np.int32)
            if int(row.max()) >= vocab:
                raise EulerError(f"token id {int(row.max())} is outside the model's vocabulary "
                                 f"of {vocab} (data made with another tokenizer?)", file=str(file))
            yield row


def evaluate(weights: Weights, lib, dataset: str, *, batch: int, seq: int,
             max_batches: int | None = None, cache_dir=None, bar: Bar | None = None) -> EvalResult:
    """The loss over `dataset`, whose token files must be the weights' tokenizer's, with
    B = `batch` windows of `seq` tokens priced against the memory first (--batch-size).
    `bar` (started by the caller) counts the batches, with the mean loss so far."""
    cfg = weights.cfg
    if seq > cfg.model.max_seq_len:
        raise EulerError(f"{seq} is longer than the model's max_seq_len "
                         f"{cfg.model.max_seq_len}", key="--seq-len")
    files = resolve_files(dataset, cache_dir, split="val")
    digest = digest_of(cfg.data.tokenizer)
    _check_recorded(weights, digest)
    check_prepared_with(files, cfg.data.tokenizer, digest, key="--data")
    budget.check_batch(cfg, arch_of(cfg.model, lib), lib.backend,
                       lambda a: plan_on(lib, a, batch, seq, training=False), what="evaluation",
                       batch=("--batch-size", batch, 1), seq=seq)
    batches = sum(max(0, len(open_tokens(f)) - 1) // seq for f in files) // batch
    bar = bar or hidden()
    bar.update(0, total=min(batches, max_batches or batches), status="building the model")
    model = build(cfg.model, lib, batch, seq, training=False)
    load_into(model, weights)
    total, count, rows = 0.0, 0, []
    for row in windows(files, seq, cfg.model.vocab_size):
        rows.append(row)
        if len(rows) < batch:
            continue
        chunk = np.stack(rows)
        rows = []
        model.load_tokens(chunk[:, :-1], chunk[:, 1:])
        total += float(model.loss()[0])     # a batch's mean over B·T tokens
        count += 1
        bar.update(count, status=f"loss {total / count:.4f}")
        if max_batches is not None and count >= max_batches:
            break
    if not count:
        raise EulerError(f"fewer tokens than one batch of {batch} windows of {seq + 1}",
                         file=dataset, key="--data")
    return EvalResult(total / count, count * batch * seq, count * batch)
