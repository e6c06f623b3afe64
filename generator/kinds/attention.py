"""Attention ops: causal flash attention with a `score` expression of s = q·k (scale,
softcap, ALiBi…) and a `mask` predicate over (i, j, h). The derivation is ∂score/∂s; the
flash kernels, forward, backward and decode, are planned by generator/plan_attention.py and
printed by render_attention.py (templates/attention*.j2), the materialised numpy reference
by numpy_attention.py. The online softmax around the score is hand-written in the templates
(the README says so)."""
from __future__ import annotations

import numpy as np

from eulergen.generator import c_text, formula, ir
from eulergen.generator.differentiate import diff
from eulergen.generator.gradcheck import EPS, EXTREMES, Row, rel_err
from eulergen.generator.kinds.base import OpKind
from eulergen.generator.numeric import compile_exprs
from eulergen.generator.numpy_attention import render_attention_module
from eulergen.generator.opspec import Formula, symbol
from eulergen.generator.plan_attention import (H, I, J, N_HEADS, S, SCALE, check_symbols,
                                              plan_attention)
from eulergen.generator.render_attention import render_attention
from eulergen.signature import CFunction


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
        body: ir.AttentionDerived = op.body
        params = [p.name for p in op.params]
        operands = ("q", "k", "v", "o")
        fn = CFunction(f"{op.name}_decode", tuple(
            (n, "float*" if n == "o" else "const float*") for n in operands)
            + tuple((n, "int") for n in ("tq", "pos0", "batch", "n_heads", "n_kv_heads",
                                         "head_dim"))
            + tuple((f"{n}_{s}", "long long") for n in operands for s in ("sb", "st", "sh"))
            + c_text.floats(op), "decode")
        order = ["s", "i", "j", "h", "n_heads", "scale", *params]
        at = {"s": "s_", "i": "(float)i_", "j": "(float)j_", "h": "(float)h_",
              "n_heads": "(float)n_heads", "scale": "scale_"}
        score = ir.Code((), (ir.Assign("score", body.score),))
        text = c_text.element(op, f"{op.name}_score", score, "score", order)
        visible = "1"
        if body.mask is not None:
            mask = ir.Code((), (ir.Assign("visible", body.mask),))
            text += c_text.element(op, f"{op.name}_visible", mask, "visible", order, "bool")
            visible = c_text.call(f"{op.name}_visible", mask, "visible", order, at)
        text += [
            c_text.opening(fn),
            "  const float scale_ = (float)(1.0 / sqrt((double)head_dim));",
            "  const int keys_ = pos0 + tq, group_ = n_heads / n_kv_heads;",
            "  float* scores_ = malloc(sizeof(float) * keys_);",
            "  for (int b_ = 0; b_ < batch; ++b_)",
            "    for (int t_ = 0; t_ < tq; ++t_)",
            "      for (int h_ = 0; h_ < n_heads; ++h_) {",
            "        const int i_ = pos0 + t_, kv_ = h_ / group_;",
            "        const float* q_at_ = q + b_ * q_sb + t_ * q_st + h_ * q_sh;",
            "        float* o_at_ = o + b_ * o_sb + t_ * o_st + h_ * o_sh;",
            "        float max_ = -INFINITY;",
            "        for (int j_ = 0; j_ < keys_; ++j_) {",
            f"          if (!{visible}) {{",
            "            scores_[j_] = -INFINITY;",
            "            continue;",
            "          }",
            "          const float* k_at_ = k + b_ * k_sb + j_ * k_st + kv_ * k_sh;",
            "          float s_ = 0.0f;",
            "          for (int d_ = 0; d_ < head_dim; ++d_) s_ += q_at_[d_] * k_at_[d_];",
            f"          scores_[j_] = "
            f"{c_text.call(f'{op.name}_score', score, 'score', order, at)};",
            "          max_ = fmaxf(max_, scores_[j_]);",
            "        }",
            "        for (int d_ = 0; d_ < head_dim; ++d_) o_at_[d_] = 0.0f;",
            "        if (max_ == -INFINITY) continue;   /* no visible key: o = 0 */",
            "        float total_ = 0.0f;",
            "        for (int j_ = 0; j_ < keys_; ++j_) {",
            "          if (scores_[j_] == -INFINITY) continue;",
            "          const float p_ = expf(scores_[j_] - max_);",
            "          const float* v_at_ = v + b_ * v_sb + j_ * v_st + kv_ * v_sh;",
            "          total_ += p_;",
            "          for (int d_ = 0; d_ < head_dim; ++d_) o_at_[d_] += p_ * v_at_[d_];",
            "        }",
            "        for (int d_ = 0; d_ < head_dim; ++d_) o_at_[d_] /= total_;",
            "      }",
            "  free(scores_);",
            "}", ""]
        about = (f"{op.name}: softmax attention of queries q [batch, tq, n_heads, head_dim] at "
                 "positions pos0 … over the keys and values of cache rows 0 … pos0 + tq - 1 "
                 "(query head h reads kv head h / (n_heads / n_kv_heads)); a row with no "
                 "visible key gives o = 0. The softmax around the score is hand-written, as "
                 "in the CUDA templates; the score and the mask are the spec's.")
        return ir.RenderedC(c_text.source(header, about, text, ("stdlib.h",)), (fn,))


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
