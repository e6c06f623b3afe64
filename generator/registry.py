"""The op kinds the generator knows, by name: each one module of generator/kinds/, whose
`OpKind` every stage asks (spec.load_spec, derive, check, plan_ops, render, numpy_module,
build). A new kind is its module, its line here and its templates."""
from __future__ import annotations

from eulergen.errors import EulerError
from eulergen.generator.kinds import (attention, bf16, draw, embedding, moves, pair, pointwise,
                                      row, step_control, update)
from eulergen.generator.kinds.base import OpKind

KINDS: dict[str, OpKind] = {k.name: k for k in (
    pointwise.KIND, row.KIND, pair.KIND, update.KIND, attention.KIND, embedding.KIND,
    step_control.KIND, draw.KIND, bf16.KIND, moves.KIND)}


def kind(name: str) -> OpKind:
    try:
        return KINDS[name]
    except KeyError:
        raise EulerError(f"unknown op kind {name!r} (expected one of {', '.join(KINDS)})",
                         key="kind") from None


def spec_kinds() -> list[OpKind]:
    """The kinds written as YAML specs, in the registry's order."""
    return [k for k in KINDS.values() if k.spec]


def template_kinds() -> list[OpKind]:
    """The kinds without a spec: each one op, named after it, from its templates alone."""
    return [k for k in KINDS.values() if not k.spec]
