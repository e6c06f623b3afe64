"""Text generation through the model's own forward pass (no KV cache: each new token
recomputes the window, which at the sizes `eulergen train` samples is cheap).

The sampler is a forward-only model (batch 1, no gradients, no optimizer state) that
can share the weights arena of a training model, so sampling at the end of a run
copies nothing.
"""
from __future__ import annotations

import numpy as np

from eulergen.errors import EulerError
from eulergen.runtime.model import build


class Sampler:
    def __init__(self, model_cfg, lib, *, params=None, seq_len: int | None = None):
        self.seq = seq_len or model_cfg.max_seq_len
        shared = {"params": params} if params is not None else None
        self.model = build(model_cfg, lib, 1, self.seq, training=False, shared=shared)
        self.vocab = model_cfg.vocab_size

    def next_logits(self, ids) -> np.ndarray:
        """Host logits [vocab] after the last of `ids` (the last seq_len of them)."""
        window = np.asarray(ids[-self.seq:], dtype=np.int64)
        idx = np.zeros((1, self.seq), dtype=np.int64)
        idx[0, :window.size] = window   # positions after the window cannot reach it (causal)
        self.model.load_tokens(idx)
        logits = self.model.logits()[0, window.size - 1]
        return self.model.backend.asnumpy(logits).astype(np.float64)

    def generate(self, prompt, n: int, *, temperature: float = 1.0, top_k: int | None = None,
                 seed: int = 0, on_token=None) -> list[int]:
        """`n` new token ids after `prompt`: greedy at temperature 0, else sampled from the
        top_k most likely (all when None), reproducibly for a seed."""
        if len(prompt) == 0:
            raise EulerError("the prompt is empty: sampling needs at least one token", key="prompt")
        if temperature < 0 or (top_k is not None and top_k < 1):
            raise EulerError(f"temperature {temperature} and top_k {top_k}: want temperature "
                             ">= 0 and top_k >= 1", key="sample")
        rng = np.random.default_rng(seed)
        ids, new = [int(i) for i in prompt], []
        for _ in range(n):
            logits = self.next_logits(ids)
            if temperature == 0:
                token = int(np.argmax(logits))
            else:
                logits = logits / temperature
                if top_k is not None and top_k < logits.size:
                    cut = np.partition(logits, -top_k)[-top_k]
                    logits = np.where(logits < cut, -np.inf, logits)
                p = np.exp(logits - logits.max())
                token = int(rng.choice(logits.size, p=p / p.sum()))
            ids.append(token)
            new.append(token)
            if on_token is not None:
                on_token(token)
        return new
