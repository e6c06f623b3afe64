"""benchmarks/torch_gpt.py: the PyTorch model of eulergen's architecture, on the CPU."""
from __future__ import annotations

import dataclasses
import importlib.util
import math

import numpy as np
import pytest

from eulergen import PACKAGE_DIR
from eulergen.errors import EulerError
from eulergen.runtime.train.config import load_config

torch = pytest.importorskip("torch")


def _torch_gpt():
    spec = importlib.util.spec_from_file_location("torch_gpt", PACKAGE_DIR / "benchmarks" / "torch_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tg = _torch_gpt()

TINY = ["model.hidden_dim=48", "model.num_layers=2", "model.num_heads=6", "model.vocab_size=97",
        "model.max_seq_len=16"]


def _tiny(preset):
    overrides = [f"model.preset={preset}", *TINY]
    if preset == "nanoeuler":
        overrides.append("model.num_kv_heads=2")
    return load_config(None, overrides).model


def _expected_shapes(m):
    """Names and shapes as train_common.md lays them out, written out independently."""
    d, hd, F = m.hidden_dim, m.head_dim, m.mlp_hidden
    gated = m.activation in ("swiglu", "geglu")
    norm = {"weight": (d,), **({"bias": (d,)} if m.norm == "layernorm" else {})}
    shapes = {"wte.weight": (-(-m.vocab_size // 64) * 64, d)}   # rows padded to a multiple of 64
    if m.positions == "learned":
        shapes["wpe.weight"] = (m.max_seq_len, d)
    linears = {"attn.c_attn": ((m.num_heads + 2 * m.num_kv_heads) * hd, d),
               "attn.c_proj": (d, m.num_heads * hd),
               "mlp.c_fc": ((2 if gated else 1) * F, d), "mlp.c_proj": (d, F)}
    for layer in range(m.num_layers):
        for ln in ("ln_1", "ln_2"):
            shapes.update({f"h.{layer}.{ln}.{k}": s for k, s in norm.items()})
        for name, shape in linears.items():
            shapes[f"h.{layer}.{name}.weight"] = shape
            if m.bias:
                shapes[f"h.{layer}.{name}.bias"] = (shape[0],)
    shapes.update({f"ln_f.{k}": s for k, s in norm.items()})
    return shapes


@pytest.mark.parametrize("preset", ["gpt2", "nanoeuler"])
def test_parameter_names_and_shapes_are_eulergens(preset):
    m = _tiny(preset)
    model = tg.TorchGPT(m)
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert got == _expected_shapes(m)


@pytest.mark.parametrize("preset", ["gpt2", "nanoeuler"])
def test_loading_round_trips_and_runs(preset):
    m = _tiny(preset)
    rng = np.random.default_rng(0)
    params = {k: (rng.standard_normal(s) * 0.05).astype(np.float32) for k, s in _expected_shapes(m).items()}
    model = tg.TorchGPT(m)
    tg.load_eulergen_params(model, params)
    back = tg.eulergen_params(model)
    assert back.keys() == params.keys()
    for k in params:
        np.testing.assert_array_equal(back[k], params[k])
    idx = torch.from_numpy(rng.integers(0, m.vocab_size, (2, 16)))
    logits, loss = model(idx, idx)
    assert logits.shape == (2, 16, 128), "97 ids, 128 padded rows"
    loss.backward()
    grads = tg.eulergen_grads(model)
    assert grads.keys() == params.keys()
    assert all(np.isfinite(g).all() for g in grads.values())


@pytest.mark.parametrize("preset", ["gpt2", "nanoeuler"])
def test_initial_loss_is_near_uniform(preset):
    m = _tiny(preset)
    torch.manual_seed(0)
    _, loss = tg.TorchGPT(m)(torch.randint(0, m.vocab_size, (4, 16)), torch.randint(0, m.vocab_size, (4, 16)))
    assert abs(loss.item() - math.log(97)) < 0.1, "uniform over the 97 ids: padded rows are out"


def test_loading_rejects_wrong_names_and_shapes():
    m = _tiny("gpt2")
    model = tg.TorchGPT(m)
    params = tg.eulergen_params(model)
    with pytest.raises(EulerError, match=r"missing \['wpe.weight'\]"):
        tg.load_eulergen_params(model, {k: v for k, v in params.items() if k != "wpe.weight"})
    params["ln_f.bias"] = np.zeros(7, np.float32)
    with pytest.raises(EulerError, match=r"ln_f.bias: shape \(7,\), the torch model has \(48,\)"):
        tg.load_eulergen_params(model, params)


def test_rope_matches_the_spec_formula():
    T, H, hd, base = 5, 2, 8, 10000.0
    x = np.random.default_rng(1).standard_normal((1, T, H, hd))
    cos, sin = tg.rope_tables(T, hd, base)
    got = tg.apply_rope(torch.from_numpy(x).float(), cos, sin).numpy()
    want = np.empty_like(x)
    for t in range(T):
        for k in range(hd // 2):
            theta = t * base ** (-2 * k / hd)   # ops/rope.yaml: pos*base**(-2*k/D)
            x0, x1 = x[0, t, :, k], x[0, t, :, k + hd // 2]
            want[0, t, :, k] = x0 * math.cos(theta) - x1 * math.sin(theta)
            want[0, t, :, k + hd // 2] = x0 * math.sin(theta) + x1 * math.cos(theta)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_gqa_equals_attention_with_repeated_kv_heads():
    m = _tiny("nanoeuler")   # 6 query heads, 2 KV heads
    torch.manual_seed(0)
    model = tg.TorchGPT(m)
    attn = model.h[0].attn
    x = torch.randn(2, 16, m.hidden_dim)
    cos, sin = model.rope_cos[:16], model.rope_sin[:16]
    got = attn(x, (cos, sin))
    hd, H, KVH = m.head_dim, m.num_heads, m.num_kv_heads
    q, k, v = attn.c_attn(x).split([H * hd, KVH * hd, KVH * hd], dim=-1)
    q = tg.apply_rope(q.view(2, 16, H, hd), cos, sin).transpose(1, 2)
    k = tg.apply_rope(k.view(2, 16, KVH, hd), cos, sin).transpose(1, 2).repeat_interleave(H // KVH, 1)
    v = v.view(2, 16, KVH, hd).transpose(1, 2).repeat_interleave(H // KVH, 1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    s = s.masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf"))
    o = (s.softmax(-1) @ v).transpose(1, 2).reshape(2, 16, H * hd)
    torch.testing.assert_close(got, attn.c_proj(o), rtol=1e-5, atol=1e-5)


def test_repeated_kv_gives_the_same_model():
    m = _tiny("nanoeuler")
    torch.manual_seed(0)
    grouped = tg.TorchGPT(m)
    repeated = tg.TorchGPT(m, repeat_kv=True)
    tg.load_eulergen_params(repeated, tg.eulergen_params(grouped))
    idx = torch.randint(0, m.vocab_size, (2, 16))
    torch.testing.assert_close(grouped(idx)[0], repeated(idx)[0], rtol=1e-5, atol=1e-5)


def test_unsupported_ops_are_named():
    m = dataclasses.replace(_tiny("gpt2"), activation="mish")
    with pytest.raises(EulerError, match="model.activation: the torch reference has no 'mish'"):
        tg.TorchGPT(m)


@pytest.mark.parametrize("preset", ["gpt2", "nanoeuler"])
def test_matches_eulergen_numpy_model_loss_and_grads(preset):
    """Same weights and batch: the numpy backend of eulergen and this model agree."""
    from eulergen.runtime.engine.backend import get_backend
    from eulergen.runtime.engine.ops import OpLibrary
    model_mod = pytest.importorskip("eulergen.runtime.model.gpt")
    lib = OpLibrary(get_backend("numpy"))
    m = _tiny(preset)
    if not all(name in lib.ops for name in (m.norm, m.activation, m.attention, "cross_entropy")):
        pytest.skip("generated/ does not hold the ops yet (run `eulergen build`)")
    B, T = 2, 16
    gpt = model_mod.build(m, lib, B, T, training=True)
    gpt.init_weights(3)
    rng = np.random.default_rng(4)
    idx, targets = rng.integers(0, m.vocab_size, (2, B, T))
    gpt.load_tokens(idx, targets)
    loss = float(np.asarray(gpt.loss_and_grad()).ravel()[0])
    ref = tg.TorchGPT(m)
    tg.load_eulergen_params(ref, gpt.state_dict())
    _, ref_loss = ref(torch.from_numpy(idx), torch.from_numpy(targets))
    ref_loss.backward()
    # fp32 on both sides through different summation orders: 1e-5 relative on the loss,
    # gradients within 1e-3 of their own scale.
    assert loss == pytest.approx(ref_loss.item(), rel=1e-5)
    for name, want in tg.eulergen_grads(ref).items():
        got = np.asarray(gpt.grads[name])
        err = np.abs(got - want).max() / (np.abs(want).max() + 1e-12)
        assert err < 1e-3, f"{preset} d{name}: {err:.2e}"
