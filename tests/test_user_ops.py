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
from eulergen.generator.ops_path import find_ops
from eulergen.generator.spec import load_spec
from eulergen.runtime.engine.backend import NUMPY
from eulergen.runtime.engine.ops import OpLibrary
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


LION = """\
name: lion
kind: update
inputs: {p: state, g: grad, m: state}
params: {lr: runtime, beta1: 0.9, beta2: 0.99, weight_decay: 0.0}
update:
  p: p*(1 - lr*weight_decay) - lr*tanh(1000*(beta1*m + (1 - beta1)*g))
  m: beta2*m + (1 - beta2)*g
"""


def test_a_users_optimizer_reads_its_runtime_params_from_the_control_array(tmp_path):
    """A user's update op gets the convention adamw has, with no Python: its lr, a skip flag
    and the gradient scale come from `control` (kernels and numpy module alike), and its
    bf16 kernel writes the first state input's bf16 copy, as its autocast kernel does from
    float32 grads."""
    from eulergen.generator.plan_ops import plan_op
    (tmp_path / "lion.yaml").write_text(LION)
    derived = derive(load_spec(tmp_path / "lion.yaml"))
    f32, bf16, autocast = plan_op(derived).stages[0].sigs
    assert f32.control == bf16.control == autocast.control == ("skip", "grad_scale", "lr")
    assert [n for n, _ in bf16.args] == [n for n, _ in autocast.args] == [
        "p", "g", "m", "p_bf16", "control", "beta1", "beta2", "weight_decay", "n"]
    from eulergen.generator.render import render_op
    source = render_op(derived, plan_op(derived), "lion").source
    assert "lion_step<float, 4>(p, g, m, nullptr, control, " in source
    assert "lion_step<__nv_bfloat16, 8>(p, g, m, p_bf16, control, " in source
    assert "lion_step<float, 8>(p, g, m, p_bf16, control, " in source   # autocast's
    mod = load_module_from_source("lion", render_numpy_module(derived))
    assert mod.CONTROL == f32.control
    rng = np.random.default_rng(0)
    p, g, m = (rng.standard_normal(8) for _ in range(3))

    def step(control, grads):
        state = [p.copy(), m.copy()]
        mod.step(state[0], grads, state[1], np.array(control))
        return state
    scaled, prescaled = step([0, 0.5, 1e-2], g), step([0, 1, 1e-2], g * 0.5)
    assert all(np.array_equal(a, b) for a, b in zip(scaled, prescaled))
    assert not np.array_equal(scaled[0], p)
    skipped = step([1, 0.5, 1e-2], g)
    assert np.array_equal(skipped[0], p) and np.array_equal(skipped[1], m)
