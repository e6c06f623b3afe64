"""Text generation over the KV-cache model (runtime/generate/decoder.py).

    sampler = Sampler(arch, lib, batch=4, seq_len=1024)     # bf16 on a bf16 GPU
    rows = sampler.samples(prompt_ids, 200, temperature=0.8, top_k=40, top_p=0.95, seed=1,
                           on_step=lambda tokens: ...)      # one new token per row

All rows continue the same prompt (`batch` is the number of samples, one batch). The
draw runs after the head of every decoder run (runtime/generate/draw.py: on the device on a GPU,
numpy on the CPU, one rule): the prompt's run draws the first token, and each step after
feeds the drawn ids straight back on the device (Decoder.step: a CUDA graph replay) and
draws the next into `drawn`. The host reads `drawn` every DRAWN steps, or at every step
when `on_step` streams the text: that read is the only sync. A seed gives the same text
(the draws are a hash of seed, step and row).
"""
from __future__ import annotations

import math
import sys
from typing import Callable

import numpy as np

from eulergen.errors import EulerError
from eulergen.runtime.engine.bf16 import plan_dtype
from eulergen.runtime.generate.decoder import DRAWN, build_decoder
from eulergen.runtime.generate.draw import MASK, Draw


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def sampling_dtype(choice: str, backend) -> str:
    """The decoder's plan dtype for `--dtype` auto | bf16 | fp32: auto is bf16 on a GPU with
    bf16 tensor cores (compute capability 8.0 or newer), else fp32."""
    if choice == "bf16" and plan_dtype("auto", backend) != "bf16":   # refused as --dtype
        raise EulerError(f"bf16 sampling needs a CUDA GPU of compute capability 8.0 or newer, "
                         f"not {backend.device}; use --dtype fp32", key="--dtype")
    return plan_dtype(choice, backend)


class Sampler:
    """A decoder of an Arch (runtime/model/arch.py arch_of) with the draw as its tail.
    `params`: an existing params arena (the training model's, in `dtype`) to sample from
    without a copy; `seq_len`: the context (default the Arch's max_seq), which a model with
    learned positions should keep to what it was trained on; `dtype`: the decoder's plan
    dtype (default: sampling_dtype's auto); `graphs`: CUDA graphs (default: on a GPU);
    `notify`: where one-line notices go."""

    def __init__(self, arch, lib, *, batch: int = 1, seq_len: int | None = None,
                 params=None, dtype: str | None = None, tf32: bool = False,
                 graphs: bool | None = None, notify: Callable[[str], None] = _stderr):
        if batch < 1:
            raise EulerError(f"num_samples {batch}: want at least 1", key="num_samples")
        self.seq = seq_len or arch.max_seq
        self.dtype = dtype or sampling_dtype("auto", lib.backend)
        self.decoder = dec = build_decoder(arch, lib, batch, self.seq, params=params,
                                           dtype=self.dtype, tf32=tf32, graphs=graphs,
                                           notify=notify)
        self.batch = batch
        self.notify = notify
        self.drawn = dec.mem["drawn"]
        dec.live.update(temperature=1.0, top_k=0, top_p=1.0, seed=0, step=0, column=0)
        dec.tail = Draw(lib.backend, dec.logits, dec.arch.vocab, dec.next_ids, self.drawn,
                        dec.live)
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
        dec.live.update(temperature=float(temperature), top_k=int(top_k or 0),
                        top_p=float(1.0 if top_p is None else top_p), seed=int(seed) & MASK,
                        step=0, column=0)
        if append and self._unfed is not None:
            # the last drawn tokens were never fed: they come first
            dec.append(np.concatenate([self._unfed[:, None], ids], axis=1))
        else:
            if ids.shape[1] + max_new_tokens > self.seq:
                self.notify(f"note: {ids.shape[1]} prompt tokens and {max_new_tokens} new ones "
                            f"pass the context of {self.seq}: once it is full, generation "
                            f"goes on from the last {self.seq // 2} tokens")
            dec.prefill(ids)
        rows = [[] for _ in range(self.batch)]
        done = np.zeros(self.batch, dtype=bool)
        read = 0                      # steps whose tokens the host has
        for step in range(max_new_tokens):
            last = step == max_new_tokens - 1
            if on_step is not None or last or (step + 1) % DRAWN == 0:
                drawn = dec.backend.asnumpy(self.drawn)       # the sync of the step
                for s in range(read, step + 1):
                    tokens = drawn[:, s % DRAWN].astype(np.int64)
                    for row, token in zip(rows, tokens):
                        row.append(int(token))
                    if on_step is not None:
                        on_step([int(t) for t in tokens])
                    if stop is not None:
                        done |= tokens == stop
                read, self._unfed = step + 1, tokens
                if done.all() or last:
                    break
            dec.live.update(step=step + 1, column=(step + 1) % DRAWN)
            dec.step()
        if stop is not None:
            rows = [row[:row.index(stop)] if stop in row else row for row in rows]
        return rows

    def generate(self, prompt, max_new_tokens: int, **settings) -> list[int]:
        """The first row of `samples`: what a one-sample caller (the trainer) wants."""
        return self.samples(prompt, max_new_tokens, **settings)[0]


# what `eulergen sample` and `chat` generate at most a turn unless told --unlimited: minutes
# of decoding on a CPU, a run that looks hung past it
MAX_NEW_TOKENS = 100_000


def check_settings(temperature, top_k, top_p, max_new_tokens) -> None:
    """EulerError for a setting `samples` cannot use (a CLI checks before loading a model)."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise EulerError(f"temperature {temperature}: want a finite number ≥ 0 (0 is greedy)",
                         key="temperature")
    if top_k is not None and top_k < 1:
        raise EulerError(f"top_k {top_k}: want ≥ 1 (or none)", key="top_k")
    if top_p is not None and not 0 < top_p <= 1:
        raise EulerError(f"top_p {top_p}: want 0 < top_p ≤ 1", key="top_p")
    if max_new_tokens < 1:
        raise EulerError(f"max_new_tokens {max_new_tokens}: want ≥ 1", key="max_new_tokens")


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
