"""Rendering of row ops: a RowPlan (generator/plan_row.py) printed through
templates/row.cu.j2. Every choice is the plan's; this only prints."""
from __future__ import annotations

from eulergen.generator import ir
from eulergen.generator.emit import render_template
from eulergen.generator.plan_row import RowPlan


def render_row(op: ir.DerivedOp, plan: RowPlan, header_line: str) -> ir.RenderedCuda:
    """The .cu text of a row op and its kernel signatures, in the plan's order."""
    source = render_template(plan.template, header=header_line, plan=plan,
                             rescale_from=ir.RESCALE_FROM, rescale_to=ir.RESCALE_TO)
    return ir.RenderedCuda(source, plan.signatures)
