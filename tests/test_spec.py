"""Spec loading: schema errors are one line naming file, YAML line and key; the ops
search path and its override rule."""
from __future__ import annotations

import textwrap

import pytest

from eulergen.errors import EulerError
from eulergen.generator.ops_path import find_ops
from eulergen.generator.spec import load_spec

GOOD = """\
name: myop
kind: pointwise
inputs: [x]
params: {eps: 1.0e-5}
outputs:
  y: x/sqrt(x**2 + eps)
"""


def write(tmp_path, text, name="myop"):
    path = tmp_path / f"{name}.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def error_of(path) -> str:
    with pytest.raises(EulerError) as info:
        load_spec(path)
    text = str(info.value)
    assert "\n" not in text
    return text


def test_good_spec_loads_with_its_parts(tmp_path):
    spec = load_spec(write(tmp_path, GOOD))
    assert spec.name == "myop" and spec.kind == "pointwise"
    assert [i.name for i in spec.inputs] == ["x"]
    assert spec.params[0].name == "eps" and spec.params[0].default == 1e-5
    assert len(spec.sha256) == 64
    assert spec.fast_math is False
    assert load_spec(write(tmp_path, GOOD + "fast_math: true\n")).fast_math is True


@pytest.mark.parametrize("edit,line,key,message", [
    (("params: {eps: 1.0e-5}", "params: {eps: 1e-5}"), 4, "params.eps",
     "'1e-5' is read by YAML as a string; write 1.0e-5"),
    (("outputs:", "outptus:"), 5, "outptus", "unknown key for a pointwise op (did you mean 'outputs'?)"),
    (("kind: pointwise", "kind: pointwize"), 2, "kind", "did you mean 'pointwise'?"),
    (("kind: pointwise", "kind: embedding"), 2, "kind",
     "unknown kind 'embedding' (expected one of pointwise, row, pair, update, attention)"),
    (("  y: x/sqrt(x**2 + eps)", "  y: x/sqrtt(x**2 + eps)"), 6, "outputs.y",
     "unknown function 'sqrtt' (did you mean 'sqrt'?)"),
    (("  y: x/sqrt(x**2 + eps)", "  y: x/sqrt(x**2 + epss)"), 6, "outputs.y",
     "unknown name 'epss' (did you mean 'eps'?)"),
    (("  y: x/sqrt(x**2 + eps)", "  y: x/sqrt(x**2 + eps"), 6, "outputs.y", "syntax error"),
    (("name: myop", "name: other"), 1, "name", "must equal the file name"),
    (("inputs: [x]", "inputs: [x, x]"), 3, "inputs.1", "'x' is declared twice"),
    (("inputs: [x]", "inputs: [x, dx]"), 3, "inputs.1", "gradients are named d<name>"),
    (("params: {eps: 1.0e-5}", "params: {eps: fast}"), 4, "params.eps", "expected a number"),
    (("params: {eps: 1.0e-5}", "params: {t0: 1.0}"), 4, "params.t0", "reserved for generated"),
    (("inputs: [x]", "inputs: [x]\nfast_math: yes please"), 4, "fast_math", "expected true or false"),
    (("inputs: [x]\n", ""), 1, "inputs", "missing required key 'inputs'"),
])
def test_schema_errors_name_file_line_and_key(tmp_path, edit, line, key, message):
    path = write(tmp_path, GOOD.replace(*edit))
    text = error_of(path)
    assert text.startswith(f"{path}:{line}: {key}: "), text
    assert message in text, text


def test_yaml_syntax_error_names_the_line(tmp_path):
    path = write(tmp_path, GOOD + "outputs: [\n")
    assert error_of(path).startswith(f"{path}:")


def test_duplicate_key_is_an_error(tmp_path):
    path = write(tmp_path, GOOD + "params: {eps: 2.0}\n")
    assert error_of(path) == f"{path}:7: params: given twice, on lines 4 and 7"


def test_row_max_that_is_not_a_stabilizer_is_not_supported(tmp_path):
    path = write(tmp_path, """\
        name: rowmax
        kind: row
        inputs: {x: row}
        reduce:
          m: max(x)
        outputs:
          y: x - m
        """, name="rowmax")
    text = error_of(path)
    assert text.startswith(f"{path}:5: reduce.m: ") and "not supported" in text


def test_row_role_typo_suggests_the_role(tmp_path):
    path = write(tmp_path, """\
        name: r
        kind: row
        inputs: {x: rows}
        reduce: {s: sum(x)}
        outputs: {y: x/s}
        """, name="r")
    assert "(did you mean 'row'?)" in error_of(path)


def test_attention_mask_may_only_use_i_j_h(tmp_path):
    path = write(tmp_path, """\
        name: att
        kind: attention
        params: {window: 4.0}
        score: s*scale
        mask: j <= i and i - j < window
        """, name="att")
    assert "a mask may use only i, j and h, not window" in error_of(path)


# The search path --------------------------------------------------------------------------

def test_user_ops_join_the_builtins(tmp_path, monkeypatch):
    monkeypatch.delenv("EULERGEN_OPS_PATH", raising=False)
    write(tmp_path, GOOD)
    ops = find_ops([tmp_path])
    assert ops["myop"] == tmp_path / "myop.yaml" and "gelu" in ops


def test_env_path_is_searched(tmp_path, monkeypatch):
    write(tmp_path, GOOD)
    monkeypatch.setenv("EULERGEN_OPS_PATH", str(tmp_path))
    assert "myop" in find_ops()


def test_user_op_with_a_builtin_name_needs_override(tmp_path, monkeypatch):
    monkeypatch.delenv("EULERGEN_OPS_PATH", raising=False)
    gelu = GOOD.replace("myop", "gelu")
    write(tmp_path, gelu, name="gelu")
    with pytest.raises(EulerError, match="add `override: true`"):
        find_ops([tmp_path])
    write(tmp_path, gelu + "override: true\n", name="gelu")
    assert find_ops([tmp_path])["gelu"] == tmp_path / "gelu.yaml"


def test_two_user_ops_with_one_name_is_an_error(tmp_path, monkeypatch):
    monkeypatch.delenv("EULERGEN_OPS_PATH", raising=False)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    write(a, GOOD), write(b, GOOD)
    with pytest.raises(EulerError, match="already defined"):
        find_ops([a, b])


def test_missing_ops_directory_is_an_error(tmp_path, monkeypatch):
    monkeypatch.delenv("EULERGEN_OPS_PATH", raising=False)
    with pytest.raises(EulerError, match="does not exist"):
        find_ops([tmp_path / "nope"])


def test_every_shipped_op_loads():
    for name, path in find_ops().items():
        assert load_spec(path).name == name


def test_explicit_backward_may_not_read_the_output(tmp_path):
    path = write(tmp_path, GOOD + "backward:\n  x: dy*(1 - y**2)\n")
    assert "backward.x: unknown name 'y'" in error_of(path)
