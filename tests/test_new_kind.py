"""A new op kind is one generator module, one runtime module and its templates: the toy
`map` kind (tests/toy_kind.py), registered on both sides from here, its template in a
temporary folder, builds, reads back from its manifest and runs on numpy, with no other
file of eulergen changed."""
from __future__ import annotations

import numpy as np
import pytest

from eulergen.errors import EulerError
from eulergen.generator import build, registry
from eulergen.runtime.engine import registry as runtime_registry
from eulergen.runtime.engine.backend import get_backend
from eulergen.runtime.engine.manifest import load_manifest
from eulergen.runtime.engine.ops import OpLibrary

from toy_kind import TEMPLATE, Map, MapCalls

SOFTSQ = "name: softsq\nkind: map\ndoc: x² / (1 + x²)\ninputs: [x]\nmap: x*x/(1 + x*x)\n"


@pytest.fixture
def built(tmp_path, monkeypatch):
    """The toy kind registered on both sides, its template in tmp_path/templates, and an op
    of it built into tmp_path/built: (that folder, the build's log)."""
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "map.cu.j2").write_text(TEMPLATE)
    monkeypatch.setitem(registry.KINDS, "map", Map(tmp_path / "templates"))
    monkeypatch.setitem(runtime_registry.KINDS, "map", MapCalls())
    (tmp_path / "softsq.yaml").write_text(SOFTSQ)
    root, said = tmp_path / "built", []
    out = build.plan_build(root, {"softsq": tmp_path / "softsq.yaml"}, template_ops=False,
                           log=said.append)
    build.write(out, build.differences(out))
    return root, said


def test_a_new_kind_builds_and_its_manifest_reads_back_the_plans_signatures(built):
    root, said = built
    op = load_manifest(root / "manifest.json").ops["softsq"]
    assert (op.kind, op.grads, said) == ("map", (), ["deriving softsq"])
    assert tuple(op.kernels.values()) == registry.KINDS["map"].plan(
        _derived(root.parent / "softsq.yaml"))
    source = op.cuda.read_text()
    assert op.template in source.splitlines()[0]   # the header names the template it came from
    assert ("softsq_forward_bf16(const __nv_bfloat16* x, __nv_bfloat16* y, long long n)"
            in " ".join(source.split()))


def test_a_new_kind_runs_on_numpy_and_refuses_the_calls_it_does_not_take(built):
    root, _ = built
    lib = OpLibrary(get_backend("numpy"), manifests=[root / "manifest.json"])
    x = np.linspace(-3, 3, 7, dtype=np.float32)
    np.testing.assert_allclose(lib.forward("softsq", x), x * x / (1 + x * x), rtol=1e-6)
    with pytest.raises(EulerError, match="'softsq' is a map op: it has no backward "
                                         r"\(its calls: forward\)"):
        lib.backward("softsq", x, x)


def test_a_new_kinds_ops_are_not_built_again_while_nothing_changed(built):
    root, _ = built
    said = []
    build.plan_build(root, {"softsq": root.parent / "softsq.yaml"}, template_ops=False,
                     log=said.append)
    assert said == []


def _derived(path):
    from eulergen.generator.derive import derive
    from eulergen.generator.spec import load_spec
    return derive(load_spec(path))
