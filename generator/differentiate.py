"""The derivation's tools, shared by every kind's derivation (generator/kinds/, derive_row.py):
CSE into `ir.Code` with temporaries t0, t1, … numbered across one op (so codes printed into
one kernel never collide), a partial derivative that honours the spec's declared kink, and
the Jacobian-vector product Σ d<out>·∂out/∂x."""
from __future__ import annotations

import sympy as sp

from eulergen.errors import Where
from eulergen.generator import ir
from eulergen.generator.opspec import OpSpec, symbol


class Temps:
    """CSE with temporaries t0, t1, … numbered across one op."""

    def __init__(self):
        self.count = 0

    def code(self, results: list[tuple[str, sp.Expr]], *, fixed: frozenset[str] = frozenset()) -> ir.Code:
        """CSE `results` into an ir.Code. A temporary that reads any name in `fixed` is
        inlined back: update ops overwrite those names, and temps are computed first."""
        exprs = [sp.sympify(e) for _, e in results]
        raw_temps, reduced = sp.cse(exprs, symbols=sp.numbered_symbols("_cse", real=True),
                                    order="none")
        # Constants such as sqrt(2/pi) print as one literal; a temporary for them only hides it.
        raw_temps, reduced = _inline(raw_temps, reduced,
                                     lambda e: e.is_number or bool(names(e) & fixed))
        rename = {}
        temps = []
        for sym, expr in raw_temps:
            new = symbol(f"t{self.count}")
            self.count += 1
            rename[sym] = new
            temps.append(ir.Assign(new.name, expr.xreplace(rename)))
        return ir.Code(temps=tuple(temps),
                       results=tuple(ir.Assign(name, e.xreplace(rename))
                                     for (name, _), e in zip(results, reduced)))


def names(expr: sp.Basic) -> set[str]:
    return {s.name for s in expr.free_symbols}


def _inline(temps, reduced, inline):
    """Substitute back the temporaries for which inline(expr) holds."""
    keep, subs = [], {}
    for sym, expr in temps:
        expr = expr.xreplace(subs)
        if inline(expr):
            subs[sym] = expr
        else:
            keep.append((sym, expr))
    return keep, [e.xreplace(subs) for e in reduced]


def grad(name: str) -> sp.Symbol:
    """The symbol of a name's gradient, d<name>."""
    return symbol("d" + name)


def diff(expr: sp.Expr, wrt: sp.Symbol, spec: OpSpec, where: Where) -> sp.Expr:
    out = sp.diff(expr, wrt)
    if out.has(sp.Derivative, sp.Subs):
        raise where.error(f"sympy could not differentiate with respect to {wrt}: {out}")
    if out.has(sp.DiracDelta):
        raise where.error("the derivative contains a Dirac delta (a step inside a "
                          "differentiated formula); rewrite it with where()")
    steps = out.atoms(sp.Heaviside)
    if steps:
        if spec.kink is None:
            raise where.error("the derivative has a step at 0; declare its value there, "
                              "e.g. `kink: 0`")
        k = sp.Rational(repr(spec.kink))
        out = out.xreplace({h: sp.Heaviside(h.args[0], k) for h in steps})
    return out


def jvp(spec: OpSpec, outputs, wrt: sp.Symbol) -> sp.Expr:
    """Σ_outputs d<out>·∂out/∂wrt."""
    return sp.Add(*(grad(o.name) * diff(o.expr, wrt, spec, o.where) for o in outputs))
