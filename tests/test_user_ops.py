"""Adding an op is writing one YAML file: mish, in a folder of its own, passes
`eulergen check --ops DIR mish` with no other change."""
from __future__ import annotations

import hashlib
import json
import textwrap

import numpy as np
from click.testing import CliRunner

from eulergen import GENERATED_DIR
from eulergen.cli import main
from eulergen.generator.build import ensure_built, user_build_dir
from eulergen.generator.derive import derive
from eulergen.generator.numpy_module import load_module_from_source, render_numpy_module
from eulergen.generator.spec import find_ops, load_spec
from eulergen.runtime.backend import NUMPY
from eulergen.runtime.ops import OpLibrary
from runs import first_loss

MISH = """\
name: mish
kind: pointwise
doc: Mish, x·tanh(softplus(x))
inputs: [x]
outputs:
  y: x*tanh(softplus(x))
domain: {x: [-6, 6]}
"""


def test_mish_from_a_user_folder_passes_check(tmp_path, monkeypatch):
    monkeypatch.delenv("EULERGEN_OPS_PATH", raising=False)
    (tmp_path / "mish.yaml").write_text(MISH)
    result = CliRunner().invoke(main, ["check", "--ops", str(tmp_path), "mish"])
    assert result.exit_code == 0, result.output
    assert any(line.split()[:2] == ["mish", "x"] and line.endswith("ok")
               for line in result.output.splitlines()), result.output


def test_mish_from_eulergen_ops_path_computes_mish(tmp_path, monkeypatch):
    (tmp_path / "mish.yaml").write_text(textwrap.dedent(MISH))
    monkeypatch.setenv("EULERGEN_OPS_PATH", str(tmp_path))
    mod = load_module_from_source("mish", render_numpy_module(derive(load_spec(find_ops()["mish"]))))
    x = np.linspace(-5, 5, 11)
    np.testing.assert_allclose(mod.forward(x), x * np.tanh(np.log1p(np.exp(x))), rtol=1e-12)


GELU_OVERRIDE = """\
name: gelu
kind: pointwise
doc: GELU, sigmoid approximation (a user's own)
override: true
inputs: [x]
outputs:
  y: x*sigmoid(1.702*x)
domain: {x: [-4, 4]}
"""

SHORT = ["--set", "training.total_steps=2", "--set", "training.warmup_steps=1",
         "--set", "training.eval_every=0", "--set", "training.sample_tokens=0",
         "--device", "numpy"]


def _tree_hash(root) -> dict:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


def test_a_user_override_of_gelu_never_touches_the_package(tmp_path, monkeypatch):
    """build and train with a user's gelu leave generated/ byte-identical; the run uses the
    user's gelu (built into the cache), a later run without --ops the built-in one."""
    monkeypatch.delenv("EULERGEN_OPS_PATH", raising=False)
    monkeypatch.setenv("EULERGEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    ops = tmp_path / "myops"
    ops.mkdir()
    (ops / "gelu.yaml").write_text(GELU_OVERRIDE)
    before = _tree_hash(GENERATED_DIR)
    runner = CliRunner()

    built = runner.invoke(main, ["build", "--ops", str(ops)])
    assert built.exit_code == 0, built.output
    assert _tree_hash(GENERATED_DIR) == before
    user = user_build_dir((ops,))
    entry = json.loads((user / "manifest.json").read_text())["ops"]["gelu"]
    assert "1.702" in (user / entry["numpy"]).read_text()

    mine = runner.invoke(main, ["train", "--ops", str(ops), "--run-dir", "mine", *SHORT])
    assert mine.exit_code == 0, mine.output
    assert _tree_hash(GENERATED_DIR) == before
    builtin = runner.invoke(main, ["train", "--run-dir", "builtin", *SHORT])
    assert builtin.exit_code == 0, builtin.output
    assert _tree_hash(GENERATED_DIR) == before

    # the same seed and data: the first step's loss tells which gelu each run computed
    x = np.linspace(-4, 4, 101)
    lib_user = OpLibrary(NUMPY, ensure_built(("gelu",), (ops,)))
    np.testing.assert_allclose(lib_user.forward("gelu", x), x / (1 + np.exp(-1.702 * x)),
                               rtol=1e-12)
    assert first_loss(tmp_path / "mine") != first_loss(tmp_path / "builtin")
    again = runner.invoke(main, ["train", "--ops", str(ops), "--run-dir", "again", *SHORT])
    assert again.exit_code == 0, again.output
    assert first_loss(tmp_path / "again") == first_loss(tmp_path / "mine")
    assert OpLibrary(NUMPY).op("gelu").numpy == GENERATED_DIR / "numpy" / "gelu.py"
    assert _tree_hash(GENERATED_DIR) == before
