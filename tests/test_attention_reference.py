"""The generated numpy attention module against PyTorch (float64, CPU): forward, lse and
the three gradients, for the shipped specs, GQA, and rows that see no key."""
from __future__ import annotations

import types

import numpy as np
import pytest

from eulergen.generator.numpy_attention import render_attention_module

import attention_ops

torch = pytest.importorskip("torch")


def _module(name: str, tmp_path) -> types.ModuleType:
    text = render_attention_module(attention_ops.load(name, tmp_path))
    mod = types.ModuleType(name)
    exec(compile(text, f"{name}.py", "exec"), mod.__dict__)
    return mod


def _inputs(B=2, T=37, H=4, KVH=2, D=16, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, H, D))
    k = rng.standard_normal((B, T, KVH, D))
    v = rng.standard_normal((B, T, KVH, D))
    do = rng.standard_normal((B, T, H, D))
    return q, k, v, do


def _torch_attention(q, k, v, score_fn, mask_fn):
    """Materialised attention in torch over [B, T, H, D] tensors; GQA by repeating kv heads."""
    B, T, H, D = q.shape
    group = H // k.shape[2]
    kr = k.repeat_interleave(group, dim=2)
    vr = v.repeat_interleave(group, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, kr)
    i = torch.arange(T, dtype=q.dtype)[:, None]
    j = torch.arange(T, dtype=q.dtype)[None, :]
    h = torch.arange(H, dtype=q.dtype)[:, None, None]
    x = score_fn(s, i, j, h, float(H), D ** -0.5)
    visible = mask_fn(i, j).expand_as(x)
    x = x.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(x, dim=-1)
    p = torch.exp(x - lse[..., None]).nan_to_num(0.0)
    o = torch.einsum("bhij,bjhd->bihd", p, vr)
    return o, lse


SCORES = {
    "causal_attention": lambda s, i, j, h, H, scale: s * scale,
    "softcap_attention": lambda s, i, j, h, H, scale: 50.0 * torch.tanh(s * scale / 50.0),
    "alibi_attention": lambda s, i, j, h, H, scale: s * scale + 2.0 ** (-8 * (h + 1) / H) * (j - i),
}


@pytest.mark.parametrize("name", sorted(SCORES))
def test_numpy_attention_matches_torch_autograd_float64(name, tmp_path):
    mod = _module(name, tmp_path)
    q, k, v, do = _inputs()
    o, lse = mod.forward(q, k, v)
    dq, dk, dv = mod.backward(q, k, v, o, lse, do)

    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    to, tlse = _torch_attention(tq, tk, tv, SCORES[name], lambda i, j: j <= i)
    to.backward(torch.tensor(do))
    # float64 on both sides, the same math in a different order: agreement to ~1e-12.
    for label, ours, ref in (("o", o, to), ("lse", lse, tlse), ("dq", dq, tq.grad),
                             ("dk", dk, tk.grad), ("dv", dv, tv.grad)):
        err = np.max(np.abs(ours - ref.detach().numpy()))
        assert err < 1e-10, f"{name} {label}: max abs error {err:.2e}"


def test_numpy_causal_attention_matches_sdpa_with_gqa(tmp_path):
    mod = _module("causal_attention", tmp_path)
    q, k, v, _ = _inputs(B=1, T=50, H=6, KVH=2, D=8, seed=1)
    o, _ = mod.forward(q, k, v)
    t = [torch.tensor(a).transpose(1, 2) for a in (q, k, v)]  # SDPA wants [B, H, T, D]
    ref = torch.nn.functional.scaled_dot_product_attention(*t, is_causal=True, enable_gqa=True)
    err = np.max(np.abs(o - ref.transpose(1, 2).numpy()))
    assert err < 1e-10, f"causal vs SDPA: {err:.2e}"


def test_rows_with_no_visible_key_give_zero_output_and_gradient(tmp_path):
    mod = _module("strict_attention", tmp_path)  # mask j < i: row 0 sees nothing
    q, k, v, do = _inputs(T=9)
    with np.errstate(all="raise"):  # no NaN, no inf, no 0/0 on the way
        o, lse = mod.forward(q, k, v)
        dq, dk, dv = mod.backward(q, k, v, o, lse, do)
    assert np.all(o[:, 0] == 0) and np.all(lse[:, :, 0] == 0)
    assert np.all(dq[:, 0] == 0)
    assert np.all(np.isfinite(dk)) and np.all(np.isfinite(dv))
    # Row 1 sees only key 0: its output is v[key 0] exactly.
    group = q.shape[2] // k.shape[2]
    np.testing.assert_allclose(o[:, 1], np.repeat(v[:, 0], group, axis=1), atol=1e-12)


def test_unmasked_attention_sees_every_key(tmp_path):
    mod = _module("full_attention", tmp_path)
    q, k, v, _ = _inputs(B=1, T=20, H=2, KVH=2, D=8)
    o, _ = mod.forward(q, k, v)
    t = [torch.tensor(a).transpose(1, 2) for a in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*t)
    assert np.max(np.abs(o - ref.transpose(1, 2).numpy())) < 1e-10


def test_numpy_attention_keeps_float32(tmp_path):
    mod = _module("alibi_attention", tmp_path)
    q, k, v, do = (a.astype(np.float32) for a in _inputs(T=16))
    o, lse = mod.forward(q, k, v)
    grads = mod.backward(q, k, v, o, lse, do)
    assert o.dtype == lse.dtype == np.float32
    assert all(g.dtype == np.float32 for g in grads)
