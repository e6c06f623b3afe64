"""OpSpec → DerivedOp: every backward pass, derived by sympy and CSE'd, by the op's kind
(generator/kinds/): pointwise and pair ops are one Jacobian-vector product per input, row
ops reverse mode over their reductions (generator/derive_row.py), update and attention ops
need no backward beyond ∂score/∂s. The tools they share: generator/differentiate.py.
"""
from __future__ import annotations

import functools

import sympy as sp

from eulergen.generator import ir, registry
from eulergen.generator.differentiate import Temps
from eulergen.generator.opspec import OpSpec


def derive(spec: OpSpec) -> ir.DerivedOp:
    return _derive(spec)


@functools.lru_cache(maxsize=None)
def _derive(spec: OpSpec) -> ir.DerivedOp:
    for f in _differentiated(spec):
        if spec.kink is None and f.expr.has(sp.Max, sp.Min, sp.Abs):
            raise f.where.error("max/min/abs have a kink at 0; declare the value of their "
                                "step there, e.g. `kink: 0` (as PyTorch)")
    body, inputs, outputs = registry.kind(spec.kind).derive(spec, Temps())
    return ir.DerivedOp(name=spec.name, kind=spec.kind, inputs=inputs, outputs=outputs,
                        params=spec.params, body=body, where=spec.where,
                        spec_sha256=spec.sha256, fast_math=spec.fast_math)


def _differentiated(spec: OpSpec):
    """The formulas a backward pass differentiates (update steps are not)."""
    yield from spec.outputs
    yield from spec.reductions
    yield from (f for f in (spec.score,) if f is not None)
