"""The text of an op's generated C (generated/c/<op>.c: docs/internals.md, "Generated C"),
as each kind with a C printer assembles it (generator/kinds/): the header, the includes,
the helpers its formulas call, then its functions; and the pieces those are printed from.

Every formula of the spec becomes one element function over floats named as the spec names
them (`gelu_y(float x)`), under a comment that spells the formula out; the kind's functions
(`gelu_forward`, whose signature is a CFunction the manifest records) loop over the
operands and call them. Compute is fp32, as in the kernels; names the loops add end in `_`,
as the CUDA templates' do, so that they never meet a spec's name.
"""
from __future__ import annotations

import re
import textwrap

from eulergen.errors import EulerError
from eulergen.generator import ir
from eulergen.generator.c_printer import c_helpers, print_c
from eulergen.signature import CFunction


def source(header: str, about: str, functions: list[str], includes: tuple[str, ...] = ()) -> str:
    """The file: `header` (emit.header's line), `about` (what the op is and the layout its
    functions take, as a comment), the helpers `functions` call, then `functions`."""
    helpers = c_helpers(functions)
    if re.search(r"\b(bool|true|false)\b", "\n".join(functions)):
        includes = ("stdbool.h", *includes)
    parts = [[f"// {header}", "//", *(f"// {line}" for line in textwrap.wrap(about, 88)),
              *(f"#include <{h}>" for h in ("math.h", *includes))]]
    if helpers:
        parts.append(helpers)
    parts.append(functions)
    return "\n\n".join("\n".join(p) for p in parts).rstrip("\n") + "\n"


def spelled(code: ir.Code, name: str) -> str:
    """Result `name` of `code` as one formula, its temporaries substituted back."""
    temps = {a.name: a.expr for a in code.temps}
    expr = code.result(name)
    while subs := {s: temps[s.name] for s in expr.free_symbols if s.name in temps}:
        expr = expr.xreplace(subs)
    return f"{name} = {expr}"


def element(op: ir.DerivedOp, fname: str, code: ir.Code, result: str, order: list[str],
            ctype: str = "float") -> list[str]:
    """`static inline float <fname>(float …)`: result `result` of `code`, its arguments the
    names it reads in `order`'s order, under a comment naming the op and its formula
    (`ctype`: what it returns, bool for a predicate)."""
    one = code.only([result])
    uses = one.uses
    missing = sorted(uses - set(order))
    if missing:
        raise EulerError(f"{result} reads {', '.join(missing)}, which the C printer's loop does "
                         "not give", file=op.where.file, line=op.where.line)
    args = ", ".join(f"float {n}" for n in order if n in uses) or "void"
    *body, last = print_c(one)
    value = last.split(" = ", 1)[1].rstrip(";")
    return [f"/* {op.name}: {spelled(code, result)} */",
            f"static inline {ctype} {fname}({args}) {{",
            *(f"  {line}" for line in body),
            f"  return {value};",
            "}", ""]


def call(fname: str, code: ir.Code, result: str, order: list[str], values: dict) -> str:
    """The call of `element(…, fname, code, result, order)` with each argument's value
    (`values`: name -> C expression; a name missing stands for itself)."""
    uses = code.only([result]).uses
    return f"{fname}({', '.join(values.get(n, n) for n in order if n in uses)})"


def opening(fn: CFunction) -> str:
    return f"void {fn.name}({fn.c_params}) {{"


def floats(op: ir.DerivedOp) -> tuple[tuple[str, str], ...]:
    """The op's params as a function's float parameters."""
    return tuple((p.name, "float") for p in op.params)


def pointers(op: ir.DerivedOp, reads, writes) -> tuple[tuple[str, str], ...]:
    """`const float*` for each name read (`const int*` for an index input), `float*` for
    each written."""
    index = {o.name for o in op.inputs if o.role == "index"}
    return (tuple((n, "const int*" if n in index else "const float*") for n in reads)
            + tuple((n, "float*") for n in writes))
