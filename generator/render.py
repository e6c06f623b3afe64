"""The render stage: a DerivedOp and its plan (plan_ops.plan_op) → the CUDA text of one op
(`ir.RenderedCuda`), printed by its kind (generator/kinds/) through its templates.

The plan has made every choice: the stages, their pointer operands, the kernel signatures
and their launch geometry. Rendering prints: it hands the templates finished lines from the
CUDA printer, the names each line reads (so a template declares only the locals a formula
uses), and the signatures, whose parameter lists the templates print.
"""
from __future__ import annotations

from eulergen.generator import ir, registry


def template_of(op: ir.DerivedOp) -> str:
    """The template file an op renders through, as headers and the manifest name it."""
    return registry.kind(op.kind).template_label


def render_op(op: ir.DerivedOp, plan, header_line: str) -> ir.RenderedCuda:
    """The .cu text of one op, printed from its plan, and the plan's kernel signatures (the
    manifest's `kernels`)."""
    return registry.kind(op.kind).render(op, plan, header_line)
