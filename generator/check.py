"""`eulergen check`: each op's derived backward against central differences, and a float32
sweep of extreme inputs, run through the op's generated numpy module.

1. float64, random inputs in the op's domain: the backward against central differences of
   the forward (eps 1e-5), passing at max relative error < the spec's tolerance (1e-4 by
   default). Relative error is |a − b| / max(|b|, 1% of the largest |b| of that input), so
   near-zero gradients are compared on the scale of that input's gradients.
2. float32, every input swept over 0, ±1e-30, ±1, ±80, ±1e4: no NaN or Inf in forward or
   backward wherever the float64 result at the same point is finite.
Update ops have no backward: their step is checked against a float64 sequential
evaluation of the spec's formulas instead. Attention ops check ∂score/∂s.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import click
import numpy as np

from eulergen.errors import EulerError, suggest
from eulergen.generator.derive import derive
from eulergen.generator.numeric import compile_exprs
from eulergen.generator.numpy_module import load_module_from_source, render_numpy_module
from eulergen.generator.ops_path import find_ops
from eulergen.generator.spec import OpSpec, load_spec

EPS = 1e-5
EXTREMES = (0.0, 1e-30, -1e-30, 1.0, -1.0, 80.0, -80.0, 1e4, -1e4)


@dataclass(frozen=True)
class Row:
    op: str
    input: str
    error: float | None      # max relative error of the float64 check (None: not run)
    extremes: str            # 'ok' or what went wrong
    ok: bool


def run_check(names=(), ops_dirs=()) -> int:
    ops = find_ops(ops_dirs)
    for name in names:
        if name not in ops:
            raise EulerError(f"unknown op '{name}'{suggest(name, ops)}")
    rows: list[Row] = []
    for name in names or sorted(ops):
        try:
            rows += check_op(load_spec(ops[name]))
        except EulerError as err:
            rows.append(Row(name, "-", None, f"error: {err}", False))
    _print(rows)
    return 0 if all(r.ok for r in rows) else 1


def _print(rows: list[Row]) -> None:
    click.echo(f"{'op':<20} {'input':<8} {'max rel err':>11}  {'float32 extremes':<28} result")
    for r in rows:
        err = "-" if r.error is None else f"{r.error:.2e}"
        click.echo(f"{r.op:<20} {r.input:<8} {err:>11}  {r.extremes:<28} {'ok' if r.ok else 'FAIL'}")
    failed = sum(not r.ok for r in rows)
    click.echo(f"{len(rows) - failed} passed, {failed} failed")


def check_op(spec: OpSpec) -> list[Row]:
    derived = derive(spec)
    if spec.kind == "attention":
        return _check_attention(spec, derived)
    mod = load_module_from_source(spec.name, render_numpy_module(derived))
    if spec.kind == "update":
        return _check_update(spec, mod)
    runtime = {p.name: 0.5 for p in spec.params if p.default is None}
    if runtime:  # params given per call (no default): check at a fixed value
        mod = _Bound(mod, runtime)
    layout = {"pointwise": _PointwiseLayout, "row": _RowLayout, "pair": _PairLayout}[spec.kind](spec)
    rng = np.random.default_rng(0)
    values = layout.random(rng)
    douts = [rng.uniform(-1.0, 1.0, shape) for shape in layout.out_shapes(values)]
    grads = _as_tuple(mod.backward(*values, *douts))
    numeric = layout.central_differences(mod, values, douts)
    floor = layout.roundoff(mod, values, douts)
    problems = _sweep(mod, layout)
    rows = []
    for n, name in enumerate(mod.GRADS):
        err = _rel_err(grads[n], numeric[n], floor)
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


def _rel_err(got: np.ndarray, want: np.ndarray, floor: float = 0.0) -> float:
    """max |got − want| / max(|want|, 1% of max |want|, floor)."""
    if want.size == 0:
        return 0.0
    scale = max(np.max(np.abs(want)) * 1e-2, floor, 1e-12)
    return float(np.max(np.abs(got - want) / np.maximum(np.abs(want), scale)))


def _roundoff_floor(values) -> float:
    """Central differences lose ~1e-16·|f|/eps to rounding: a gradient much smaller than
    that (erf(x) near 1) cannot be checked to 1e-4 relative; 1e-6·|f| is far above it."""
    return 1e-6 * max((float(np.max(np.abs(v))) for v in values if np.size(v)), default=0.0)


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def _loss(mod, values, douts) -> float:
    """Σ d<out>·out: its gradient with respect to the inputs is the backward's output."""
    outs = _as_tuple(mod.forward(*values))
    return float(sum(np.sum(o * d) for o, d in zip(outs, douts)))


