"""bf16 mixed precision on the GPU (`pytest -m gpu tests/gpu/test_bf16_gpu.py`): the
runtime's bf16 kernels (runtime/engine/bf16.py) against their numpy forms; the bf16 model's loss
and every gradient against the fp32 model with the same weights; a bf16 step's memory
against its plan; 300 steps on builtin:stdlib ending within 1% of the fp32 run; a NaN
stopping the run; a bf16 run's checkpoint in an fp32 model and the sampler. (Resume in
bf16: tests/gpu/test_resume_gpu.py.)

Tolerances, as tests/test_bf16_model.py states them for the CPU emulation of the same
rounding: bf16 keeps 8 significant bits (a rounding is off by up to 2^-9 of the value),
and a two-layer model rounds each activation and gradient a few dozen times along a path,
errors that add in quadrature to ~1e-2 of a gradient's norm (the CPU emulation measured
at most 8.5e-3): per parameter ‖g_bf16 − g_fp32‖ / ‖g_fp32‖ < 2e-2, the loss (float32,
from bf16 logits) within 1e-2; a wrong gradient is off by order 1.
"""
from __future__ import annotations

import numpy as np
import pytest

from eulergen.errors import EulerError
from eulergen.runtime.engine import bf16
from eulergen.runtime.train import checkpoint
from eulergen.runtime.train.config import load_config
from eulergen.runtime.engine.bf16 import from_bf16, to_bf16

pytestmark = pytest.mark.gpu

GRAD_TOLERANCE = 2e-2
LOSS_TOLERANCE = 1e-2
# the structures of test_model_gpu.py (head dim 64, vocab 300 padded to 320: the padded
# logits' -inf in bf16), its batch (repeated ids)
from test_model_gpu import (  # noqa: E402  (tests/gpu is on the path)
    STRUCTURES, _batch, _cfg, _three_planned_steps)


def test_the_bf16_kernels_give_the_numpy_forms_bits(cp):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(1 << 20) * 10.0 ** rng.integers(-30, 30, 1 << 20)).astype(np.float32)
    x[:6] = [np.inf, -np.inf, 0.0, -0.0, 3.4e38, 1 + 2.0 ** -8]
    out = cp.zeros(x.size, cp.uint16)
    assert bf16.to_bf16(cp.asarray(x), out=out) is out
    np.testing.assert_array_equal(cp.asnumpy(out), to_bf16(x))
    wide = cp.zeros(x.size, cp.float32)
    assert bf16.from_bf16(out, out=wide) is wide
    np.testing.assert_array_equal(cp.asnumpy(wide).view(np.uint32),
                                  from_bf16(to_bf16(x)).view(np.uint32))
    a, b = to_bf16(x), to_bf16(rng.standard_normal(x.size).astype(np.float32))
    want, got = np.zeros_like(a), cp.zeros(a.size, cp.uint16)
    bf16.add(a, b, want)
    bf16.add(cp.asarray(a), cp.asarray(b), got)
    np.testing.assert_array_equal(cp.asnumpy(got), want)
    g = to_bf16(rng.standard_normal((512, 2048)).astype(np.float32) * 1e-3)
    got, want = cp.zeros(512, cp.float32), np.zeros(512, np.float32)
    bf16.row_norms(cp.asarray(g), got)
    bf16.row_norms(g, want)
    np.testing.assert_allclose(cp.asnumpy(got), want, rtol=1e-5)


def _grads(lib, cfg, weights, x, y, dtype, precision="bf16"):
    from eulergen.runtime.model.gpt import build
    t = cfg.training
    model = build(cfg.model, lib, t.batch_size, t.seq_len, dtype=dtype, precision=precision,
                  tf32=False)
    model.load_state_dict(weights)
    model.load_tokens(x, y)
    loss = float(model.loss_and_grad()[0])
    grads = {k: lib.backend.asnumpy(g).copy() for k, g in model.grads.items()}
    grads = {k: from_bf16(g) if g.dtype == np.uint16 else g for k, g in grads.items()}
    return loss, grads, model.grad_norm()


def _weights(cuda, cfg) -> dict:
    from eulergen.runtime.model.gpt import build
    t = cfg.training
    init = build(cfg.model, cuda, t.batch_size, t.seq_len, training=False)
    init.init_weights(1)
    rng = np.random.default_rng(2)   # norm weights and biases off 1 and 0
    return {k: (v + rng.normal(0, 0.1, v.shape)).astype(np.float32) if v.ndim == 1 else v
            for k, v in init.state_dict().items()}


@pytest.mark.parametrize("structure", sorted(STRUCTURES))
def test_bf16_loss_and_every_gradient_match_fp32_with_the_same_weights(libs, structure):
    """Both precisions (training.precision): bf16's and autocast's each within the
    tolerances, and autocast's gradients closer to fp32's on average (fewer roundings: no
    bf16 stream or gradients), as on the CPU (tests/test_autocast_model.py)."""
    cuda, _ = libs
    cfg = _cfg(structure)
    weights, (x, y) = _weights(cuda, cfg), _batch(cfg)
    ref_loss, ref, ref_norm = _grads(cuda, cfg, weights, x, y, "float32")
    mean = {}
    for precision in ("bf16", "autocast"):
        loss, got, norm = _grads(cuda, cfg, weights, x, y, "bf16", precision)
        assert loss == pytest.approx(ref_loss, rel=LOSS_TOLERANCE), precision
        errors = {k: np.linalg.norm(got[k] - g) / max(np.linalg.norm(g), 1e-30)
                  for k, g in ref.items()}
        bad = {k: f"{v:.2e}" for k, v in errors.items() if v > GRAD_TOLERANCE}
        assert not bad, f"{structure}: {precision} gradients off: {bad}"
        assert norm == pytest.approx(ref_norm, rel=GRAD_TOLERANCE), precision
        mean[precision] = float(np.mean(list(errors.values())))
    assert mean["autocast"] <= mean["bf16"], mean


