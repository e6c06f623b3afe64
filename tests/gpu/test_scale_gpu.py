"""One bf16 step at the benchmark's scale (`pytest -m gpu tests/gpu/test_scale_gpu.py`):
GPT-2 124M and NanoEuler 114M at T=1024 (B=2, random tokens, the init with norm weights
and biases moved off 1 and 0), loss and every parameter gradient against PyTorch with the
same weights and tokens.

The tolerance comes from bf16 rounding, measured against PyTorch's own bf16: eulergen bf16
and torch bf16 autocast are both compared with the same reference, the torch model in fp32
(TF32 off), by ‖g − g_fp32‖ / ‖g_fp32‖ per tensor. A bf16 rounding is off by at most 2^-9
of its value (RMS 2^-9/√3 ≈ 1.1e-3). Both recipes round every GEMM's operands and output,
about eight roundings a block each way; eulergen also rounds the residual stream at each of
its 2·12 adds, the stream's gradient at each, and the norms' and biases' weight gradients,
which autocast keeps in fp32: about a third more roundings along a path, and on the stream,
where errors are carried to every later layer instead of scaled by a branch. Errors of
independent roundings add in quadrature, so eulergen's error should be within FACTOR = 3
of autocast's; FLOOR = 1e-2 (some nine roundings in quadrature) is for tensors autocast
computes in fp32, whose error is then near zero while eulergen's includes its own rounding
of the gradient. A wrong gradient is off by order 1. The loss, the mean of 2048 token
losses whose rounding errors average out, must be as close to fp32's as FACTOR times
autocast's distance plus LOSS_FLOOR = 1e-3 of it.

training.precision=autocast keeps what autocast keeps in fp32 (the stream, its gradient,
the norms' weights, every parameter gradient): its step takes the same bounds, and its
gradients are closer to fp32's on average than the bf16 precision's.
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest

from eulergen.runtime.train.config import load_config

pytestmark = pytest.mark.gpu

FACTOR = 3.0
FLOOR = 1e-2
LOSS_FLOOR = 1e-3
B, T = 2, 1024

from test_bf16_gpu import _grads  # noqa: E402  (tests/gpu is on the path)
from test_model_gpu import torch_gpt  # noqa: E402


def _weights(cuda, cfg) -> dict:
    from eulergen.runtime.model.gpt import build
    init = build(cfg.model, cuda, 1, 1, training=False)
    init.init_weights(1)
    rng = np.random.default_rng(2)
    return {k: (v + rng.normal(0, 0.1, v.shape)).astype(np.float32) if v.ndim == 1 else v
            for k, v in init.state_dict().items()}


def _torch_step(torch, tg, cfg, weights, x, y, autocast: bool):
    model = tg.TorchGPT(cfg.model).cuda()
    tg.load_eulergen_params(model, weights)
    bf16 = torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with bf16:
        _, loss = model(torch.as_tensor(x, device="cuda"), torch.as_tensor(y, device="cuda"))
    loss.backward()
    return loss.item(), tg.eulergen_grads(model)


def _error(got: np.ndarray, ref: np.ndarray) -> float:
    ref = ref.astype(np.float64)
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


@pytest.mark.parametrize("preset", ["gpt2", "nanoeuler"])
def test_a_124m_bf16_step_matches_pytorch_within_autocasts_own_rounding(libs, preset, monkeypatch):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    tg, (cuda, _) = torch_gpt(), libs
    cfg = load_config(None, [f"model.preset={preset}", f"training.batch_size={B}",
                             f"training.seq_len={T}"])
    weights = _weights(cuda, cfg)
    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, cfg.model.vocab_size, (B, T)) for _ in "xy")
    ref_loss, ref = _torch_step(torch, tg, cfg, weights, x, y, autocast=False)
    auto_loss, auto = _torch_step(torch, tg, cfg, weights, x, y, autocast=True)
    torch.cuda.empty_cache()
    mean = {}
    for precision in ("bf16", "autocast"):
        loss, got, _ = _grads(cuda, cfg, weights, x, y, "bf16", precision)
        assert got.keys() == ref.keys()
        allowed = FACTOR * abs(auto_loss - ref_loss) + LOSS_FLOOR * ref_loss
        assert abs(loss - ref_loss) <= allowed, \
            f"{precision}: loss {loss:.5f}, fp32 {ref_loss:.5f}, autocast {auto_loss:.5f}"
        errors = {k: (_error(got[k], g), _error(auto[k], g)) for k, g in ref.items()}
        bad = {k: f"eulergen {e:.2e}, autocast {a:.2e}" for k, (e, a) in errors.items()
               if e > FACTOR * a + FLOOR}
        worst = max(errors, key=lambda k: errors[k][0])
        assert not bad, (f"{preset} {precision}: gradients past {FACTOR} x autocast's + "
                         f"{FLOOR}: {bad}")
        mean[precision] = float(np.mean([e for e, _ in errors.values()]))
        print(f"{preset} {precision}: loss {loss:.5f} (fp32 {ref_loss:.5f}, autocast "
              f"{auto_loss:.5f}); worst gradient {worst}: eulergen {errors[worst][0]:.2e}, "
              f"autocast {errors[worst][1]:.2e}; mean {mean[precision]:.2e}, torch autocast's "
              f"{np.mean([a for _, a in errors.values()]):.2e}")
    assert mean["autocast"] <= mean["bf16"], mean
