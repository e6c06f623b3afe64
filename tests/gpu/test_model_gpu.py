"""The whole model on the GPU (`pytest -m gpu tests/gpu`): loss and every gradient of the
CUDA backend against the numpy backend and against benchmarks/torch_gpt.py's TorchGPT,
with the same weights, in fp32; the memory plan against the CuPy pool.

Tolerance: per parameter, max |g − g_ref| / max |g_ref| (an ∞-norm relative error, as the
kernel tests use) below 2e-3. fp32 GEMMs (TF32 off) over a two-layer model differ from
numpy's and torch's by summation order only, ~1e-5 of the scale; 2e-3 leaves room for the
softmax and layer-norm gradients, which are differences of nearly equal terms, and is still
far below what a wrong gradient gives (≥ 1e-1).
"""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from eulergen import PACKAGE_DIR
from eulergen.runtime.train.config import load_config

pytestmark = pytest.mark.gpu

# head_dim 64: a size the flash kernels take; nanoeuler keeps its GQA (4 q / 2 kv heads)
STRUCTURES = {
    "gpt2": ["model.preset=gpt2", "model.hidden_dim=128", "model.num_heads=2",
             "model.num_kv_heads=2"],
    "nanoeuler": ["model.preset=nanoeuler", "model.hidden_dim=256", "model.num_heads=4",
                  "model.num_kv_heads=2"],
    # gated with biases: the activation adds each half of c_fc's bias in its own kernel
    "nanoeuler+bias": ["model.preset=nanoeuler", "model.hidden_dim=256", "model.num_heads=4",
                       "model.num_kv_heads=2", "model.bias=true"],
}
COMMON = ["model.num_layers=2", "model.vocab_size=300", "model.max_seq_len=128",
          "model.mlp_hidden=320", "training.seq_len=128", "training.batch_size=2"]
TOLERANCE = 2e-3


def torch_gpt():
    """benchmarks/torch_gpt.py, by path (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("torch_gpt", PACKAGE_DIR / "benchmarks" / "torch_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cfg(structure):
    return load_config(None, STRUCTURES[structure] + COMMON)


def _batch(cfg, seed=0):
    rng = np.random.default_rng(seed)
    t = cfg.training
    x = rng.integers(0, cfg.model.vocab_size, (t.batch_size, t.seq_len))
    x[0, :8] = 7     # repeated ids: the embedding scatter sums them
    return x, rng.integers(0, cfg.model.vocab_size, (t.batch_size, t.seq_len))


def _run(lib, cfg, weights, x, y):
    from eulergen.runtime.model.gpt import build
    t = cfg.training
    model = build(cfg.model, lib, t.batch_size, t.seq_len, tf32=False)
    if weights is None:
        model.init_weights(1)
        rng = np.random.default_rng(2)   # norm weights and biases off 1 and 0
        weights = {k: (v + rng.normal(0, 0.1, v.shape)).astype(np.float32) if v.ndim == 1 else v
                   for k, v in model.state_dict().items()}
    model.load_state_dict(weights)
    model.load_tokens(x, y)
    loss = float(model.loss_and_grad()[0])
    grads = {k: lib.backend.asnumpy(g).copy() for k, g in model.grads.items()}
    return weights, loss, grads


def _compare(what, loss, grads, ref_loss, ref_grads):
    assert loss == pytest.approx(ref_loss, rel=1e-4), f"{what}: loss {loss} vs {ref_loss}"
    worst = {}
    for name, ref in ref_grads.items():
        err = np.abs(grads[name] - ref).max() / max(np.abs(ref).max(), 1e-12)
        worst[name] = err
    bad = {k: f"{v:.2e}" for k, v in worst.items() if v > TOLERANCE}
    assert not bad, f"{what}: gradients off: {bad}"


@pytest.mark.parametrize("structure", sorted(STRUCTURES))
def test_cuda_loss_and_every_gradient_match_numpy(libs, structure):
    cuda, cpu = libs
    cfg = _cfg(structure)
    x, y = _batch(cfg)
    weights, loss, grads = _run(cuda, cfg, None, x, y)
    _, ref_loss, ref_grads = _run(cpu, cfg, weights, x, y)
    _compare(f"{structure} cuda vs numpy", loss, grads, ref_loss, ref_grads)


@pytest.mark.parametrize("structure", sorted(STRUCTURES))
def test_cuda_loss_and_every_gradient_match_torch(libs, structure):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    tg = torch_gpt()
    cuda, _ = libs
    cfg = _cfg(structure)
    x, y = _batch(cfg)
    weights, loss, grads = _run(cuda, cfg, None, x, y)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ref = tg.TorchGPT(cfg.model).cuda()
    tg.load_eulergen_params(ref, weights)
    _, ref_loss = ref(torch.as_tensor(x, device="cuda"), torch.as_tensor(y, device="cuda"))
    ref_loss.backward()
    _compare(f"{structure} cuda vs torch", loss, grads, ref_loss.item(), tg.eulergen_grads(ref))


def _growth_hook():
    """A CuPy memory hook that records where the pool had to grow (the innermost frame
    outside CuPy), so a failure names the allocation the plan is missing."""
    import traceback
    from cupy.cuda.memory_hook import MemoryHook

    class Growth(MemoryHook):
        name = "eulergen_growth"

        def __init__(self):
            self.sites = []

        def alloc_postprocess(self, **kw):
            frame = next((f for f in reversed(traceback.extract_stack()[:-1])
                          if "cupy" not in f.filename), None)
            where = f"{frame.filename}:{frame.lineno}" if frame else "?"
            self.sites.append((kw.get("mem_size", 0), where))

        def report(self) -> str:
            return "; ".join(f"{n:,} B at {where}" for n, where in
                             sorted(self.sites, reverse=True)[:6])

    return Growth()


def _three_planned_steps(cuda, cp, cfg, dtype="float32", cuda_graph=False, steps=3,
                         precision="bf16", recompute="none"):
    """Builds the model and runs training steps on one batch as the trainer runs them
    (runtime/train/step_graph.py: clipped to norm 1, step control and AdamW on the device; eager
    unless `cuda_graph`); the model, its Stepper and the pool's size after each step."""
    from eulergen.runtime.model.gpt import build
    from eulergen.runtime.train.step_control import StepRule
    from eulergen.runtime.train.step_graph import Stepper
    from eulergen.runtime.model.optimizer_plan import update_ops
    from eulergen.runtime.train.optimizer import Optimizer
    t = cfg.training
    ops = update_ops(cuda, t.optimizer)
    model = build(cfg.model, cuda, t.batch_size, t.seq_len, dtype=dtype, precision=precision,
                  recompute=recompute, optimizer=ops)
    model.init_weights(0)
    optim = Optimizer(model, ops, t)
    stepper = Stepper(model, optim, StepRule.of(t, optim.slots), cuda_graph=cuda_graph)
    batch = [_batch(cfg)]
    sizes = []
    for step in range(1, steps + 1):
        stepper.launch(step, batch, 1e-3)
        assert not stepper.result().not_finite
        sizes.append(cp.get_default_memory_pool().total_bytes())
    return model, stepper, sizes


