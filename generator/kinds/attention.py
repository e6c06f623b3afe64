"""Attention ops: causal flash attention with a `score` expression of s = q·k (scale,
softcap, ALiBi…) and a `mask` predicate over (i, j, h). The derivation is ∂score/∂s; the
flash kernels, forward, backward and decode, are planned by generator/plan_attention.py and
printed by render_attention.py (templates/attention*.j2), the materialised numpy reference
by numpy_attention.py. The online softmax around the score is hand-written in the templates
(the README says so)."""
from __future__ import annotations

import numpy as np

from eulergen.generator import c_attention, c_text, formula, ir
from eulergen.generator.differentiate import diff
from eulergen.generator.gradcheck import EPS, EXTREMES, Row, rel_err
from eulergen.generator.kinds.base import OpKind
from eulergen.generator.numeric import compile_exprs
from eulergen.generator.numpy_attention import render_attention_module
from eulergen.generator.opspec import Formula, symbol
from eulergen.generator.plan_attention import (H, I, J, N_HEADS, S, SCALE, check_symbols,
                                              plan_attention)
from eulergen.generator.render_attention import render_attention


class Attention(OpKind):
    name = "attention"
    template = "attention.cu.j2"
    templates = "attention*.j2"
    keys = frozenset({"score", "mask", "kink"})
    required = ("score",)
    symbols = tuple(s.name for s in (S, I, J, H, N_HEADS, SCALE))

    def read_formulas(self, doc, data, names, fields):
        score = Formula("score", formula.parse(data["score"], names.table, doc.where("score")),
                        doc.where("score"))
        if data.get("mask") is None:
            return {"score": score}
        mask = Formula("mask", formula.parse(data["mask"], names.table, doc.where("mask"),
                                             condition=True), doc.where("mask"))
        free = {s.name for s in mask.expr.free_symbols} - {"i", "j", "h"}
        if free:
            raise doc.error(f"a mask may use only i, j and h, not {', '.join(sorted(free))}",
                            "mask")
        return {"score": score, "mask": mask}

    def derive(self, spec, temps):
        dscore = diff(spec.score.expr, symbol("s"), spec, spec.score.where)
        body = ir.AttentionDerived(score=spec.score.expr, dscore=dscore,
                                   mask=spec.mask.expr if spec.mask else None)
        inputs = (ir.Operand("q", "q"), ir.Operand("k", "k"), ir.Operand("v", "v"))
        return body, inputs, (ir.Operand("o", "o"),)

    def check(self, spec, derived, mod):
        return _check(spec, derived, self.symbols)

    def manifest_outputs(self, op):
        # Its forward also returns the row log-sum-exp that the backward reads
        # (internals.md: forward(q, k, v) -> (o, lse)).
        return op.outputs + (ir.Operand("lse", "lse", differentiable=False),)

    def plan(self, op):
        return plan_attention(op)

    def render(self, op, plan, header):
        return render_attention(op, plan)   # prints its own header line

    def numpy_source(self, op):
        return render_attention_module(op)

    def c_source(self, op, header):
        """decode: new queries at positions pos0 … over a KV cache, as the numpy module's
        decode computes it (every visible score, their max, then the weights)."""
        check_symbols(op)
        text, fn = c_attention.decode(op)
        about = (f"{op.name}: softmax attention of queries q [batch, tq, n_heads, head_dim] at "
                 "positions pos0 … over the keys and values of cache rows 0 … pos0 + tq - 1 "
                 "(query head h reads kv head h / (n_heads / n_kv_heads)); a row with no "
                 "visible key gives o = 0. The softmax around the score is hand-written, as "
                 "in the CUDA templates; the score and the mask are the spec's.")
        return ir.RenderedC(c_text.source(header, about, text, ("stdlib.h",)), (fn,))

    def c_train_source(self, op, header):
        """forward (o and each row's lse) over whole sequences, and backward, as the numpy
        module computes them."""
        check_symbols(op)
        text, fns = c_attention.train(op)
        about = (f"{op.name}: softmax attention over whole sequences, q, o [batch, T, n_heads, "
                 "head_dim], k, v [batch, T, n_kv_heads, head_dim] by their strides, lse "
                 "[batch, n_heads, T], and its backward (a key that is not visible gets no "
                 "gradient). The softmax around the score is hand-written, as in the CUDA "
                 "templates; the score, its derivative and the mask are the spec's.")
        return ir.RenderedC(c_text.source(header, about, text, ("stdlib.h",)), fns)


KIND = Attention()


def _check(spec, derived: ir.DerivedOp, symbols: tuple[str, ...]) -> list[Row]:
    """∂score/∂s against central differences over s and the index symbols; the score and
    its derivative in float32 at extreme s."""
    body = derived.body
    names = list(symbols) + [p.name for p in spec.params]
    fn = compile_exprs([body.score, body.dscore], names)
    rng = np.random.default_rng(0)
    v = {"s": rng.uniform(-10, 10, 256), "i": rng.integers(0, 64, 256).astype(float),
         "j": rng.integers(0, 64, 256).astype(float), "h": rng.integers(0, 12, 256).astype(float),
         "n_heads": 12.0, "scale": 0.125}
    v.update({p.name: p.default if p.default is not None else 1.0 for p in spec.params})
    score = lambda s: np.broadcast_to(fn(**{**v, "s": s})[0], (256,))  # noqa: E731
    numeric = (score(v["s"] + EPS) - score(v["s"] - EPS)) / (2 * EPS)
    err = rel_err(np.broadcast_to(fn(**v)[1], (256,)), numeric)
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
