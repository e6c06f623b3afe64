"""The numpy model: gradients of the whole graph against float64 central differences,
gradient accumulation, parameter layout and the memory plan."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from eulergen import PACKAGE_DIR
from eulergen.errors import EulerError
from eulergen.runtime.model.arch import arch_of
from eulergen.runtime.engine.backend import NUMPY
from eulergen.runtime.train.config import load_config
from eulergen.runtime.engine.gemm import numpy_gemm
from eulergen.runtime.model.gpt import build
from eulergen.runtime.model.optimizer_plan import plan_optimizer, update_ops
from eulergen.runtime.model.plan import plan_model
from eulergen.runtime.engine.ops import OpLibrary
from eulergen.runtime.model.params import param_count, parameters

# The two presets' structure at a size where central differences over every parameter
# tensor take a second: GPT-2 (layernorm, gelu, learned positions, biases) and nanoeuler
# (rmsnorm, swiglu, rope, grouped-query attention, no biases).
TINY = ["model.hidden_dim=8", "model.num_layers=2", "model.vocab_size=11",
        "model.max_seq_len=6", "model.mlp_hidden=12", "training.seq_len=5"]
STRUCTURES = {
    "gpt2": ["model.preset=gpt2", "model.num_heads=2", "model.num_kv_heads=2", *TINY],
    "nanoeuler": ["model.preset=nanoeuler", "model.num_heads=4", "model.num_kv_heads=2", *TINY],
}
# a gated MLP with biases: the activation adds each half of c_fc's bias (its `bias` fusion)
WITH_GATED_BIAS = {**STRUCTURES, "nanoeuler+bias": [*STRUCTURES["nanoeuler"], "model.bias=true"]}


@pytest.fixture(scope="module")
def lib():
    return OpLibrary(NUMPY)


def _model(lib, structure, batch=2, seq=5, seed=0):
    cfg = load_config(None, WITH_GATED_BIAS[structure]).model
    model = build(cfg, lib, batch, seq, dtype="float64")
    model.init_weights(seed)
    # move norm weights and biases off 1 and 0, so their gradients are exercised in general
    rng = np.random.default_rng(seed + 1)
    for name, p in model.params.items():
        p += rng.normal(0, 0.3 if p.ndim == 1 else 0.05, p.shape)
    return model


def _tokens(batch, seq, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 11, (batch, seq))
    x[0, 1] = x[0, 3] = x[-1, 0]   # repeated ids: the embedding scatter must sum them
    return x, rng.integers(0, 11, (batch, seq))


@pytest.mark.parametrize("structure", sorted(STRUCTURES))
def test_every_gradient_matches_central_differences(lib, structure):
    model = _model(lib, structure)
    model.load_tokens(*_tokens(2, 5))
    model.loss_and_grad()
    grads = {k: g.copy() for k, g in model.grads.items()}
    rng = np.random.default_rng(3)
    eps = 1e-5
    for name, p in model.params.items():
        flat = p.reshape(-1)
        picks = rng.choice(flat.size, size=min(flat.size, 8), replace=False)
        for i in picks:
            keep = flat[i]
            flat[i] = keep + eps
            up = float(model.loss()[0])
            flat[i] = keep - eps
            down = float(model.loss()[0])
            flat[i] = keep
            numeric = (up - down) / (2 * eps)
            analytic = grads[name].reshape(-1)[i]
            # float64 central differences: truncation ~eps², rounding ~1e-16/eps
            assert abs(analytic - numeric) <= 1e-7 + 1e-5 * abs(numeric), \
                f"{structure} {name}[{i}]: tape {analytic:.10g}, central differences {numeric:.10g}"


@pytest.mark.parametrize("structure", sorted(WITH_GATED_BIAS))
def test_accumulating_two_half_batches_gives_the_full_batch_gradient(lib, structure):
    x, y = _tokens(2, 5)
    full = _model(lib, structure, batch=2)
    full.load_tokens(x, y)
    full.loss_and_grad()
    half = _model(lib, structure, batch=1)
    half.set_accumulation(2)
    for row in range(2):
        half.load_tokens(x[row:row + 1], y[row:row + 1])
        half.loss_and_grad(accumulate=row > 0)
    for name in full.grads:
        np.testing.assert_allclose(half.grads[name], full.grads[name], rtol=1e-10, atol=1e-13,
                                   err_msg=name)


@pytest.mark.parametrize("structure", sorted(WITH_GATED_BIAS))
def test_loss_and_gradients_match_the_torch_reference_model(lib, structure):
    torch = pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("torch_gpt", PACKAGE_DIR / "benchmarks" / "torch_gpt.py")
    tg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tg)
    model = _model(lib, structure)
    x, y = _tokens(2, 5)
    model.load_tokens(x, y)
    loss = float(model.loss_and_grad()[0])
    ref = tg.TorchGPT(load_config(None, WITH_GATED_BIAS[structure]).model).double()
    tg.load_eulergen_params(ref, model.state_dict())
    _, ref_loss = ref(torch.as_tensor(x), torch.as_tensor(y))
    ref_loss.backward()
    # the reference computes its cross-entropy and rope tables in float32: 1e-7 relative
    assert loss == pytest.approx(ref_loss.item(), rel=1e-6)
    for name, p in ref.named_parameters():
        want = p.grad.numpy()
        err = np.abs(model.grads[name] - want).max() / np.abs(want).max()
        assert err < 1e-5, f"{structure} {name}: {err:.2e} off the torch gradient"


def test_gpt2_preset_has_gpt2_small_parameter_count(lib):
    arch = arch_of(load_config(None, ["model.preset=gpt2"]).model, lib)
    # GPT-2 124M (124,439,808 with its 50257-token vocab) plus 47 padded rows of 768
    assert param_count(arch) == 124_439_808 + 47 * 768


@pytest.mark.parametrize("vocab,rows", [(50257, 50304), (256, 256), (11, 64), (65, 128)])
def test_the_embedding_rows_are_the_vocab_padded_to_64(lib, vocab, rows):
    arch = arch_of(load_config(None, [f"model.vocab_size={vocab}"]).model, lib)
    assert arch.vocab == vocab
    assert dict((s.name, s.shape) for s in parameters(arch))["wte.weight"] == (rows, arch.d)


def test_decayed_matrices_come_first_and_contiguous(lib):
    arch = arch_of(load_config(None, ["model.preset=nanoeuler", "training.seq_len=64"]).model, lib)
    plan = plan_model(arch, 2, 64)
    specs = parameters(arch)
    decayed = [s for s in specs if s.decay]
    lo, hi = plan.span([s.name for s in decayed])
    assert lo == 0
    assert all(plan.buffer(s.name).offset >= hi for s in specs if not s.decay)
    assert {s.name for s in decayed} == {s.name for s in specs if len(s.shape) == 2}


def test_every_plan_lays_the_params_out_as_the_arch_did(lib):
    # the optimizer's ranges and data parallel's buckets read arch.param_layout, the
    # kernels the plan's buffers: a weight they disagree on would be stepped in the wrong place
    arch = arch_of(load_config(None, ["model.preset=nanoeuler", "model.bias=true"]).model, lib)
    layout = arch.param_layout
    for plan in (plan_model(arch, 2, 16), plan_model(arch, 2, 16, dtype="bf16")):
        assert [(s.name, offset) for s, offset in layout.entries] == \
            [(b.name, b.offset) for b in plan.buffers if b.arena == "params"]
        assert plan.arena("params").size == layout.total


def test_plan_holds_params_grads_and_both_adam_moments(lib):
    arch = arch_of(load_config(None, []).model, lib)
    plan = plan_model(arch, 4, 32, optimizer=plan_optimizer(arch, update_ops(lib, "adamw")))
    sizes = {a.name: a.size for a in plan.arenas}
    assert sizes["params"] == sizes["grads"] == plan.buffer("adamw.m").size == \
        plan.buffer("adamw.v").size
    assert sizes["optimizer"] == 2 * sizes["params"]
    inference = plan_model(arch, 4, 32, training=False)
    assert {a.name for a in inference.arenas} == {"params", "activations", "workspace", "tokens"}
    assert inference.total_bytes < plan.total_bytes


def test_same_seed_gives_the_same_weights_and_another_seed_does_not(lib):
    a, b, c = (_model(lib, "gpt2", seed=s) for s in (5, 5, 6))
    assert all(np.array_equal(a.params[k], b.params[k]) for k in a.params)
    assert not np.array_equal(a.params["wte.weight"], c.params["wte.weight"])


def test_gpt2_init_scales_residual_projections(lib):
    cfg = load_config(None, ["model.num_layers=8", "model.hidden_dim=256"]).model
    model = build(cfg, lib, 1, 8, training=False)
    model.init_weights(0)
    assert abs(model.params["h.0.attn.c_attn.weight"].std() - 0.02) < 1e-3
    assert abs(model.params["h.0.mlp.c_proj.weight"].std() - 0.02 / 4) < 3e-4
    assert np.all(model.params["h.0.ln_1.weight"] == 1) and np.all(model.params["h.0.ln_1.bias"] == 0)


def test_unknown_activation_op_is_one_error_naming_the_key(lib):
    cfg = load_config(None, ["model.activation=gelux"]).model
    with pytest.raises(EulerError) as err:
        arch_of(cfg, lib)
    assert "model.activation" in str(err.value) and "gelu" in str(err.value)
    assert "\n" not in str(err.value)


def test_a_norm_slot_refuses_a_pointwise_op(lib):
    cfg = load_config(None, ["model.norm=gelu"]).model
    with pytest.raises(EulerError, match="model.norm"):
        arch_of(cfg, lib)


def test_a_token_id_outside_the_vocab_is_one_error(lib):
    model = _model(lib, "gpt2")
    with pytest.raises(EulerError, match="token id 11 is outside .* vocabulary of 11"):
        model.load_tokens(np.full((2, 5), 11), np.zeros((2, 5), int))


def test_linear_through_bias_epilogues_gives_the_same_gradients_over_micro_steps(lib):
    """A tape whose GEMM takes the bias epilogues (cuBLASLt's, here numpy_gemm, their
    reference): the forward adds each bias in its GEMM, the first micro-step's wgrad GEMMs
    write db, the later ones add 1ᵀ·dy beside them, since the epilogue only writes."""
    x, y = _tokens(2, 5)
    plain, fused = _model(lib, "gpt2", batch=1), _model(lib, "gpt2", batch=1)
    calls = []

    def recording(a, b, out, **kw):
        calls.append((a.shape, b.shape, kw))
        numpy_gemm(a, b, out, **kw)
    fused.tape.gemm, fused.tape.epilogues = recording, True
    for model in (plain, fused):
        model.set_accumulation(2)
        for row in range(2):
            calls.clear()
            model.load_tokens(x[row:row + 1], y[row:row + 1])
            loss = model.loss_and_grad(accumulate=row > 0)[0]
            if model is fused:
                # c_attn, c_proj, mlp c_proj; c_fc's bias is the activation's: no epilogue
                biases = 3 * fused.arch.layers
                assert sum("bias" in kw for *_, kw in calls) == biases
                assert sum("dbias" in kw for *_, kw in calls) == (0 if row else biases)
                assert sum(a == (1, 5) for a, _, _ in calls) == (biases if row else 0)  # 1ᵀ·dy
    assert float(loss) == pytest.approx(float(plain.loss()[0]), rel=1e-12)
    for name in plain.grads:
        np.testing.assert_allclose(fused.grads[name], plain.grads[name], rtol=1e-10,
                                   atol=1e-13, err_msg=name)
