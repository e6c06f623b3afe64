"""Environment variables (eulergen/env.py): read nowhere else in the package, each bad value
one error naming the variable, a misspelt EULERGEN_* name a warning, the defaults."""
from __future__ import annotations

import re

import pytest

from eulergen import PACKAGE_DIR, env
from eulergen.errors import EulerError

_READS = re.compile(r"os\.environ\.get\(|os\.getenv\(|os\.environ\[|in os\.environ\b|"
                    r"environ\.get\(")


def _modules(outside: tuple[str, ...]):
    """The package's .py files but those under `outside` and hidden folders (a checkout's
    .venv or other tools' trees, never shipped)."""
    for p in PACKAGE_DIR.rglob("*.py"):
        top = p.relative_to(PACKAGE_DIR).parts[0]
        if top not in outside and not top.startswith("."):
            yield p


def test_no_module_but_env_py_reads_an_environment_variable():
    readers = [str(p.relative_to(PACKAGE_DIR)) for p in _modules(("tests", "benchmarks", "generated"))
               if p.name != "env.py" and _READS.search(p.read_text(encoding="utf-8"))]
    assert readers == []


def test_every_variable_read_is_declared_once():
    text = "\n".join(p.read_text(encoding="utf-8") for p in _modules(("tests", "benchmarks")))
    asked = set(re.findall(r"env\.(?:get|is_set)\(\s*\"([A-Z_]+)\"", text))
    assert asked <= set(env.VARIABLES), asked - set(env.VARIABLES)


@pytest.mark.parametrize("name,text,says", [
    ("EULERGEN_COLLECTIVE_TIMEOUT", "-5", "want seconds in (0, 604,800]"),
    ("EULERGEN_COLLECTIVE_TIMEOUT", "nan", "want seconds"),
    ("EULERGEN_COLLECTIVE_TIMEOUT", "1e400", "want seconds"),
    ("EULERGEN_GEMM", "cublass", "want one of auto, lt, cublas (did you mean 'cublas'?)"),
    ("MASTER_PORT", "65536", "want an integer in 1..65,535"),
    ("RANK", "١", "want an integer"),   # a digit, but not ASCII's
])
def test_a_bad_value_is_one_error_naming_the_variable(name, text, says):
    with pytest.raises(EulerError) as err:
        env.get(name, {name: text})
    assert str(err.value).startswith(f"{name}: {text!r}: ") and says in str(err.value)
    assert "\n" not in str(err.value)


def test_values_and_defaults():
    assert env.get("EULERGEN_COLLECTIVE_TIMEOUT", {}) == 300.0
    assert env.get("EULERGEN_COLLECTIVE_TIMEOUT", {"EULERGEN_COLLECTIVE_TIMEOUT": " 2.5"}) == 2.5
    assert env.get("EULERGEN_OPS_PATH", {"EULERGEN_OPS_PATH": "a::b"}) == (
        env.Path("a"), env.Path("b"))
    assert env.get("EULERGEN_CACHE", {"EULERGEN_CACHE": ""}) is None   # empty: the default


def test_a_misspelt_own_variable_is_a_warning_and_a_bad_one_an_error():
    assert env.check_own({"EULERGEN_GEMMS": "lt", "EULERGEN_GEMM": "lt", "HOME": "/"}) == [
        "EULERGEN_GEMMS is not a variable eulergen reads (did you mean 'EULERGEN_GEMM'?)"]
    with pytest.raises(EulerError, match="EULERGEN_LAUNCHER_PID: '0'"):
        env.check_own({"EULERGEN_LAUNCHER_PID": "0"})