@pytest.mark.parametrize("precision,cuda_graph", [("bf16", False), ("autocast", True)])
def test_bf16_training_steps_stay_within_the_plan(libs, cp, precision, cuda_graph):
    """As test_model_gpu's fp32 test: building allocates the plan, and bf16 steps (the
    bf16 GEMMs, residual adds, the norm's row sums, clipping, AdamW writing the bf16 copy;
    autocast's float32 stream and gradients, captured as CUDA graphs) grow the pool by
    nothing but the step record: within 5 % of the plan, none after step 1; the copy AdamW
    wrote is the master rounded."""
    cuda, _ = libs
    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()
    before = pool.total_bytes()
    model, _, sizes = _three_planned_steps(cuda, cp, _cfg("nanoeuler"), dtype="bf16",
                                           precision=precision, cuda_graph=cuda_graph)
    used = pool.total_bytes() - before
    planned = model.mem.plan.total_bytes
    assert used <= 1.05 * planned, f"pool grew to {used:,} bytes, the plan is {planned:,}"
    assert sizes[-1] == sizes[0], f"steps 2-3 grew the pool by {sizes[-1] - sizes[0]:,} bytes"
    grads = cp.asnumpy(model.mem.arenas["grads"])
    wide = (from_bf16(grads) if grads.dtype == np.uint16 else grads).astype(np.float64)
    assert model.grad_norm() == pytest.approx(np.sqrt((wide ** 2).sum()), rel=1e-4)
    np.testing.assert_array_equal(cp.asnumpy(model.mem.arenas["params_bf16"]),
                                  to_bf16(cp.asnumpy(model.mem.arenas["params"])))


def _stdlib(run_dir, dtype, steps=300):
    return load_config(None, [f"run_dir={run_dir}", f"training.total_steps={steps}",
                              "training.warmup_steps=20", "training.eval_every=100",
                              "training.eval_steps=8", "training.log_every=100",
                              "training.sample_tokens=0", "training.device=cuda",
                              f"training.dtype={dtype}"])


def test_300_bf16_steps_on_stdlib_end_within_1_percent_of_fp32(libs, tmp_path):
    """The built-in CPU default model (d 128, 3 layers, T 64, B 16) on builtin:stdlib."""
    from eulergen.runtime.train.trainer import Trainer
    cuda, _ = libs
    runs = {dtype: Trainer(_stdlib(tmp_path / dtype, dtype), cuda, progress=False,
                           tensorboard=False).run() for dtype in ("fp32", "bf16")}
    fp32, half = runs["fp32"].val_losses[300], runs["bf16"].val_losses[300]
    assert runs["bf16"].val_losses[100] > half        # it learns
    assert abs(half - fp32) <= 0.01 * fp32, f"bf16 val loss {half:.4f}, fp32 {fp32:.4f}"
    # its checkpoint: float32 weights under the fp32 run's names, for fp32 models and sampling
    ck = checkpoint.load(checkpoint.latest(tmp_path / "bf16"))
    ref = checkpoint.load(checkpoint.latest(tmp_path / "fp32"))
    assert ck.params.keys() == ref.params.keys()
    assert all(v.dtype == np.float32 for v in ck.params.values())
    assert ck.optim.keys() == ref.optim.keys()
    # what `eulergen sample RUN` does with it: a KV-cache decoder (bf16 on this GPU)
    from eulergen.runtime.train.evaluate import load_into, open_model
    from eulergen.runtime.generate.sample import Sampler
    from eulergen.runtime.model.arch import arch_of
    weights = open_model(tmp_path / "bf16")
    assert weights.cfg.training.dtype == "bf16"
    sampler = Sampler(arch_of(weights.cfg.model, cuda), cuda,
                      seq_len=weights.cfg.training.seq_len)
    load_into(sampler.decoder, weights)
    ids = sampler.generate(np.arange(8), 16, top_k=40, temperature=0.8, seed=0)
    assert len(ids) == 16 and all(0 <= i < weights.cfg.model.vocab_size for i in ids)


def test_a_nan_in_bf16_stops_the_run_naming_the_step(libs, tmp_path):
    from eulergen.runtime.train.trainer import Trainer
    cuda, _ = libs
    cfg = load_config(None, [f"run_dir={tmp_path / 'nan'}", "training.total_steps=8",
                             "training.warmup_steps=2", "training.checkpoint_every=3",
                             "training.eval_every=0", "training.sample_tokens=0",
                             "training.device=cuda", "training.dtype=bf16",
                             "training.precision=bf16"])
    Trainer(cfg, cuda, progress=False, tensorboard=False).run(stop_after=3)
    trainer = Trainer(cfg, cuda, resume=True, progress=False, tensorboard=False)
    trainer.model.master["ln_f.weight"][0] = np.nan
    trainer.model.sync_weights()
    with pytest.raises(EulerError, match="at step 4.*ckpt_00000003"):
        trainer.run()
    assert checkpoint.latest(tmp_path / "nan").name == "ckpt_00000003"
