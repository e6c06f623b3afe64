"""`eulergen check` through the CLI: a row per op and input, non-zero exit on any failure."""
from __future__ import annotations

import textwrap

import pytest
from click.testing import CliRunner

from eulergen.cli import main


@pytest.fixture(autouse=True)
def no_env_ops(monkeypatch):
    monkeypatch.delenv("EULERGEN_OPS_PATH", raising=False)


def run(*args):
    return CliRunner().invoke(main, ["check", *args])


def write(folder, name, text):
    (folder / f"{name}.yaml").write_text(textwrap.dedent(text))


def test_check_passes_every_shipped_op():
    result = run()
    assert result.exit_code == 0, result.output
    assert "0 failed" in result.output
    for op, inp in [("gelu", "x"), ("layernorm", "w"), ("cross_entropy", "x"), ("adamw", "step")]:
        assert any(line.split()[:2] == [op, inp] and line.endswith("ok")
                   for line in result.output.splitlines()), f"no passing row for {op} {inp}"


def test_check_named_ops_only():
    result = run("swiglu")
    assert result.exit_code == 0, result.output
    rows = [line.split()[:2] for line in result.output.splitlines()[1:-1]]
    assert rows == [["swiglu", "a"], ["swiglu", "b"]]


def test_unknown_op_is_a_one_line_error_with_suggestion():
    result = run("gelux")
    assert result.exit_code == 2
    assert "unknown op 'gelux' (did you mean 'gelu'?)" in result.output


def test_float32_overflow_fails_the_extreme_sweep(tmp_path):
    # A naive sigmoid: its derivative holds exp(2x)/(1 + exp(x))², which at x = 80 is
    # inf/inf in float32 but finite in float64.
    write(tmp_path, "naive_sigmoid", """\
        name: naive_sigmoid
        kind: pointwise
        inputs: [x]
        outputs:
          y: exp(x)/(1 + exp(x))
        """)
    result = run("--ops", str(tmp_path), "naive_sigmoid")
    assert result.exit_code == 1, result.output
    assert "non-finite at (80)" in result.output and "FAIL" in result.output


def test_wrong_explicit_backward_fails(tmp_path):
    write(tmp_path, "bad_back", """\
        name: bad_back
        kind: pointwise
        inputs: [x]
        outputs:
          y: x**3
        backward:
          x: 2*x**2*dy
        """)
    result = run("--ops", str(tmp_path), "bad_back")
    assert result.exit_code == 1
    assert "backward.x: explicit backward disagrees with the derived one" in result.output


def test_correct_explicit_backward_passes_and_is_used(tmp_path):
    write(tmp_path, "good_back", """\
        name: good_back
        kind: pointwise
        inputs: [x]
        outputs:
          y: log(1 + exp(x))
        backward:
          x: dy*sigmoid(x)
        """)
    result = run("--ops", str(tmp_path), "good_back")
    assert result.exit_code == 0, result.output


def test_stabilizer_that_does_not_cancel_is_reported(tmp_path):
    write(tmp_path, "bad_stab", """\
        name: bad_stab
        kind: row
        inputs: {x: row}
        reduce:
          m: max(x)
          z: sum(exp(x - m))
        stabilizers: [m]
        outputs:
          y: exp(x)/z
        """)
    result = run("--ops", str(tmp_path), "bad_stab")
    assert result.exit_code == 1
    assert "'m' is listed as a stabilizer, but output 'y' changes" in result.output


def test_op_with_a_runtime_param_is_checked_at_a_fixed_value(tmp_path):
    write(tmp_path, "leaky", """\
        name: leaky
        kind: pointwise
        inputs: [x]
        params: {slope: runtime}
        outputs:
          y: where(x > 0, x, slope*x)
        """)
    result = run("--ops", str(tmp_path), "leaky")
    assert result.exit_code == 0, result.output
