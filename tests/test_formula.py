"""The whitelist formula parser: what it translates, and that everything else is refused
with a one-line error naming file, line and key — never evaluated."""
from __future__ import annotations

import pytest
import sympy as sp

from eulergen.errors import EulerError
from eulergen.errors import Where
from eulergen.generator.formula import parse, parse_reduction
from eulergen.generator.primitives import logsumexp, sigmoid, softplus

x, y = sp.Symbol("x", real=True), sp.Symbol("y", real=True)
NAMES = {"x": x, "y": y}
WHERE = Where("ops/t.yaml", 7, "outputs.y")


def p(text, **kw):
    return parse(text, NAMES, WHERE, **kw)


def test_arithmetic_and_numbers_are_exact():
    assert p("0.5*x*(1 + x**3) - y/2") == sp.Rational(1, 2) * x * (1 + x**3) - y / 2
    assert p("0.044715*x") == sp.Rational(8943, 200000) * x
    assert p("-x + +y") == y - x
    assert p(3) == 3 and p(1.5) == sp.Rational(3, 2)


def test_whitelisted_functions_and_pi():
    assert p("sigmoid(x) + softplus(y)") == sigmoid(x) + softplus(y)
    assert p("logsumexp(x, y, 0)") == logsumexp(x, y, 0)
    assert p("sqrt(2/pi)") == sp.sqrt(2 / sp.pi)
    assert p("max(x, 0)") == sp.Max(x, 0)
    assert p("where(x > 0, x, y)") == sp.Piecewise((x, x > 0), (y, True))
    assert p("where(0 < x <= y, 1, 0)") == sp.Piecewise((1, sp.And(x > 0, x <= y)), (0, True))


def test_conditions_for_masks():
    assert p("x <= y and not x == 0", condition=True) == sp.And(x <= y, sp.Not(sp.Eq(x, 0)))
    assert p(True, condition=True) is sp.true


def test_reductions_only_as_whole_reduce_entries():
    assert parse_reduction("mean(x**2)", NAMES, WHERE) == ("mean", x**2)
    with pytest.raises(EulerError, match="sum.. is a reduction"):
        p("sum(x)")
    with pytest.raises(EulerError, match="must be sum"):
        parse_reduction("x + 1", NAMES, WHERE)


@pytest.mark.parametrize("text,message", [
    ("__import__('os')", "unknown function '__import__'"),
    ("__import__('os').system('true')", "only named functions may be called"),
    ("x.real", "attribute access are not allowed"),
    ("x[0]", "subscripts are not allowed"),
    ("(lambda: 1)()", "only named functions may be called"),
    ("[a for a in (1, 2)]", "comprehensions are not allowed"),
    ("x if y else 0", "conditional expressions"),
    ("'x'", "only numbers may appear as literals"),
    ("True", "only numbers may appear as literals"),
    ("x % 2", "operator 'x % 2' is not allowed"),
    ("x > 0", "only allowed as the condition of where"),
    ("xx + 1", "unknown name 'xx' (did you mean 'x'?)"),
    ("sqrtt(x)", "unknown function 'sqrtt' (did you mean 'sqrt'?)"),
    ("sqrt(x, y)", "sqrt() takes 1 argument, got 2"),
    ("max(x)", "max() takes at least 2 arguments, got 1"),
    ("where(x, 1, 0)", "expected a condition"),
    ("exp(x=1)", "takes no keyword arguments"),
    ("sqrt", "'sqrt' is a function"),
    ("x +", "syntax error"),
])
def test_rejected_formulas_name_file_line_and_key(text, message):
    with pytest.raises(EulerError) as info:
        p(text)
    text_of_error = str(info.value)
    assert text_of_error.startswith("ops/t.yaml:7: outputs.y: "), text_of_error
    assert message in text_of_error
    assert "\n" not in text_of_error


def test_parsing_never_evaluates(tmp_path, monkeypatch):
    marker = tmp_path / "touched"
    monkeypatch.chdir(tmp_path)
    with pytest.raises(EulerError):
        p(f"open('{marker.name}', 'w')")
    assert not marker.exists()
