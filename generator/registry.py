"""The op kinds the generator knows, by name: each one module of generator/kinds/, whose
`OpKind` every stage asks (spec.load_spec, derive, check, plan_ops, render, numpy_module,
build). A new kind is its module, its line here and its templates.

A kind's module is imported when the kind is first asked for: building one edited op
imports its own kind's planner and printers, not every kind's (row and attention bring
large ones)."""
from __future__ import annotations

from importlib import import_module

from eulergen.errors import EulerError
from eulergen.generator.kinds.base import OpKind

# The built-in kinds, in the registry's order; each the name of its module in kinds/.
NAMES = ("pointwise", "row", "pair", "update", "attention", "embedding",
         "step_control", "draw", "bf16", "moves", "gemv")
KINDS: dict[str, OpKind] = {}   # the kinds imported so far, by name (a test adds its own)


def names() -> tuple[str, ...]:
    """Every kind's name, in the registry's order, without importing any."""
    return tuple(dict.fromkeys((*NAMES, *KINDS)))


def kind(name: str) -> OpKind:
    found = KINDS.get(name)
    if found is None:
        if name not in NAMES:
            raise EulerError(f"unknown op kind {name!r} (expected one of {', '.join(names())})",
                             key="kind")
        found = KINDS[name] = import_module(f"eulergen.generator.kinds.{name}").KIND
    return found


def _all() -> list[OpKind]:
    return [kind(n) for n in names()]


def spec_kinds() -> list[OpKind]:
    """The kinds written as YAML specs, in the registry's order."""
    return [k for k in _all() if k.spec]


def template_kinds() -> list[OpKind]:
    """The kinds without a spec: each one op, named after it, from its templates alone."""
    return [k for k in _all() if not k.spec]
