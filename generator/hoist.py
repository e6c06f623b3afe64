"""Invariant code motion: the parts of a per-element expression that do not vary across a
kernel's sweep are computed once before it. Row kernels: what depends only on per-row values
(reductions, params, N, per-row inputs) once per row. Pair kernels: what depends only on the
index symbols and params (cos θ, sin θ of RoPE) once per (token, k), for all heads.

A row kernel evaluates its element code for every column; terms such as `1/z`,
`rsqrt(var + eps)` or `dvar/N` are the same in all of them, and a division or a square
root per element costs more instructions than the bf16 kernels can spend and stay at copy
bandwidth. Products and sums are split into their varying and invariant factors or terms
(so `-dy*exp(x - m)/(z*z)` becomes `r*dy*exp(x - m)` with `r = -1/(z*z)` once per row):
a reassociation that moves results by float32 rounding only.
"""
from __future__ import annotations

from itertools import count
from typing import Iterator

import sympy as sp

from eulergen.generator import ir


def row_constant_names(prefix: str = "r") -> Iterator[str]:
    """Names for hoisted values, `r0_, r1_, …`: the trailing underscore keeps them apart from
    spec names, as for every other template local."""
    return (f"{prefix}{n}_" for n in count())


def _cheap(e: sp.Basic) -> bool:
    """Not worth a row constant: a symbol, a number, or a negated symbol."""
    if not e.free_symbols or isinstance(e, sp.Symbol):
        return True
    return (isinstance(e, sp.Mul) and len(e.args) == 2 and e.args[0] == -1
            and isinstance(e.args[1], sp.Symbol))


def hoist(codes: list[ir.Code], varying: set[str],
          names: Iterator[str]) -> tuple[ir.Code, list[ir.Code]]:
    """(per-row code, the element codes rewritten to read it). `varying`: the names that
    differ between the elements of a row (row operands, weights, `i`; for a pair kernel the
    loaded operands and the head index); every temporary or result computed from one of
    them varies too. `codes` run in order in one element's
    scope, so a later one may read an earlier one's names."""
    element = set(varying)
    row: list[ir.Assign] = []
    made: dict[sp.Basic, sp.Symbol] = {}
    subs: dict[str, sp.Basic] = {}     # a per-row temporary: what reads it reads instead

    def varies(e: sp.Basic) -> bool:
        return any(s.name in element for s in e.free_symbols)

    def constant(e: sp.Basic) -> sp.Basic:
        if _cheap(e) or not isinstance(e, sp.Expr):
            return e
        if e not in made:
            made[e] = sp.Symbol(next(names), real=True)
            row.append(ir.Assign(made[e].name, e))
        return made[e]

    def rewrite(e: sp.Basic) -> sp.Basic:
        if not varies(e):
            return constant(e)
        if isinstance(e, (sp.Add, sp.Mul)):
            fixed = [a for a in e.args if not varies(a)]
            parts = [rewrite(a) for a in e.args if varies(a)]
            if fixed:
                parts.insert(0, constant(e.func(*fixed)))
            return e.func(*parts)
        if not e.args:
            return e
        return e.func(*(rewrite(a) for a in e.args))

    def moved(e: sp.Basic) -> sp.Basic:
        return e.xreplace({s: subs[s.name] for s in e.free_symbols if s.name in subs})

    out = []
    for code in codes:
        temps = []
        for a in code.temps:
            expr = moved(a.expr)
            if varies(expr):
                temps.append(ir.Assign(a.name, rewrite(expr)))
                element.add(a.name)
            else:
                subs[a.name] = constant(expr)
        results = []
        for a in code.results:
            results.append(ir.Assign(a.name, rewrite(moved(a.expr))))
            element.add(a.name)
        out.append(ir.Code(tuple(temps), tuple(results)))
    return ir.Code((), tuple(row)), out