# Layouts: how each kind's inputs are shaped, sampled and perturbed --------------------------

class _PointwiseLayout:
    def __init__(self, spec: OpSpec):
        self.spec = spec
        self.inputs = spec.inputs

    def random(self, rng):
        return [rng.uniform(*self.spec.domain_of(i.name), 64) for i in self.inputs]

    def out_shapes(self, values):
        return [values[0].shape] * len(self.spec.outputs)

    def central_differences(self, mod, values, douts):
        # Elementwise: perturbing every element at once gives every partial at once.
        out = []
        for n, _ in enumerate(self.inputs):
            def at(delta):
                shifted = [v + delta if k == n else v for k, v in enumerate(values)]
                return _as_tuple(mod.forward(*shifted))
            plus, minus = at(EPS), at(-EPS)
            out.append(sum(d * (p - m) / (2 * EPS) for p, m, d in zip(plus, minus, douts)))
        return out

    def roundoff(self, mod, values, douts):
        return _roundoff_floor(_as_tuple(mod.forward(*values)))

    def sweep(self):
        """Batches of float inputs covering every combination of extremes (for up to two
        inputs; more inputs get each extreme in turn against the rest held at 1)."""
        k = len(self.inputs)
        if k <= 2:
            combos = np.array(list(itertools.product(EXTREMES, repeat=k))).T
        else:
            combos = np.ones((k, len(EXTREMES) * k))
            for n in range(k):
                combos[n, n * len(EXTREMES):(n + 1) * len(EXTREMES)] = EXTREMES
        return [list(combos)]


class _RowLayout:
    ROWS, N = (2, 3), 7

    def __init__(self, spec: OpSpec):
        self.spec = spec
        self.inputs = spec.inputs

    def random(self, rng):
        out = []
        for i in self.inputs:
            if i.role == "index":
                out.append(rng.integers(0, self.N, self.ROWS))
            else:
                shape = self.ROWS + (self.N,) if i.role == "row" else (self.N,)
                out.append(rng.uniform(*self.spec.domain_of(i.name), shape))
        return out

    def out_shapes(self, values):
        shape = values[0].shape
        return [shape if _per_element(o, self.spec) else shape[:-1] for o in self.spec.outputs]

    def central_differences(self, mod, values, douts):
        out = []
        for n, i in enumerate(self.inputs):
            if i.role == "index":
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

    def roundoff(self, mod, values, douts):
        # the perturbed quantity is the whole Σ d<out>·out
        outs = _as_tuple(mod.forward(*values))
        return _roundoff_floor([sum(float(np.sum(np.abs(o * d))) for o, d in zip(outs, douts))])

    def sweep(self):
        """Rows of one extreme each, and one row holding all of them; weights at each
        extreme in turn; index 0."""
        n = len(EXTREMES)
        rows = np.concatenate([np.repeat(np.array(EXTREMES)[:, None], n, axis=1),
                               np.array(EXTREMES)[None, :]])
        batches = []
        for w in (1.0,) + EXTREMES:
            batch = []
            for i in self.inputs:
                if i.role == "row":
                    batch.append(rows)
                elif i.role == "weight":
                    batch.append(np.full(n, w))
                else:
                    batch.append(np.zeros(rows.shape[0], np.int64))
            batches.append(batch)
        return batches


def _per_element(output, spec: OpSpec) -> bool:
    elem = {i.name for i in spec.inputs if i.role in ("row", "weight")} | {"i"}
    return bool({s.name for s in output.expr.free_symbols} & elem)


class _PairLayout:
    SHAPE = (1, 3, 2, 4)

    def __init__(self, spec: OpSpec):
        self.spec = spec
        self.inputs = spec.inputs

    def random(self, rng):
        return [rng.uniform(*self.spec.domain_of(i.name), self.SHAPE) for i in self.inputs]

    def out_shapes(self, values):
        names = dict.fromkeys(o.name[:-1] for o in self.spec.outputs)
        return [self.SHAPE] * len(names)

    central_differences = _RowLayout.central_differences
    roundoff = _RowLayout.roundoff

    def sweep(self):
        x = np.resize(np.array(EXTREMES), 5 * 2 * 8).reshape(1, 5, 2, 8)
        return [[x for _ in self.inputs]]


# The float32 sweep ------------------------------------------------------------------------

