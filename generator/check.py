"""`eulergen check`: each op's derived backward against central differences, and a float32
sweep of extreme inputs, run through the op's generated numpy module (generator/gradcheck.py
says how). The op's kind checks it: update ops have no backward, so their step is checked
against a float64 sequential evaluation of the spec's formulas instead; attention ops check
∂score/∂s.
"""
from __future__ import annotations

import click

from eulergen.errors import EulerError, suggest
from eulergen.generator import registry
from eulergen.generator.derive import derive
from eulergen.generator.gradcheck import Row
from eulergen.generator.numpy_module import load_module_from_source, render_numpy_module
from eulergen.generator.ops_path import find_ops
from eulergen.generator.opspec import OpSpec
from eulergen.generator.spec import load_spec


def run_check(names=(), ops_dirs=()) -> int:
    ops = find_ops(ops_dirs)
    for name in names:
        if name not in ops:
            raise EulerError(f"unknown op '{name}'{suggest(name, ops)}")
    rows: list[Row] = []
    for name in names or sorted(ops):
        try:
            rows += check_op(load_spec(ops[name]))
        except EulerError as err:
            rows.append(Row(name, "-", None, f"error: {err}", False))
    _print(rows)
    return 0 if all(r.ok for r in rows) else 1


def _print(rows: list[Row]) -> None:
    click.echo(f"{'op':<20} {'input':<8} {'max rel err':>11}  {'float32 extremes':<28} result")
    for r in rows:
        err = "-" if r.error is None else f"{r.error:.2e}"
        click.echo(f"{r.op:<20} {r.input:<8} {err:>11}  {r.extremes:<28} {'ok' if r.ok else 'FAIL'}")
    failed = sum(not r.ok for r in rows)
    click.echo(f"{len(rows) - failed} passed, {failed} failed")


def check_op(spec: OpSpec) -> list[Row]:
    derived = derive(spec)
    mod = load_module_from_source(spec.name, render_numpy_module(derived))
    return registry.kind(spec.kind).check(spec, derived, mod)
