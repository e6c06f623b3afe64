"""What a row op's autocast kernels (generator/plan_row.py, precision signature.AUTOCAST)
store in which type: a norm-shaped op's kernels again, each pointer of its own storage type,
as torch.autocast stores them. The op's row input (the residual stream), the sum the `add`
fusion writes, their gradients and the weights are float32; the branch, the outputs and
their gradients bf16; the backward also writes dx rounded to bf16 (signature.bf16_copy),
the operand of the GEMMs that read the stream's gradient."""
from __future__ import annotations

from eulergen.errors import EulerError
from eulergen.generator import fuse, ir
from eulergen.generator.plan import CTYPE
from eulergen.generator.row_schedule import RowNames
from eulergen.signature import bf16_copy

AUTOCAST_DTYPES = ("bf16",)   # an fp32 kernel keeps every operand in float32 already


def storage_of(o: RowNames, precision: str):
    """storage(name, default) -> the C type an operand is stored as, given the one it has in
    the op's own kernels ('T': the kernel's dtype); in the autocast precision float32 for
    the stream, its gradients and the weights, bf16 for the other 'T' operands."""
    if not precision:
        return lambda name, default: default
    x = o.rows_in[0]   # an `add`-shaped op's one row input (add_forward's branch follows it)
    wide = {x, f"d{x}", fuse.STREAM, f"d{fuse.STREAM}", *o.weights}

    def storage(name: str, default: str) -> str:
        if default != "T":
            return default
        return "float" if name in wide else CTYPE["bf16"]
    return storage


def storage_note(ptrs) -> str:
    """Which pointers of an autocast kernel are float32 and which bf16, for its title."""
    of = {t: [a.name for a in ptrs if a.elem == t and a.role in ("row", "weight", "copy")]
          for t in ("float", CTYPE["bf16"])}
    return f"{', '.join(of['float'])} float32; {', '.join(of[CTYPE['bf16']])} bf16"


def refuse_copy_clash(op: ir.DerivedOp) -> None:
    """An autocast backward's bf16 copy of dx must not take the name of an operand."""
    taken = {o.name for o in op.inputs + op.outputs} | {p.name for p in op.params}
    taken |= {f"d{o.name}" for o in op.inputs + op.outputs}
    clash = sorted(taken & {bf16_copy(f"d{o.name}") for o in op.inputs if o.role == "row"})
    if clash:
        raise EulerError(f"'{clash[0]}' is the name of the bf16 copy an autocast backward "
                         "writes; rename the operand", file=op.where.file, line=op.where.line)
