"""An attention op's C (generated/c/<op>.c: the KV cache's decode; <op>.train.c: the
forward over whole sequences, which keeps each row's log-sum-exp, and the backward), as the
numpy module computes them (generator/numpy_attention.py: every visible score, their max,
the weights). The softmax around the score is hand-written, as in the CUDA templates; the
score, its derivative ∂score/∂s and the mask are the spec's, printed as element functions.
The attention kind's (generator/kinds/attention.py).

Operands are [batch, T, heads, head_dim] through their (batch, token, head) strides (q, k
and v are heads of the model's one qkv buffer, dq, dk and dv of its gradient); query head
h reads kv head h / (n_heads / n_kv_heads); lse is [batch, n_heads, T]. A row with no
visible key gives o = 0 and lse = 0; a key that is not visible gets no gradient.
"""
from __future__ import annotations

from eulergen.generator import c_text, ir
from eulergen.signature import CFunction

_SIZES = ("tq", "pos0", "batch", "n_heads", "n_kv_heads", "head_dim")
_TRAIN_SIZES = ("batch", "T", "n_heads", "n_kv_heads", "head_dim")
_ORDER = ["s", "i", "j", "h", "n_heads", "scale"]
_AT = {"s": "s_", "i": "(float)i_", "j": "(float)j_", "h": "(float)h_",
       "n_heads": "(float)n_heads", "scale": "scale_"}


def _strided(names, writes=()) -> tuple[tuple[str, str], ...]:
    return (tuple((n, "float*" if n in writes else "const float*") for n in names)
            + tuple((f"{n}_{s}", "long long") for n in names for s in ("sb", "st", "sh")))


def _elements(op: ir.DerivedOp, derivative: bool) -> tuple[list[str], dict]:
    """The element functions of the score (and ∂score/∂s) and the mask, and the C of their
    calls ('visible' is "1" without a mask)."""
    body: ir.AttentionDerived = op.body
    order = _ORDER + [p.name for p in op.params]
    codes = {"score": body.score, **({"dscore": body.dscore} if derivative else {})}
    text, calls = [], {}
    for name, expr in codes.items():
        code = ir.Code((), (ir.Assign(name, expr),))
        text += c_text.element(op, f"{op.name}_{name}", code, name, order)
        calls[name] = c_text.call(f"{op.name}_{name}", code, name, order, _AT)
    calls["visible"] = "1"
    if body.mask is not None:
        mask = ir.Code((), (ir.Assign("visible", body.mask),))
        text += c_text.element(op, f"{op.name}_visible", mask, "visible", order, "bool")
        calls["visible"] = c_text.call(f"{op.name}_visible", mask, "visible", order, _AT)
    return text, calls


def decode(op: ir.DerivedOp) -> tuple[list[str], CFunction]:
    """New queries at positions pos0 … over a KV cache, as the numpy module's decode."""
    fn = CFunction(f"{op.name}_decode", tuple(
        (n, "float*" if n == "o" else "const float*") for n in ("q", "k", "v", "o"))
        + tuple((n, "int") for n in _SIZES)
        + tuple((f"{n}_{s}", "long long") for n in ("q", "k", "v", "o") for s in ("sb", "st", "sh"))
        + c_text.floats(op), "decode")
    text, calls = _elements(op, derivative=False)
    return text + [
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
        *_scores(calls, "keys_"),
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
        "}", ""], fn


def _scores(calls: dict, keys: str) -> list[str]:
    """One query row's scores over keys 0 … `keys` - 1 (-INFINITY where not visible) and
    their max."""
    return ["        float max_ = -INFINITY;",
            f"        for (int j_ = 0; j_ < {keys}; ++j_) {{",
            f"          if (!{calls['visible']}) {{",
            "            scores_[j_] = -INFINITY;",
            "            continue;",
            "          }",
            "          const float* k_at_ = k + b_ * k_sb + j_ * k_st + kv_ * k_sh;",
            "          float s_ = 0.0f;",
            "          for (int d_ = 0; d_ < head_dim; ++d_) s_ += q_at_[d_] * k_at_[d_];",
            f"          scores_[j_] = {calls['score']};",
            "          max_ = fmaxf(max_, scores_[j_]);",
            "        }"]


def _loops(body: list[str]) -> list[str]:
    return ["  for (int b_ = 0; b_ < batch; ++b_)",
            "    for (int h_ = 0; h_ < n_heads; ++h_)",
            "      for (int i_ = 0; i_ < T; ++i_) {",
            "        const int kv_ = h_ / group_;",
            "        const float* q_at_ = q + b_ * q_sb + i_ * q_st + h_ * q_sh;",
            *body, "      }"]


def train(op: ir.DerivedOp) -> tuple[list[str], tuple[CFunction, CFunction]]:
    """The element functions of the score, ∂score/∂s and the mask, then forward and
    backward."""
    text, calls = _elements(op, derivative=True)
    (fwd, f), (bwd, b) = _forward(op, calls), _backward(op, calls)
    return text + fwd + bwd, (f, b)


