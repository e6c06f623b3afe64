"""Muon's matrix step on the GPU (`pytest -m gpu tests/gpu/test_optimizer_gpu.py`): its
generated phases and the Newton-Schulz GEMMs (fp32, no TF32) against the numpy backend's,
wide, tall and square, from fp32 and bf16 gradients (the bf16 kernel writing the weight's
copy) and from fp32 gradients with a copy (training.precision autocast: the f32 step, the
autocast apply writing it), iterated in bf16 (a bf16 run's) against float32, and a skipped
step writing nothing. (Lion's and sgd_momentum's kernels:
tests/gpu/test_kernels.py; a muon run graphed against eager: test_step_graph_gpu.py.)"""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

# fp32 GEMMs summing in another order than numpy's BLAS: each Newton-Schulz step grows
# those roundings by at most its slope at 0 (a = 3.4445), five steps 3.4^5 ~ 500 x 1e-7
TOLERANCE = 1e-4


def _arrays(rng, shape, bf16: bool):
    from eulergen.runtime.engine.bf16 import from_bf16, to_bf16
    p = rng.standard_normal(shape).astype(np.float32)
    m = (0.1 * rng.standard_normal(shape)).astype(np.float32)
    g = rng.standard_normal(shape).astype(np.float32)
    if bf16:
        g = from_bf16(to_bf16(g))
    return p, g, m


@pytest.mark.parametrize("grads", ["f32", "bf16", "autocast"])
@pytest.mark.parametrize("shape", [(64, 192), (192, 64), (128, 128)])
def test_muon_on_the_gpu_matches_numpy(libs, cp, shape, grads):
    from eulergen.runtime.engine.backend import get_backend
    from eulergen.runtime.engine.bf16 import to_bf16
    from eulergen.runtime.engine.gemm import gemm_for
    from eulergen.runtime.engine.newton_schulz import workspace_elements
    gpu, ref = libs
    bf16 = grads == "bf16"
    rng = np.random.default_rng(sum(shape) + bf16)
    gemm = gemm_for(get_backend("cuda"), tf32=False)
    workspace = cp.zeros(workspace_elements(*shape), cp.float32)
    p, g, m = _arrays(rng, shape, bf16)
    dev = [cp.asarray(a) for a in (p, m)]
    dg = cp.asarray(to_bf16(g)) if bf16 else cp.asarray(g)
    copy = cp.zeros(shape, cp.uint16) if grads != "f32" else None
    host = [p.copy(), m.copy()]
    for step in range(3):
        control = np.array([0, 0.5, 1e-2], np.float32)   # grads scaled by 0.5 as read
        gpu.step("muon", dev[0], dg, dev[1], cp.zeros(shape, cp.float32),
                 control=cp.asarray(control), copy=copy, gemm=gemm, workspace=workspace)
        ref.step("muon", host[0], g, host[1], np.zeros(shape, np.float32), control=control)
    got = cp.asnumpy(dev[0])
    err = np.abs(got - host[0]).max() / np.abs(host[0] - p).max()
    assert err < TOLERANCE, f"muon {shape} {grads} grads: update off by {err:.2e} of its size"
    np.testing.assert_allclose(cp.asnumpy(dev[1]), host[1], rtol=1e-6, atol=1e-6)
    if copy is not None:
        np.testing.assert_array_equal(cp.asnumpy(copy), to_bf16(got))


@pytest.mark.parametrize("shape", [(64, 192), (192, 64), (768, 768), (768, 3072)])
def test_muon_iterating_in_bf16_gives_the_float32_update_to_bf16s_precision(libs, cp, shape):
    """half= (a bf16 run's): X rounded to bf16 and iterated on bf16 GEMMs. Each update is
    the float32 iteration's to within bf16 rounding carried through five steps: the same
    direction (cosine above 0.999) and each element within 3% of the update's largest."""
    from eulergen.runtime.engine.backend import get_backend
    from eulergen.runtime.engine.bf16 import to_bf16
    from eulergen.runtime.engine.gemm import gemm_for
    from eulergen.runtime.engine.newton_schulz import workspace_elements
    gpu, _ = libs
    rng = np.random.default_rng(sum(shape))
    gemm = gemm_for(get_backend("cuda"), tf32=False)
    p, g, m = _arrays(rng, shape, True)
    updates = []
    for half in (False, True):
        dev = [cp.asarray(a) for a in (p, m)]
        workspace = cp.zeros(workspace_elements(*shape), cp.float32)
        gpu.step("muon", dev[0], cp.asarray(to_bf16(g)), dev[1], cp.zeros(shape, cp.float32),
                 control=cp.asarray(np.array([0, 1, 1e-2], np.float32)),
                 copy=cp.zeros(shape, cp.uint16), gemm=gemm, workspace=workspace, half=half)
        updates.append((cp.asnumpy(dev[0]) - p).astype(np.float64).ravel())
    f32, b16 = updates
    cosine = f32 @ b16 / np.linalg.norm(f32) / np.linalg.norm(b16)
    err = np.abs(b16 - f32).max() / np.abs(f32).max()
    assert cosine > 0.999 and err < 0.03, f"{shape}: cosine {cosine:.6f}, off by {err:.2e}"


def test_a_skipped_muon_step_writes_nothing_on_the_gpu(libs, cp):
    gpu, _ = libs
    rng = np.random.default_rng(3)
    p, g, m = (cp.asarray(a) for a in _arrays(rng, (32, 96), False))
    before = p.copy(), m.copy()
    gpu.step("muon", p, g, m, cp.zeros_like(p), control=cp.asarray(np.array([1, 1, 1], np.float32)))
    assert bool((p == before[0]).all()) and bool((m == before[1]).all())
