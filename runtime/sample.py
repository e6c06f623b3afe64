"""Text generation over the KV-cache model (runtime/decoder.py).

    sampler = Sampler(cfg.model, lib, batch=4, seq_len=1024)
    rows = sampler.samples(prompt_ids, 200, temperature=0.8, top_k=40, top_p=0.95, seed=1,
                           on_step=lambda tokens: ...)      # one new token per row

All rows continue the same prompt (`batch` is the number of samples). Each step copies
the last position's logits [batch, vocab_rows] to the host once and draws there: padded
vocab rows are masked first, then temperature (0: greedy), top-k and top-p (nucleus);
one uniform number per row and step from a generator seeded by `seed`, so a seed gives
the same text on numpy and CUDA up to float rounding near a tie.
"""
from __future__ import annotations

import sys
from typing import Callable

import numpy as np

from eulergen.errors import EulerError
from eulergen.runtime.decoder import build_decoder


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


class Sampler:
    """`params`: an existing params arena (the training model's) to sample from without a
    copy; `seq_len`: the context (default model.max_seq_len), which a model with learned
    positions should keep to what it was trained on; `notify`: where one-line notices go."""

    def __init__(self, model_cfg, lib, *, batch: int = 1, seq_len: int | None = None,
                 params=None, dtype: str = "float32", tf32: bool = False,
                 notify: Callable[[str], None] = _stderr):
        if batch < 1:
            raise EulerError(f"num_samples {batch}: want at least 1", key="num_samples")
        self.seq = seq_len or model_cfg.max_seq_len
        self.decoder = build_decoder(model_cfg, lib, batch, self.seq, params=params, dtype=dtype,
                                     tf32=tf32)
        self.batch = batch
        self.vocab = model_cfg.vocab_size
        self.notify = notify
        self._unfed = None   # [batch]: the last step's tokens, drawn but not yet in the cache

    def fit_prompt(self, prompt) -> list[int]:
        """The prompt's ids, cut from the left to the context (saying so)."""
        ids = [int(i) for i in prompt]
        if not ids:
            raise EulerError("the prompt is empty: sampling needs at least one token",
                             key="prompt")
        if len(ids) > self.seq:
            self.notify(f"note: the prompt has {len(ids)} tokens, the context {self.seq}: "
                        f"keeping its last {self.seq}")
            ids = ids[-self.seq:]
        return ids

    def samples(self, prompt, max_new_tokens: int, *, temperature: float = 1.0,
                top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                stop: int | None = None, on_step: Callable[[list[int]], None] | None = None,
                append: bool = False) -> list[list[int]]:
        """Up to `max_new_tokens` new ids per row after `prompt`. A row that draws `stop`
        (the tokenizer's end of text) ends there, without it; generation ends when every
        row has. `on_step(tokens)` sees each step's tokens, one per row, as they come.
        `append`: the prompt continues the conversation the cache holds (a chat's next
        turn: after the previous call's last tokens) instead of starting afresh."""
        check_settings(temperature, top_k, top_p, max_new_tokens)
        ids = np.tile(np.asarray(self.fit_prompt(prompt), dtype=np.int64), (self.batch, 1))
        dec = self.decoder
        if append and self._unfed is not None:
            # the last drawn tokens were never fed: they come first
            logits = dec.append(np.concatenate([self._unfed[:, None], ids], axis=1))
        else:
            logits = dec.prefill(ids)
        rng = np.random.default_rng(seed)
        rows = [[] for _ in range(self.batch)]
        done = np.zeros(self.batch, dtype=bool)
        for step in range(max_new_tokens):
            host = dec.backend.asnumpy(logits)           # the one copy of the step
            tokens = pick(host, self.vocab, rng, temperature, top_k, top_p)
            for row, token in zip(rows, tokens):
                row.append(int(token))
            if on_step is not None:
                on_step([int(t) for t in tokens])
            self._unfed = tokens
            if stop is not None:
                done |= tokens == stop
            if done.all() or step == max_new_tokens - 1:
                break
            logits = dec.decode(tokens)
        if stop is not None:
            rows = [row[:row.index(stop)] if stop in row else row for row in rows]
        return rows

    def generate(self, prompt, max_new_tokens: int, **settings) -> list[int]:
        """The first row of `samples`: what a one-sample caller (the trainer) wants."""
        return self.samples(prompt, max_new_tokens, **settings)[0]


