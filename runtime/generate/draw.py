"""Drawing the next token from the last position's logits, on the device and in numpy.

    u = uniforms(seed, step, rows)                       # one number per row and step
    tokens = pick(logits, vocab, u, temperature, top_k, top_p)    # the numpy reference
    Draw(backend, logits, vocab, next_ids, drawn, live)  # a tape node: the same on the GPU

The rule, the same on both (ids ≥ vocab, the padded rows, never take part):
- temperature 0: the most likely id (the lowest of equal ones);
- else weights w = rint(exp((x - max) / temperature) · 2^32) as integers (float64 exp),
  zero below the top_k-th largest logit (ties kept), then zero wherever the weight of
  the strictly larger logits already reaches top_p of the total (the nucleus: the first
  id always stays, equal logits stay together);
- the id is the first whose running sum of w (in id order) passes floor(u · Σw).
Integer weights make the sums exact in any order, so the kernel's block reductions give
the numpy sums' bits and a seed gives the same draws run after run. What is not bitwise:
the device's exp against numpy's (either may be off by an ulp, which moves a weight by
one unit in 2^32 rarely), so the two paths pick different ids only when u falls on such a
boundary; greedy picks agree exactly given the same logits.

u is a counter-based hash of (seed, step, row) (splitmix64, 53 bits), computed the same
way in both, so no generator state lives on the device and a captured step draws anew at
each replay from its `step` argument alone (runtime/engine/cuda_graph.py patches it). The
kernel, hand-written, is templates/draw.cu.j2 (a block a row), launched through
runtime/engine/kinds/support.py; tests/test_draw_emulated.py compiles it with g++ against
`pick`.
"""
from __future__ import annotations

import numpy as np

from eulergen.runtime.engine.kinds import support

MASK = (1 << 64) - 1
_GOLDEN, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _mix(z: int) -> int:
    z = (z + _GOLDEN) & MASK
    z = ((z ^ (z >> 30)) * _M1) & MASK
    z = ((z ^ (z >> 27)) * _M2) & MASK
    return z ^ (z >> 31)


def uniforms(seed: int, step: int, rows: int) -> np.ndarray:
    """[rows] float64 in [0, 1): the draw of each row at `step` for `seed`."""
    base = _mix(_mix(seed & MASK) ^ (step & MASK))
    return np.array([(_mix(base ^ r) >> 11) * 2.0 ** -53 for r in range(rows)])


def pick(logits: np.ndarray, vocab: int, u: np.ndarray, temperature: float,
         top_k: int | None, top_p: float | None) -> np.ndarray:
    """One id per row of host logits [B, ≥ vocab] by the module's rule (u: uniforms)."""
    x = logits[:, :vocab]
    if temperature == 0:
        return np.argmax(x, axis=1)
    tokens = np.empty(len(x), dtype=np.int64)
    for r, v in enumerate(x):
        d = (v.astype(np.float64) - np.float64(v.max())) / np.float64(np.float32(temperature))
        w = np.rint(np.exp(d) * 2.0 ** 32)
        if top_k and top_k < vocab:
            w[v < np.partition(v, -top_k)[-top_k]] = 0
        if top_p is not None and top_p < 1:
            live = np.flatnonzero(w)
            values, group = np.unique(v[live], return_inverse=True)
            mass = np.bincount(group, weights=w[live], minlength=len(values))
            above = mass[::-1].cumsum()[::-1] - mass      # the weight of strictly larger logits
            limit = np.float64(np.float32(top_p)) * w.sum()
            w[live[above[group] >= limit]] = 0
        cdf = np.cumsum(w.astype(np.uint64))
        target = np.floor(u[r] * np.float64(cdf[-1]))
        tokens[r] = np.searchsorted(cdf, np.uint64(target), side="right")
    return tokens


class Draw:
    """The draw as a tape node, after the head: logits [B, vocab_rows] (float32 on the
    GPU) -> next_ids [B] (the next step's input) and drawn[:, live['column']], with the
    settings and the step read from `live` when it runs (a captured one: at each replay)."""

    def __init__(self, backend, logits, vocab: int, next_ids, drawn, live: dict):
        self.backend, self.logits, self.vocab = backend, logits, vocab
        self.next_ids, self.drawn, self.live = next_ids.reshape(-1), drawn, live

    def forward(self, tape) -> None:
        live = self.live
        if not self.backend.is_gpu:
            u = uniforms(live["seed"], live["step"], len(self.next_ids))
            tokens = pick(self.logits, self.vocab, u, live["temperature"], live["top_k"],
                          live["top_p"])
            self.next_ids[...] = tokens
            self.drawn[:, live["column"]] = tokens
            return
        support.launch("draw", "pick", "f32", {
            "logits": self.logits, "row_stride": self.logits.shape[1], "vocab": self.vocab,
            "temperature": live["temperature"], "top_k": live["top_k"] or 0,
            "top_p": live["top_p"] or 1.0, "seed": live["seed"] & MASK, "step": live["step"],
            "next_ids": self.next_ids, "drawn": self.drawn,
            "drawn_stride": self.drawn.shape[1], "column": live["column"]},
            len(self.next_ids))
