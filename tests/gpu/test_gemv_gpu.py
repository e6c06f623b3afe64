"""The decoder's few-row GEMMs on the GPU (`pytest -m gpu tests/gpu/test_gemv_gpu.py`):
runtime/engine/gemv.py's kernels at GPT-2's decode shapes against the float64 product
(within one rounding of the output's dtype plus float32's error of a k-term sum, as
tests/test_gemv_emulated.py states it), the same bits at every run, SmallRows sending what
they take to them and the rest to the process's GEMM, and a bf16 decoder's one-row step
launching them (the decoder's numerics: tests/gpu/test_sample_gpu.py). Then a pointwise op's
`gemv` variant, y = act(x·wᵀ + b) in one kernel: the bits of the pair it replaces (the gemv
kernel writing x·wᵀ, then the op's bias variant), and a bf16 decoder whose steps run it:
one kernel a layer fewer, its logits the unfused decoder's to the bit."""
from __future__ import annotations

import numpy as np
import pytest

from eulergen.runtime.engine import bf16
from eulergen.runtime.train.config import load_config

pytestmark = pytest.mark.gpu

# GPT-2's shape at a tiny size (head dim 64: one the attention kernels take)
TINY = ["model.preset=gpt2", "model.hidden_dim=128", "model.num_heads=2", "model.num_layers=2",
        "model.vocab_size=300", "model.max_seq_len=32", "model.mlp_hidden=320"]


def _operands(cp, rows, n, k, dt, seed, w_scale=1.0):
    rng = np.random.default_rng(seed)
    host = [rng.standard_normal(s).astype(np.float32) for s in ((rows, k), (n, k), n)]
    host[1] *= np.float32(w_scale)
    if dt == "bf16":
        stored = [bf16.to_bf16(h) for h in host]
        exact = [bf16.from_bf16(s).astype(np.float64) for s in stored]
    else:
        stored, exact = host, [h.astype(np.float64) for h in host]
    return exact, [cp.asarray(s) for s in stored]


def _widen(y, dt):
    y = y.get()
    return (bf16.from_bf16(y) if y.dtype == np.uint16 else y).astype(np.float64)


def _within(got, want, x, w, k, ulp):
    bound = ulp * np.abs(want) + k * 2.0 ** -24 * (np.abs(x) @ np.abs(w).T) + 1e-30
    assert (np.abs(got - want) <= bound).all(), np.abs(got - want).max()


@pytest.mark.parametrize("dt", ["f32", "bf16"])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("n,k", [(2304, 768), (768, 3072), (3072, 768)])
def test_the_gemv_kernels_give_the_product_plus_bias_the_same_at_every_run(cp, dt, rows, n, k):
    from eulergen.runtime.engine.gemv import gemv, takes
    (x, w, b), (xd, wd, bd) = _operands(cp, rows, n, k, dt, rows)
    y = cp.zeros((rows, n), xd.dtype)
    assert takes(xd, wd, y, bd)
    gemv(xd, wd, y, bias=bd)
    first = y.copy()
    gemv(xd, wd, y, bias=bd)
    assert (y == first).all()
    _within(_widen(y, dt), x @ w.T + b, x, w, k, 2.0 ** -8 if dt == "bf16" else 2.0 ** -24)
    gemv(xd, wd, y, add=True)                     # y += x·wᵀ, one rounding of the sum
    _within(_widen(y, dt), _widen(first, dt) + x @ w.T, x, w, k,
            2.0 ** -8 if dt == "bf16" else 2.0 ** -24)


def test_bf16_operands_write_the_float32_logits_of_a_padded_vocabulary(cp):
    from eulergen.runtime.engine.gemv import gemv, takes
    (x, w, _), (xd, wd, _) = _operands(cp, 2, 50304, 768, "bf16", 7)
    y = cp.zeros((2, 50304), cp.float32)
    assert takes(xd, wd, y) and not takes(xd, wd, y, cp.zeros(50304, cp.float32))
    gemv(xd, wd, y)
    _within(_widen(y, "f32"), x @ w.T, x, w, 768, 2.0 ** -24)


def test_small_rows_sends_what_the_kernels_take_to_them_and_the_rest_to_the_library(cp):
    from eulergen.runtime.engine import kernels
    from eulergen.runtime.engine.backend import get_backend
    from eulergen.runtime.engine.gemm import gemm_for
    from eulergen.runtime.engine.gemv import SmallRows, max_rows
    inner = gemm_for(get_backend("cuda"), False, cp.zeros(32 << 20, cp.uint8))
    gemm = SmallRows(inner)
    assert gemm.epilogues == inner.epilogues
    names = []
    kernels.RECORDERS.append(lambda fn, at, args, arg_names: names.append(arg_names))
    try:
        for rows, offset, want in ((max_rows(), 0, True), (max_rows() + 1, 0, False),
                                   (max_rows(), 1, False)):
            (x, w, b), (xd, wd, bd) = _operands(cp, rows, 512, 256 + offset, "f32", rows)
            xd = xd[:, offset:]                   # offset 1: unaligned rows go to the library
            wd = cp.ascontiguousarray(wd[:, offset:])
            y = cp.zeros((rows, 512), cp.float32)
            names.clear()
            gemm(xd, wd, y, tb=True, bias=bd if inner.epilogues else None)
            launched = any("ldw" in n for n in names)
            assert launched == want, (rows, offset)
            want_y = x[:, offset:] @ w[:, offset:].T + (b if inner.epilogues else 0)
            _within(_widen(y, "f32"), want_y, x[:, offset:], w[:, offset:], 256, 2.0 ** -12)
    finally:
        kernels.RECORDERS.pop()


