"""What `eulergen check` does to an op's generated numpy module, whatever its kind: the
backward against central differences of the forward, and a float32 sweep of extreme inputs.
Each kind (generator/kinds/) gives the layout of its inputs: how they are shaped, sampled,
perturbed and swept (`Layout`).

1. float64, random inputs in the op's domain: the backward against central differences of
   the forward (eps 1e-5), passing at max relative error < the spec's tolerance (1e-4 by
   default). Relative error is |a − b| / max(|b|, 1% of the largest |b| of that input), so
   near-zero gradients are compared on the scale of that input's gradients.
2. float32, every input swept over 0, ±1e-30, ±1, ±80, ±1e4: no NaN or Inf in forward or
   backward wherever the float64 result at the same point is finite.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from eulergen.generator.opspec import OpSpec

EPS = 1e-5
EXTREMES = (0.0, 1e-30, -1e-30, 1.0, -1.0, 80.0, -80.0, 1e4, -1e4)


@dataclass(frozen=True)
class Row:
    op: str
    input: str
    error: float | None      # max relative error of the float64 check (None: not run)
    extremes: str            # 'ok' or what went wrong
    ok: bool


class Layout(Protocol):
    """How one kind's inputs are shaped, sampled, perturbed and swept."""

    def random(self, rng) -> list: ...

    def out_shapes(self, values) -> list: ...

    def central_differences(self, mod, values, douts) -> list: ...

    def roundoff(self, mod, values, douts) -> float: ...

    def sweep(self) -> list[list]: ...


def check_gradients(spec: OpSpec, mod, layout: Layout) -> list[Row]:
    """A row per gradient of the module: the float64 check and the float32 sweep."""
    runtime = {p.name: 0.5 for p in spec.params if p.default is None}
    if runtime:  # params given per call (no default): check at a fixed value
        mod = _Bound(mod, runtime)
    rng = np.random.default_rng(0)
    values = layout.random(rng)
    douts = [rng.uniform(-1.0, 1.0, shape) for shape in layout.out_shapes(values)]
    grads = as_tuple(mod.backward(*values, *douts))
    numeric = layout.central_differences(mod, values, douts)
    floor = layout.roundoff(mod, values, douts)
    problems = _sweep(mod, layout)
    rows = []
    for n, name in enumerate(mod.GRADS):
        err = rel_err(grads[n], numeric[n], floor)
        bad = problems.get(name) or problems.get("*")
        ok = err < spec.tolerance and bad is None
        rows.append(Row(spec.name, name, err, bad or "ok", ok))
    return rows


class _Bound:
    """A generated module with its runtime params fixed."""

    def __init__(self, mod, params: dict):
        self.GRADS = mod.GRADS
        self.forward = functools.partial(mod.forward, **params)
        self.backward = functools.partial(mod.backward, **params)


def rel_err(got: np.ndarray, want: np.ndarray, floor: float = 0.0) -> float:
    """max |got − want| / max(|want|, 1% of max |want|, floor)."""
    if want.size == 0:
        return 0.0
    scale = max(np.max(np.abs(want)) * 1e-2, floor, 1e-12)
    return float(np.max(np.abs(got - want) / np.maximum(np.abs(want), scale)))


def roundoff_floor(values) -> float:
    """Central differences lose ~1e-16·|f|/eps to rounding: a gradient much smaller than
    that (erf(x) near 1) cannot be checked to 1e-4 relative; 1e-6·|f| is far above it."""
    return 1e-6 * max((float(np.max(np.abs(v))) for v in values if np.size(v)), default=0.0)


def as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def _loss(mod, values, douts) -> float:
    """Σ d<out>·out: its gradient with respect to the inputs is the backward's output."""
    outs = as_tuple(mod.forward(*values))
    return float(sum(np.sum(o * d) for o, d in zip(outs, douts)))


def each_element(mod, values, douts, differentiable) -> list:
    """Central differences of Σ d<out>·out, one element of one input at a time, for the
    inputs where `differentiable[n]`."""
    out = []
    for n, wanted in enumerate(differentiable):
        if not wanted:
            continue
        grad = np.zeros_like(values[n])
        for idx in np.ndindex(values[n].shape):
            def at(delta):
                v = values[n].copy()
                v[idx] += delta
                return _loss(mod, [v if k == n else w for k, w in enumerate(values)], douts)
            grad[idx] = (at(EPS) - at(-EPS)) / (2 * EPS)
        out.append(grad)
    return out


def loss_roundoff(mod, values, douts) -> float:
    """The rounding floor where the perturbed quantity is the whole Σ d<out>·out."""
    outs = as_tuple(mod.forward(*values))
    return roundoff_floor([sum(float(np.sum(np.abs(o * d))) for o, d in zip(outs, douts))])


def _sweep(mod, layout: Layout) -> dict[str, str]:
    """name → what went wrong ('*': the forward, so every input)."""
    problems: dict[str, str] = {}
    for batch in layout.sweep():
        f64 = [np.asarray(b, np.float64) if b.dtype.kind == "f" else b for b in batch]
        f32 = [np.asarray(b, np.float32) if b.dtype.kind == "f" else b for b in batch]
        with np.errstate(all="ignore"):
            fwd64, fwd32 = (as_tuple(mod.forward(*v)) for v in (f64, f32))
            douts = [np.ones_like(o) for o in fwd64]
            bwd64 = as_tuple(mod.backward(*f64, *douts))
            bwd32 = as_tuple(mod.backward(*f32, *(d.astype(np.float32) for d in douts)))
        for o64, o32 in zip(fwd64, fwd32):
            where = _first_bad(o64, o32, f64)
            if where and "*" not in problems:
                problems["*"] = f"forward non-finite at {where}"
        for name, g64, g32 in zip(mod.GRADS, bwd64, bwd32):
            where = _first_bad(g64, g32, f64)
            if where and name not in problems:
                problems[name] = f"non-finite at {where}"
    return problems


def _first_bad(ref: np.ndarray, got: np.ndarray, inputs) -> str | None:
    bad = np.isfinite(ref) & ~np.isfinite(got)
    if not bad.any():
        return None
    idx = np.unravel_index(np.argmax(bad), bad.shape)
    vals = []
    for v in inputs:
        if v.shape == bad.shape:
            vals.append(f"{v[idx]:g}")
    return "(" + ", ".join(vals) + ")" if vals else "an extreme input"
