"""What the tests that render an op share: the op with its plan, as build.py hands both to
render.render_op."""
from eulergen.generator import plan_ops


def planned(op):
    return op, plan_ops.plan_op(op)
