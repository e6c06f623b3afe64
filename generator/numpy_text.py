"""The text of a generated numpy module (docs/internals.md, "Generated numpy modules"), as
every kind assembles it (generator/kinds/): the header and the constants, the support its
functions share, the helpers the printer's functions need, then the kind's functions; and
the pieces those functions are printed from.

Generated functions compute in the float dtype of their inputs and return their results in
fresh arrays of the op's shape, or in the arrays `_out=` gives (a formula may reduce to a
constant or to one of its inputs, `db = dy`, so a result is never a view of an input):
callers may write into what they get back.
"""
from __future__ import annotations

from eulergen.generator import ir
from eulergen.generator.emit import numpy_header
from eulergen.generator.numpy_cse import shared
from eulergen.generator.printer import numpy_helpers, numpy_imports, print_numpy

# The support blocks the kinds' functions share. Every function takes `_out=` (a spec's names
# never start with _, so it is no operand's or parameter's): None, or a tuple holding an
# array (or None) per result, which the result is written into.
DTYPE = '''\
def _dtype(*arrays):
    """The float dtype to compute in: that of the float inputs (float64 if none are)."""
    floats = [a.dtype for a in arrays if a.dtype.kind == "f"]
    return np.result_type(*floats) if floats else np.dtype(np.float64)
'''

INTO = '''\
def _into(out, n, shape, dtype):
    """Where result n goes: out[n], which must have the result's shape, or a new array
    where `out` gives none."""
    given = None if out is None else out[n]
    if given is None:
        return np.empty(shape, dtype)
    if given.shape != tuple(shape):
        raise ValueError(f"out[{n}] has shape {given.shape}, the result {tuple(shape)}")
    return given
'''

FRESH = '''\
def _fresh(value, shape, dtype, out=None, n=0):
    """value as result n: written into out[n] or a new array of the given shape and dtype."""
    into = _into(out, n, shape, dtype)
    into[...] = value
    return into
'''

LAYOUT = (DTYPE, INTO, FRESH)


def module(derived: ir.DerivedOp, functions: list[str], *, grads: bool = True,
           constants: tuple[str, ...] = (), support: tuple[str, ...] = LAYOUT) -> str:
    """The module text: `functions` (lines), after the constants (KIND, INPUTS, OUTPUTS,
    PARAMS, GRADS: none unless `grads`; then `constants`) and the `support` blocks."""
    lines = [
        f"KIND = {derived.kind!r}",
        f"INPUTS = {tuple(o.name for o in derived.inputs)!r}",
        f"OUTPUTS = {tuple(o.name for o in derived.outputs)!r}",
        f"PARAMS = {dict((p.name, p.default) for p in derived.params)!r}",
        f"GRADS = {tuple(o.name for o in derived.inputs if o.differentiable and grads)!r}",
        *constants]
    head = "\n".join([numpy_header(derived),
                      f'"""{derived.name}: numpy reference, generated from its spec."""', "",
                      *numpy_imports(functions), "", *lines])
    blocks = [head, *support, "\n".join(numpy_helpers(functions)), "\n".join(functions)]
    return "\n\n\n".join(b.strip("\n") for b in blocks if b.strip()) + "\n"


def signature(fname: str, args: list[str], params: tuple[ir.Param, ...],
              extra: tuple[str, ...] = ()) -> str:
    kw = [p.name if p.default is None else f"{p.name}={p.default!r}" for p in params]
    kw += list(extra)
    return f"def {fname}({', '.join(args + (['*'] + kw if kw else []))}):"


def code(c: ir.Code) -> list[str]:
    return ["    " + line for line in print_numpy(c)]


def body(lines: list[str]) -> list[str]:
    """A function's straight-line statements (`name = expr`, indented), each repeated
    subexpression computed once (numpy_cse), across the codes they were printed from."""
    return ["    " + line for line in shared([line.strip() for line in lines])]


def returns(values: list[str]) -> str:
    return "    return " + (values[0] if len(values) == 1 else "(" + ", ".join(values) + ")")