def test_a_bf16_decoders_one_row_step_runs_its_linear_layers_on_the_gemv_kernels(cp, libs):
    from eulergen.runtime.engine import kernels
    from eulergen.runtime.generate.decoder import build_decoder
    from eulergen.runtime.model.arch import arch_of
    cuda, _ = libs
    cfg = load_config(None, TINY).model
    dec = build_decoder(arch_of(cfg, cuda), cuda, 1, 32, dtype="bf16", graphs=False)
    dec.prefill(np.zeros((1, 4), np.int64))
    names = []
    kernels.RECORDERS.append(lambda fn, at, args, arg_names: names.append(arg_names))
    try:
        dec.decode(np.zeros(1, np.int64))
    finally:
        kernels.RECORDERS.pop()
    # per layer c_attn, c_proj, c_fc (with its activation), c_proj; then the tied head
    assert sum("ldw" in n for n in names) == 4 * 2 + 1


@pytest.mark.parametrize("op", ["gelu", "relu", "silu"])
@pytest.mark.parametrize("dt", ["f32", "bf16"])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_the_fused_kernel_gives_the_bits_of_the_gemv_and_activation_pair(cp, libs, op, dt,
                                                                         rows, with_bias):
    """At c_fc's shape: the fused kernel reads its float32 sum as the gemv kernel stores it
    and runs the code of the op's bias variant (or forward) on it, so its output is the
    pair's to the bit, at every run."""
    from eulergen.runtime.engine.gemv import fuses, gemv
    cuda, _ = libs
    n, k = 3072, 768
    _, (xd, wd, bd) = _operands(cp, rows, n, k, dt, rows, 1 / np.sqrt(k))
    bd = bd if with_bias else None
    act = cuda.op(op)
    assert fuses(act)
    fc = cp.empty((rows, n), xd.dtype)
    gemv(xd, wd, fc)
    pair = cuda.forward(act, fc, bd, fusion="bias") if with_bias else cuda.forward(act, fc)
    y = cp.full((rows, n), 7, xd.dtype)
    gemv(xd, wd, y, bias=bd, act=act, params=dict(act.params))
    first = y.copy()
    gemv(xd, wd, y, bias=bd, act=act, params=dict(act.params))
    np.testing.assert_array_equal(cp.asnumpy(first), cp.asnumpy(y))
    np.testing.assert_array_equal(cp.asnumpy(y), cp.asnumpy(pair))


def _tiny_weights(arch) -> dict:
    """Weights every storage holds exactly (bf16 values): matrices of variance 1/fan-in, so
    each product is ~N(0, 1) and the activation's curved part is what c_fc's columns see;
    norm weights and biases off 1 and 0."""
    from eulergen.runtime.model.params import parameters
    rng = np.random.default_rng(3)
    out = {}
    for spec in parameters(arch):
        if len(spec.shape) == 2:
            v = rng.normal(0, 1 / np.sqrt(spec.shape[1]), spec.shape)
        else:
            v = rng.normal(0, 0.2, spec.shape) + (0 if spec.name.endswith(".bias") else 1)
        out[spec.name] = bf16.from_bf16(bf16.to_bf16(v.astype(np.float32)))
    return out


@pytest.fixture(scope="module")
def decoded(cp, libs):
    """A prompt's prefill then 8 one-row steps of the tiny GPT-2, batch 1, on bf16 decoders
    with EULERGEN_GEMV on: fused (c_fc, its bias and the activation one kernel) and not (the
    decoder's `fuses` answering no: the gemv kernel, then the op's bias variant). For each,
    the decoder and its logits [9, B, vocab_rows], the steps captured as a CUDA graph from
    the second."""
    from eulergen.runtime.generate import decoder
    from eulergen.runtime.model.arch import arch_of
    cuda, _ = libs
    arch = arch_of(load_config(None, TINY).model, cuda)
    weights = _tiny_weights(arch)
    rng = np.random.default_rng(7)
    prompt, steps = rng.integers(0, 300, (1, 6)), rng.integers(0, 300, 8)

    def run():
        dec = decoder.build_decoder(arch, cuda, 1, 32, dtype="bf16")
        dec.load_state_dict(weights)
        logits = [cp.asnumpy(dec.decode(steps[t - 1]) if t else dec.prefill(prompt))
                  for t in range(len(steps) + 1)]   # each run's copy before the next writes
        return dec, np.stack(logits)

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EULERGEN_GEMV", "on")
        fused = run()
        patch.setattr(decoder, "fuses", lambda op: False)
        unfused = run()
    return fused, unfused


def test_a_bf16_decode_step_runs_one_kernel_a_layer_fewer_with_the_fusion(decoded):
    (fused, _), (unfused, _) = decoded
    counts = [d._captured[1, False].kernel_count() for d in (fused, unfused)]
    assert counts[0] == counts[1] - fused.arch.layers, counts


def test_the_fused_decoders_logits_are_the_unfused_ones_to_the_bit(decoded):
    """Every kernel the fusion replaces gives the pair's bits, so the prefill and every step
    after it (the steps run the fused kernel, the first eagerly, the rest as a CUDA graph)
    have the unfused decoder's logits exactly."""
    (_, fused), (_, unfused) = decoded
    np.testing.assert_array_equal(fused, unfused)
