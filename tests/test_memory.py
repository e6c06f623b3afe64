"""The memory plan holds every byte a training step touches on the GPU: the kernels'
workspace is planned and routed into the row-op and attention backward calls, and host
data arrives by copies into arena views. The CUDA call path runs on the stand-in CuPy of
test_runtime_kernels.py (kernels emulated by the numpy modules)."""
from __future__ import annotations

import numpy as np
import pytest

from eulergen.errors import EulerError
from eulergen.runtime.model.arch import arch_of
from eulergen.runtime.engine.backend import NUMPY, Backend
from eulergen.runtime.train.config import load_config
from eulergen.runtime.engine.cuda_ops import workspace_elements
from eulergen.runtime.model.memory import upload
from eulergen.runtime.model.plan import plan_model
from eulergen.runtime.engine.ops import OpLibrary
from test_runtime_kernels import OPS, dev, emu, libs, needs_manifest  # noqa: F401 (fixtures)

TINY = ["model.preset=nanoeuler", "model.hidden_dim=256", "model.num_heads=4",
        "model.num_kv_heads=2", "model.num_layers=2", "model.vocab_size=300",
        "model.max_seq_len=128", "model.mlp_hidden=320", "training.seq_len=128",
        "training.batch_size=2"]


@needs_manifest
@pytest.mark.parametrize("name", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("cols", [64, 768, 2000])
def test_row_backward_takes_its_partials_from_the_given_workspace(name, cols, libs, emu):
    gpu, ref = libs
    op = OPS[name]
    rng = np.random.default_rng(cols)
    x = rng.uniform(-2, 2, (3, 50, cols)).astype(np.float32)
    weights = [rng.uniform(0.5, 1.5, cols).astype(np.float32)
               for o in op.inputs if o.role == "weight"]
    dy = rng.uniform(-1, 1, x.shape).astype(np.float32)
    need = workspace_elements(op, "backward", x.shape)
    workspace = dev(np.full(need, np.nan, np.float32))
    got = gpu.backward(name, dev(x), *map(dev, weights), dev(dy), workspace=workspace)
    for g, w in zip(got, ref.backward(name, x, *weights, dy)):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-5)
    launch = next(v for k, _, _, v in emu.launches
                  if (OPS[name].kernels[k].stage, OPS[name].kernels[k].part) == ("backward", ""))
    partials = [v for k, v in launch.items() if k.endswith("_partials")]
    assert len(partials) == len(weights)
    assert all(np.shares_memory(p, workspace) for p in partials)
    assert not np.isnan(np.asarray(workspace)).all()   # it was written, so it was used
    with pytest.raises(EulerError, match="workspace has .* elements"):
        gpu.backward(name, dev(x), *map(dev, weights), dev(dy), workspace=workspace[:need - 1])


@needs_manifest
@pytest.mark.parametrize("name", ["layernorm", "rmsnorm"])
def test_row_backward_refuses_a_workspace_off_a_16_byte_boundary(name, libs, emu):
    """The kernels zero, write and add weight-gradient partials 16 bytes at a time
    (templates/common.cuh.j2, eg_partials_set): a workspace 4 bytes off a boundary would
    fault on the GPU, so the call refuses it before any launch."""
    gpu, _ = libs
    op = OPS[name]
    x = np.ones((4, 64), np.float32)
    weights = [np.ones(64, np.float32) for o in op.inputs if o.role == "weight"]
    need = workspace_elements(op, "backward", x.shape)
    buf = dev(np.zeros(need + 4, np.float32))
    skip = next(k for k in range(4) if (buf.data.ptr + 4 * k) % 16 == 4)
    with pytest.raises(EulerError, match="workspace starts 4 bytes past a 16-byte boundary"):
        gpu.backward(name, dev(x), *map(dev, weights), dev(x),
                     workspace=buf[skip:skip + need])
    assert not emu.launches


@needs_manifest
def test_only_ops_with_temporaries_ask_for_workspace():
    assert workspace_elements(OPS["gelu"], "backward", (4, 8, 16)) == 0
    assert workspace_elements(OPS["cross_entropy"], "backward", (4, 300)) == 0
    # attention's row dots: one float per (batch, head, query)
    assert workspace_elements(OPS["causal_attention"], "backward", (2, 128, 4, 64)) >= 2 * 4 * 128


@needs_manifest
def test_the_training_plan_holds_the_largest_backward_workspace():
    cfg = load_config(None, TINY)
    lib = OpLibrary(NUMPY)
    arch = arch_of(cfg.model, lib)
    plan = plan_model(arch, 2, 128, workspace=workspace_elements)
    want = max(workspace_elements(lib.op("rmsnorm"), "backward", (2, 128, 256)),
               workspace_elements(lib.op("causal_attention"), "backward", (2, 128, 4, 64)))
    assert plan.buffer("kernel_ws").shape == (want,) and want > 0
    assert plan.arena("kernels").dtype == "float32"
    inference = plan_model(arch, 2, 128, training=False, workspace=workspace_elements)
    assert "kernel_ws" not in inference.index


@needs_manifest
def test_the_kernel_workspace_is_the_backends_question():
    """A GPU library sizes the workspace as its kernels carve it; numpy's modules take none,
    so a numpy model plans no `kernels` arena (and never asks the CUDA side)."""
    cfg = load_config(None, TINY)
    gpu = OpLibrary(Backend("cuda", np, True, "test"))   # sizing launches nothing
    op = gpu.op("rmsnorm")
    assert gpu.workspace_elements(op, "backward", (2, 128, 256)) == \
        workspace_elements(op, "backward", (2, 128, 256)) > 0
    assert OpLibrary(NUMPY).workspace_elements(op, "backward", (2, 128, 256)) == 0
    arch = arch_of(cfg.model, gpu)
    assert "kernel_ws" in plan_model(arch, 2, 128, workspace=gpu.workspace_elements).index
    numpy_plan = plan_model(arch, 2, 128, workspace=OpLibrary(NUMPY).workspace_elements)
    assert "kernels" not in {a.name for a in numpy_plan.arenas}


def test_upload_converts_on_the_host_into_the_view():
    arena = np.zeros(10, np.int32)
    upload(arena[2:8].reshape(2, 3), np.arange(6, dtype=np.int64).reshape(2, 3))
    assert arena.tolist() == [0, 0, 0, 1, 2, 3, 4, 5, 0, 0]
    with pytest.raises(ValueError):
        upload(arena[:4], np.arange(5))


@needs_manifest
def test_a_head_dim_without_cuda_kernels_is_refused_when_the_config_is_read():
    cfg = load_config(None, ["model.hidden_dim=128", "model.num_heads=4", "model.num_kv_heads=4"])
    gpu_lib = OpLibrary(Backend("cuda", np, True, "test"))   # arch_of launches nothing
    with pytest.raises(EulerError, match=r"head dim 32 .* head dims \[64, 128\].*num_heads=2") as err:
        arch_of(cfg.model, gpu_lib)
    assert err.value.key == "model.num_heads"
    assert arch_of(cfg.model, OpLibrary(NUMPY)).head_dim == 32   # numpy runs any head dim