def test_training_steps_stay_within_the_plan(libs, cp):
    """Everything a training step touches is planned: building the model allocates the
    plan's arenas, the weights and tokens arrive by host copies, and steps (forward, fused
    loss, backward with the kernels' planned workspace, grad norm by cuBLAS on the device,
    step control, AdamW with the clip folded in) grow the pool by nothing but the step
    record: within 5 % of the plan in all, and not at all after the first step."""
    cuda, _ = libs
    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()
    before = pool.total_bytes()
    hook = _growth_hook()
    with hook:
        model, _, sizes = _three_planned_steps(cuda, cp, _cfg("nanoeuler"))
    grads = model.mem.arenas["grads"]
    used = pool.total_bytes() - before
    planned = model.mem.plan.total_bytes
    assert used <= 1.05 * planned, (f"pool grew to {used:,} bytes, the plan is {planned:,}; "
                                    f"largest growths: {hook.report()}")
    assert sizes[-1] == sizes[0], (f"steps 2-3 grew the pool by {sizes[-1] - sizes[0]:,} "
                                   f"bytes: {hook.report()}")
    # the cuBLAS norm the trainer clips with is the norm (CuPy's own, allocating, as reference)
    assert model.grad_norm() == pytest.approx(float(cp.linalg.norm(grads)), rel=1e-4)


def test_the_built_in_default_trains_on_the_gpu(libs, tmp_path):
    """`eulergen train` with no arguments on a GPU: the GPU's default model (head dim 64)
    on the CUDA backend, a short run whose validation loss falls."""
    from eulergen.runtime.train.trainer import Trainer
    cuda, _ = libs
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", "training.total_steps=60",
                             "training.warmup_steps=5", "training.eval_every=20",
                             "training.sample_tokens=20"], finds_gpu=lambda: True)
    assert cfg.default == "gpu"
    result = Trainer(cfg, cuda, progress=False, tensorboard=False).run()
    val = [result.val_losses[s] for s in sorted(result.val_losses)]
    assert len(val) == 3 and val[-1] < val[0], val
    assert result.sample


def test_eulergen_plan_on_any_machine_is_the_plan_the_trainer_allocates(libs, tmp_path):
    """`eulergen plan`'s plan (resolve for a GPU from the numpy library: no GPU needed) is
    buffer for buffer what the Trainer allocates on this GPU (bf16 by training.dtype auto)."""
    from eulergen.runtime.train.resolve import resolve
    from eulergen.runtime.train.trainer import Trainer
    cuda, numpy = libs
    cfg = load_config(None, STRUCTURES["nanoeuler"] + COMMON + [f"run_dir={tmp_path / 'run'}"])
    trainer = Trainer(cfg, cuda, progress=False, tensorboard=False)
    trainer.run(stop_after=0)   # releases the run folder
    assert trainer.cfg.training.dtype == "bf16"
    assert trainer.model.mem.plan == resolve(cfg, numpy, for_gpu=True).plan


def test_a_plan_larger_than_the_gpu_is_refused_before_allocating(libs, cp):
    from eulergen.errors import EulerError
    from eulergen.runtime.model.gpt import build
    cuda, _ = libs
    cfg = load_config(None, ["model.preset=gpt2"])
    pool = cp.get_default_memory_pool()
    before = pool.total_bytes()
    with pytest.raises(EulerError, match="memory plan needs .* GiB"):
        build(cfg.model, cuda, 4096, 1024)
    assert pool.total_bytes() == before