def _sweep(mod, layout) -> dict[str, str]:
    """name → what went wrong ('*': the forward, so every input)."""
    problems: dict[str, str] = {}
    for batch in layout.sweep():
        f64 = [np.asarray(b, np.float64) if b.dtype.kind == "f" else b for b in batch]
        f32 = [np.asarray(b, np.float32) if b.dtype.kind == "f" else b for b in batch]
        with np.errstate(all="ignore"):
            fwd64, fwd32 = (_as_tuple(mod.forward(*v)) for v in (f64, f32))
            douts = [np.ones_like(o) for o in fwd64]
            bwd64 = _as_tuple(mod.backward(*f64, *douts))
            bwd32 = _as_tuple(mod.backward(*f32, *(d.astype(np.float32) for d in douts)))
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


# Update and attention -----------------------------------------------------------------------

def _check_update(spec: OpSpec, mod) -> list[Row]:
    """Three steps of the generated module against the spec's formulas evaluated one by
    one in float64; then the float32 sweep of every state and grad."""
    rng = np.random.default_rng(0)
    names = [i.name for i in spec.inputs]
    params = {p.name: (p.default if p.default is not None else 1e-3) for p in spec.params}
    fixed = {p.name: p.default for p in spec.params if p.default is not None}

    def control(p: dict) -> np.ndarray:
        """The module's control array (CONTROL: not skipped, grads unscaled, then the
        runtime params) for the param values p."""
        return np.array([{"skip": 0.0, "grad_scale": 1.0, **p}[c] for c in mod.CONTROL])
    state = {n: rng.uniform(*spec.domain_of(n), 64) for n in names}
    ref = {n: v.copy() for n, v in state.items()}
    err = 0.0
    for step in (1, 2, 3):
        p = {**params, **({"step": float(step)} if "step" in params else {})}
        mod.step(*(state[n] for n in names), control(p), **fixed)
        for f in spec.update:  # sequential: each formula reads the values updated so far
            fn = compile_exprs([f.expr], names + list(p))
            ref[f.name] = np.broadcast_to(fn(**ref, **p)[0], (64,)).copy()
        err = max(err, max(_rel_err(state[f.name], ref[f.name]) for f in spec.update))

    combos = np.array(list(itertools.product(EXTREMES, repeat=len(names)))).T
    vals64 = dict(zip(names, combos))
    vals32 = {n: v.astype(np.float32) for n, v in vals64.items()}
    p = control({**params, **({"step": 1.0} if "step" in params else {})})
    with np.errstate(all="ignore"):
        mod.step(*(vals64[n] for n in names), p, **fixed)
        mod.step(*(vals32[n] for n in names), p, **fixed)
    problems = None
    for f in spec.update:
        hit = np.isfinite(vals64[f.name]) & ~np.isfinite(vals32[f.name])
        if hit.any():
            at = ", ".join(f"{n}={c:g}" for n, c in zip(names, combos[:, np.argmax(hit)]))
            problems = f"{f.name} non-finite at {at}"
            break
    ok = err < spec.tolerance and problems is None
    return [Row(spec.name, "step", err, problems or "ok", ok)]


def _check_attention(spec: OpSpec, derived) -> list[Row]:
    """∂score/∂s against central differences over s and the index symbols; the score and
    its derivative in float32 at extreme s."""
    body = derived.body
    names = ["s", "i", "j", "h", "n_heads", "scale"] + [p.name for p in spec.params]
    fn = compile_exprs([body.score, body.dscore], names)
    rng = np.random.default_rng(0)
    v = {"s": rng.uniform(-10, 10, 256), "i": rng.integers(0, 64, 256).astype(float),
         "j": rng.integers(0, 64, 256).astype(float), "h": rng.integers(0, 12, 256).astype(float),
         "n_heads": 12.0, "scale": 0.125}
    v.update({p.name: p.default if p.default is not None else 1.0 for p in spec.params})
    score = lambda s: np.broadcast_to(fn(**{**v, "s": s})[0], (256,))  # noqa: E731
    numeric = (score(v["s"] + EPS) - score(v["s"] - EPS)) / (2 * EPS)
    err = _rel_err(np.broadcast_to(fn(**v)[1], (256,)), numeric)
    s = np.array(EXTREMES, np.float32)
    v32 = {k: (np.float32(x) if np.isscalar(x) else x[: len(s)].astype(np.float32))
           for k, x in v.items()}
    with np.errstate(all="ignore"):
        out32 = [np.broadcast_to(o, s.shape) for o in fn(**{**v32, "s": s})]
        out64 = [np.broadcast_to(o, s.shape) for o in fn(**{**v32, "s": s.astype(np.float64)})]
    bad = None
    for o64, o32 in zip(out64, out32):
        hit = np.isfinite(o64) & ~np.isfinite(o32)
        if hit.any():
            bad = f"non-finite at s={s[np.argmax(hit)]:g}"
            break
    return [Row(spec.name, "s", err, bad or "ok", err < spec.tolerance and bad is None)]
