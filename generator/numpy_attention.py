"""Attention ops → a readable numpy module: materialised attention, the reference that the
flash kernels are tested against and the CPU backend's attention.

The module prints the same score, ∂score/∂s and mask expressions as the CUDA, over whole
[B, H, Tq, Tk] arrays; forward and decode (queries at positions pos0 …, keys from a KV
cache) share one function of the query and key positions. Conventions shared with the kernels: a row with no visible key gives
o = 0 and lse = 0 (finite); elements that are not visible get no gradient.
"""
from __future__ import annotations

import sympy as sp

from eulergen.generator import ir
from eulergen.generator.emit import numpy_header
from eulergen.generator.numpy_text import LAYOUT
from eulergen.generator.printer import numpy_expr, numpy_helpers, numpy_imports
from eulergen.generator.plan_attention import check_symbols

_TEMPLATE = '''\
{header}
"""{name}: materialised attention (numpy reference of the flash kernels).

score(s, i, j, h) = {score}; visible where {mask}.
q, o [B, T, H, D]; k, v [B, T, KVH, D]; lse [B, H, T]; query head h uses kv head h // (H // KVH).
A row with no visible key gives o = 0 and lse = 0. decode: the same rows against a KV cache.
"""
{imports}

KIND = "attention"
INPUTS = ("q", "k", "v")
OUTPUTS = ("o", "lse")
PARAMS = {params_dict}
GRADS = ("q", "k", "v")

{helpers}
def _score(s, i, j, h, n_heads, scale{param_args}):
    return {score_np}


def _dscore(s, i, j, h, n_heads, scale{param_args}):
    """∂score/∂s."""
    return {dscore_np}


def _visible(i, j, h, n_heads{param_args}):
    return {mask_np}


{layout}

def _results(values, out):
    """The values, each into its array of `out` or a new one (numpy_text.LAYOUT's _fresh)."""
    return tuple(_fresh(v, v.shape, v.dtype, out, n) for n, v in enumerate(values))


def _hm(x):
    """[B, T, H, D] → [B, H, T, D]: head-major, so products are batched matmuls (BLAS)."""
    return x.transpose(0, 2, 1, 3)


def _scores(q, k, i, j{param_kw}):
    """s = q·k per (batch, head, query, key) for queries at positions i and keys at positions
    j, the score, what is visible, and k repeated per query head."""
    H, D = q.shape[2:]
    kr = np.repeat(k, H // k.shape[2], axis=2)
    s = _hm(q) @ _hm(kr).swapaxes(-1, -2)
    i = i.astype(q.dtype)[:, None]
    j = j.astype(q.dtype)[None, :]
    h = np.arange(H, dtype=q.dtype)[:, None, None]
    args = (i, j, h, float(H), float(D) ** -0.5{param_names})
    visible = np.broadcast_to(_visible(i, j, h, float(H){param_names}), s.shape)
    return s, _score(s, *args), _dscore(s, *args), visible, kr


def _attend(q, k, v, i, j{param_kw}):
    """(o, lse) of queries at positions i over keys at positions j."""
    _, x, _, visible, _ = _scores(q, k, i, j{param_names})
    x = np.where(visible, x, -np.inf)
    m = x.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.where(visible, np.exp(x - m), 0.0)
    l = p.sum(axis=-1, keepdims=True)
    some = l > 0
    l_safe = np.where(some, l, 1.0)
    vr = np.repeat(v, q.shape[2] // v.shape[2], axis=2)
    o = _hm((p / l_safe) @ _hm(vr))
    lse = np.where(some, m + np.log(l_safe), 0.0)[..., 0]
    return o.astype(q.dtype), lse.astype(q.dtype)


def forward(q, k, v{param_kw}, *, _out=None):
    """-> (o [B, T, H, D], lse [B, H, T])."""
    positions = np.arange(q.shape[1])
    return _results(_attend(q, k, v, positions, positions{param_names}), _out)


def decode(q, k_cache, v_cache, pos0{param_kw}):
    """-> o [B, Tq, H, D] for queries q [B, Tq, H, D] at positions pos0 … pos0+Tq-1 over a
    cache [B, Tmax, KVH, D] whose rows 0 … pos0+Tq-1 hold the keys and values (later rows
    are never read): rows pos0 … pos0+Tq-1 of forward over the whole sequence."""
    n = pos0 + q.shape[1]
    o, _ = _attend(q, k_cache[:, :n], v_cache[:, :n], np.arange(pos0, n), np.arange(n){param_names})
    return o


def _per_kv_head(g, kvh):
    """Sum a [B, T, H, D] gradient over the query heads that share each kv head."""
    B, T, H, D = g.shape
    return g.reshape(B, T, kvh, H // kvh, D).sum(axis=3)


def backward(q, k, v, o, lse, do{param_kw}, *, _out=None):
    """-> (dq, dk, dv): P = exp(score - lse), dS = P ∘ (dO·Vᵀ − rowsum(dO ∘ O)) ∘ ∂score/∂s."""
    positions = np.arange(q.shape[1])
    _, x, dx, visible, kr = _scores(q, k, positions, positions{param_names})
    p = np.where(visible, np.exp(np.where(visible, x, 0.0) - lse[..., None]), 0.0)
    vr = np.repeat(v, q.shape[2] // v.shape[2], axis=2)
    dv = _hm(p.swapaxes(-1, -2) @ _hm(do))
    dp = _hm(do) @ _hm(vr).swapaxes(-1, -2)
    delta = _hm(do * o).sum(axis=-1)[..., None]
    ds = np.where(visible, p * (dp - delta) * dx, 0.0)
    dq = _hm(ds @ _hm(kr))
    dk = _hm(ds.swapaxes(-1, -2) @ _hm(q))
    kvh = k.shape[2]
    return _results((dq.astype(q.dtype), _per_kv_head(dk, kvh).astype(q.dtype),
                     _per_kv_head(dv, kvh).astype(q.dtype)), _out)
'''


def render_attention_module(derived: ir.DerivedOp) -> str:
    """The numpy module text for one attention op (see docs/internals.md for its API)."""
    check_symbols(derived)
    body: ir.AttentionDerived = derived.body
    names = [p.name for p in derived.params]
    score_np = numpy_expr(body.score)
    dscore_np = numpy_expr(body.dscore)
    mask = body.mask if body.mask is not None else sp.true
    mask_np = numpy_expr(mask)
    lines = [score_np, dscore_np, mask_np]
    helpers = "\n".join(numpy_helpers(lines))
    return _TEMPLATE.format(
        header=numpy_header(derived), name=derived.name, layout="\n\n".join(LAYOUT),
        score=body.score, mask=mask,
        imports="\n".join(numpy_imports(lines)),
        params_dict="{" + ", ".join(f"{p.name!r}: {p.default!r}" for p in derived.params) + "}",
        helpers=helpers + ("\n\n" if helpers else ""),
        score_np=score_np, dscore_np=dscore_np, mask_np=mask_np,
        param_args="".join(f", {n}" for n in names),
        param_kw="".join(f", {n}={p.default!r}" for n, p in zip(names, derived.params)),
        param_names="".join(f", {n}" for n in names))
