"""The plan stage: an op's every per-kernel choice (stages, pointer operands, signatures,
launch geometry) as a frozen value, made by its kind (generator/kinds/) before anything is
rendered; the numbers come from generator/plan.py."""
from __future__ import annotations

from eulergen.generator import ir, registry


def plan_op(op: ir.DerivedOp):
    """The plan of an op of a kind with specs (a StagePlan-based OpPlan, a RowPlan, an
    AttentionPlan…), whose kernels are KernelSigs."""
    return registry.kind(op.kind).plan(op)
