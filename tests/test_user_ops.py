"""Adding an op is writing one YAML file: mish, in a folder of its own, passes
`eulergen check --ops DIR mish` with no other change."""
from __future__ import annotations

import textwrap

import numpy as np
from click.testing import CliRunner

from eulergen.cli import main
from eulergen.generator.derive import derive
from eulergen.generator.numpy_module import load_module_from_source, render_numpy_module
from eulergen.generator.spec import find_ops, load_spec

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
