"""The toy `map` kind (tests/toy_kind.py, tests/test_new_kind.py) on the GPU: its kernels,
rendered from its own template, compile and launch through the runtime's module of the
kind, and match its numpy module. Run on the H200: `pytest -m gpu
tests/gpu/test_new_kind_gpu.py`."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from eulergen.generator import build, registry
from eulergen.runtime.engine import registry as runtime_registry
from eulergen.runtime.engine.backend import get_backend
from eulergen.runtime.engine.bf16 import from_bf16, to_bf16
from eulergen.runtime.engine.ops import OpLibrary

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from toy_kind import TEMPLATE, Map, MapCalls  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture
def libs(cp, tmp_path, monkeypatch):
    """(CUDA, numpy) libraries of one built op of the toy kind."""
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "map.cu.j2").write_text(TEMPLATE)
    monkeypatch.setitem(registry.KINDS, "map", Map(tmp_path / "templates"))
    monkeypatch.setitem(runtime_registry.KINDS, "map", MapCalls())
    (tmp_path / "softsq.yaml").write_text("name: softsq\nkind: map\ninputs: [x]\n"
                                          "map: x*x/(1 + x*x)\n")
    out = build.plan_build(tmp_path / "built", {"softsq": tmp_path / "softsq.yaml"},
                           template_ops=False)
    build.write(out, build.differences(out))
    manifests = [tmp_path / "built" / "manifest.json"]
    return (OpLibrary(get_backend("cuda"), manifests=manifests),
            OpLibrary(get_backend("numpy"), manifests=manifests))


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_a_new_kinds_kernel_matches_its_numpy_module(cp, libs, dtype):
    gpu, cpu = libs
    x = np.random.default_rng(0).uniform(-4, 4, 100_003).astype(np.float32)
    if dtype == "bf16":   # one rounding of the float32 result, the input exact in bf16
        x = from_bf16(to_bf16(x))
        got = from_bf16(cp.asnumpy(gpu.forward("softsq", cp.asarray(to_bf16(x)))))
        np.testing.assert_allclose(got, cpu.forward("softsq", x), rtol=2.0 ** -8, atol=1e-6)
    else:
        got = cp.asnumpy(gpu.forward("softsq", cp.asarray(x)))
        np.testing.assert_allclose(got, cpu.forward("softsq", x), rtol=1e-6, atol=1e-7)