def _forward(op: ir.DerivedOp, calls: dict) -> tuple[list[str], CFunction]:
    """o and lse of queries and keys at positions 0 … T - 1: o = Σ_j (p_j / l) v_j with
    p_j = exp(score_j - max) over the visible keys, l = Σ_j p_j, lse = max + log(l)."""
    fn = CFunction(f"{op.name}_forward", _strided(("q", "k", "v", "o"), ("o",))
                   + (("lse", "float*"),) + tuple((n, "int") for n in _TRAIN_SIZES)
                   + c_text.floats(op), "forward")
    return [
        c_text.opening(fn),
        "  const float scale_ = (float)(1.0 / sqrt((double)head_dim));",
        "  const int group_ = n_heads / n_kv_heads;",
        "  float* scores_ = malloc(sizeof(float) * T);",
        *_loops([
            *_scores(calls, "T"),
            "        float* o_at_ = o + b_ * o_sb + i_ * o_st + h_ * o_sh;",
            "        float* lse_at_ = lse + ((long long)b_ * n_heads + h_) * T + i_;",
            "        for (int d_ = 0; d_ < head_dim; ++d_) o_at_[d_] = 0.0f;",
            "        *lse_at_ = 0.0f;",
            "        if (max_ == -INFINITY) continue;   /* no visible key: o = 0, lse = 0 */",
            "        float total_ = 0.0f;",
            "        for (int j_ = 0; j_ < T; ++j_) {",
            "          scores_[j_] = expf(scores_[j_] - max_);   /* 0 where not visible */",
            "          total_ += scores_[j_];",
            "        }",
            "        for (int j_ = 0; j_ < T; ++j_) {",
            "          const float w_ = scores_[j_] / total_;",
            "          const float* v_at_ = v + b_ * v_sb + j_ * v_st + kv_ * v_sh;",
            "          for (int d_ = 0; d_ < head_dim; ++d_) o_at_[d_] += w_ * v_at_[d_];",
            "        }",
            "        *lse_at_ = max_ + logf(total_);"]),
        "  free(scores_);",
        "}", ""], fn


def _backward(op: ir.DerivedOp, calls: dict) -> tuple[list[str], CFunction]:
    """dq, dk, dv (written; dk and dv summed over the query heads of their kv head) from
    `dout`, o's gradient (`do` is C's): P = exp(score - lse), dS = P ∘ (dO·Vᵀ −
    rowsum(dO ∘ O)) ∘ ∂score/∂s, dq = dS·K, dk = dSᵀ·Q, dv = Pᵀ·dO."""
    grads = ("dq", "dk", "dv")
    fn = CFunction(f"{op.name}_backward", _strided(("q", "k", "v", "o"))
                   + (("lse", "const float*"),) + _strided(("dout",)) + _strided(grads, grads)
                   + tuple((n, "int") for n in _TRAIN_SIZES) + c_text.floats(op), "backward")
    zero = [f"        for (int d_ = 0; d_ < head_dim; ++d_) {g}[b_ * {g}_sb + t_ * {g}_st + "
            f"h_ * {g}_sh + d_] = 0.0f;" for g in grads]
    return [
        c_text.opening(fn),
        "  const float scale_ = (float)(1.0 / sqrt((double)head_dim));",
        "  const int group_ = n_heads / n_kv_heads;",
        "  for (int b_ = 0; b_ < batch; ++b_)",
        "    for (int t_ = 0; t_ < T; ++t_) {",
        "      for (int h_ = 0; h_ < n_heads; ++h_) {",
        zero[0], "      }",
        "      for (int h_ = 0; h_ < n_kv_heads; ++h_) {",
        *zero[1:], "      }", "    }",
        *_loops([
            "        const float* o_at_ = o + b_ * o_sb + i_ * o_st + h_ * o_sh;",
            "        const float* dout_at_ = dout + b_ * dout_sb + i_ * dout_st + h_ * dout_sh;",
            "        float* dq_at_ = dq + b_ * dq_sb + i_ * dq_st + h_ * dq_sh;",
            "        const float lse_ = lse[((long long)b_ * n_heads + h_) * T + i_];",
            "        float delta_ = 0.0f;",
            "        for (int d_ = 0; d_ < head_dim; ++d_) delta_ += dout_at_[d_] * o_at_[d_];",
            "        for (int j_ = 0; j_ < T; ++j_) {",
            f"          if (!{calls['visible']}) continue;",
            "          const float* k_at_ = k + b_ * k_sb + j_ * k_st + kv_ * k_sh;",
            "          const float* v_at_ = v + b_ * v_sb + j_ * v_st + kv_ * v_sh;",
            "          float* dk_at_ = dk + b_ * dk_sb + j_ * dk_st + kv_ * dk_sh;",
            "          float* dv_at_ = dv + b_ * dv_sb + j_ * dv_st + kv_ * dv_sh;",
            "          float s_ = 0.0f, dp_ = 0.0f;",
            "          for (int d_ = 0; d_ < head_dim; ++d_) {",
            "            s_ += q_at_[d_] * k_at_[d_];",
            "            dp_ += dout_at_[d_] * v_at_[d_];",
            "          }",
            f"          const float p_ = expf({calls['score']} - lse_);",
            f"          const float ds_ = p_ * (dp_ - delta_) * {calls['dscore']};",
            "          for (int d_ = 0; d_ < head_dim; ++d_) {",
            "            dv_at_[d_] += p_ * dout_at_[d_];",
            "            dq_at_[d_] += ds_ * k_at_[d_];",
            "            dk_at_[d_] += ds_ * q_at_[d_];",
            "          }",
            "        }"]),
        "}", ""], fn