def check_settings(temperature, top_k, top_p, max_new_tokens) -> None:
    """EulerError for a setting `samples` cannot use (a CLI checks before loading a model)."""
    if temperature < 0:
        raise EulerError(f"temperature {temperature}: want ≥ 0 (0 is greedy)", key="temperature")
    if top_k is not None and top_k < 1:
        raise EulerError(f"top_k {top_k}: want ≥ 1 (or none)", key="top_k")
    if top_p is not None and not 0 < top_p <= 1:
        raise EulerError(f"top_p {top_p}: want 0 < top_p ≤ 1", key="top_p")
    if max_new_tokens < 1:
        raise EulerError(f"max_new_tokens {max_new_tokens}: want ≥ 1", key="max_new_tokens")


def pick(logits: np.ndarray, vocab: int, rng, temperature: float, top_k: int | None,
         top_p: float | None) -> np.ndarray:
    """One token per row of host logits [B, vocab_rows]: ids ≥ vocab (padding) never;
    greedy at temperature 0; else from softmax(logits / temperature) restricted to the
    top_k most likely and then to the smallest set whose probability reaches top_p.

    Per step, so only the top_k survivors are scaled, exponentiated and sorted (dividing
    by the temperature keeps the order: the cut and the max are taken on the logits). The
    sums still run over whole rows, zeros included, as numpy's pairwise sum groups them,
    so every probability has the bits the whole-vocab computation gives."""
    x = logits[:, :vocab]
    if temperature == 0:
        return np.argmax(x, axis=1)
    kth = (np.partition(x, -top_k, axis=1)[:, -top_k] if top_k is not None and top_k < vocab
           else None)
    peak = x.max(axis=1).astype(np.float64) / temperature
    u = rng.random(len(x))
    row = np.zeros(vocab)
    tokens = np.empty(len(x), dtype=np.int64)
    for r in range(len(x)):
        kept = np.arange(vocab) if kth is None else np.flatnonzero(~(x[r] < kth[r]))
        p = np.exp(x[r, kept].astype(np.float64) / temperature - peak[r])
        p /= _row_sum(row, kept, p)
        if top_p is not None and top_p < 1:
            order = np.argsort(-p, kind="stable")
            sorted_p = p[order]
            # keep a token while the mass before it is short of top_p: the first always stays
            keep = np.empty(len(p), dtype=bool)
            keep[order] = np.cumsum(sorted_p) - sorted_p < top_p
            p = np.where(keep, p, 0.0)
            p /= _row_sum(row, kept, p)
        cdf = np.cumsum(p)
        j = int((cdf <= u[r] * cdf[-1]).sum())
        tokens[r] = kept[j] if j < len(kept) else vocab - 1
    return tokens


def _row_sum(row: np.ndarray, kept: np.ndarray, p: np.ndarray) -> float:
    """p.sum() as a whole row of zeros with p at `kept` sums (`row`: zeros, left so)."""
    row[kept] = p
    total = row.sum()
    row[kept] = 0.0
    return total


class TextStream:
    """Token ids to printable text as they arrive: a token that ends inside a multi-byte
    UTF-8 character decodes to U+FFFD, so it is held until the character completes (or
    a few tokens later, when it really is invalid). Pending ids are decoded together,
    so byte-level tokenizers and BPEs over bytes print every character whole."""

    HOLD = 4   # tokens: a UTF-8 character has at most 4 bytes

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.pending: list[int] = []

    def push(self, token: int) -> str:
        self.pending.append(int(token))
        text = self.decode(self.pending)
        if text.endswith("\ufffd") and len(self.pending) < self.HOLD:
            return ""
        self.pending = []
        return text

    def flush(self) -> str:
        text = self.decode(self.pending) if self.pending else ""
        self.pending = []
        return text
