"""A row op's derivation (DESIGN.md, "Row ops: reverse mode in two passes"): reverse mode
over the small DAG of per-element expressions and row reductions, with every partial taken
by sympy on the per-element expression; and what the row kernels may do besides (sums that
join their stabilizer's pass, sums that are one column's value). The row kind's
(generator/kinds/row.py)."""
from __future__ import annotations

import numpy as np
import sympy as sp

from eulergen.errors import EulerError
from eulergen.generator import ir
from eulergen.generator.differentiate import Temps, diff, grad, jvp, names
from eulergen.generator.numeric import compile_exprs
from eulergen.generator.opspec import OpSpec, symbol


def derive_row(spec: OpSpec, temps: Temps) -> tuple[ir.RowDerived, tuple[ir.Operand, ...],
                                                    tuple[ir.Operand, ...]]:
    """(body, inputs, outputs) of a row op."""
    elem_names = {i.name for i in spec.inputs if i.role in ("row", "weight")} | {"i"}
    red = {r.name: r for r in spec.reductions}
    stab = set(spec.stabilizers)
    n_sym = symbol("N")
    scale = {r.name: (1 / n_sym if r.op == "mean" else sp.S.One) for r in spec.reductions}

    # Forward: reductions grouped by level (a reduction needs every one it reads done).
    level: dict[str, int] = {}
    for r in spec.reductions:
        level[r.name] = 1 + max((level[n] for n in names(r.expr) if n in red), default=-1)
    passes = []
    for lv in sorted(set(level.values())):
        group = [r for r in spec.reductions if level[r.name] == lv]
        body = temps.code([(r.name, r.expr) for r in group])
        passes.append(ir.Pass(ops=tuple((r.name, r.op) for r in group), body=body))
    elem_out = [o for o in spec.outputs if names(o.expr) & elem_names]
    row_out = [o for o in spec.outputs if not names(o.expr) & elem_names]
    elem_outputs = temps.code([(o.name, o.expr) for o in elem_out])
    row_outputs = temps.code([(o.name, o.expr) for o in row_out])
    if stab:
        _check_stabilizers(spec)

    # Backward, step 1: the row sums each reduction adjoint needs, in one pass.
    live = [r for r in spec.reductions if r.name not in stab]
    sums: list[tuple[str, sp.Expr]] = []
    adjoint: dict[str, sp.Expr] = {}
    # A sum's row-constant factor is taken out of it: Σ c·f = c·Σ f, one multiply a row, and
    # a sum of f alone may read fewer reductions (log-softmax's Σ dy: none; softmax's
    # Σ dy·exp(x - m): not z), so that the row kernels can form it in an earlier sweep.
    varying = [symbol(n) for n in elem_names] + [grad(o.name) for o in elem_out]

    def row_sum(name: str, term: sp.Expr) -> sp.Expr:
        factor, per_elem = term.as_independent(*varying, as_Add=False)
        sums.append((name, per_elem))
        return factor * symbol(name)
    for j, rj in reversed(list(enumerate(live))):
        wrt = symbol(rj.name)
        total = sp.Add(*(grad(o.name) * diff(o.expr, wrt, spec, o.where) for o in row_out))
        per_elem = jvp(spec, elem_out, wrt)
        if per_elem != 0:
            total += row_sum(f"sum_d{rj.name}", per_elem)
        for rk in live[j + 1:]:
            term = diff(rk.expr, wrt, spec, rk.where)
            closed = _closed_sum(term, spec, elem_names, n_sym)
            if closed is not None:
                total += adjoint[rk.name] * scale[rk.name] * closed
            elif term != 0:
                total += adjoint[rk.name] * scale[rk.name] * row_sum(f"sum_{rk.name}_d{rj.name}", term)
        adjoint[rj.name] = total  # later adjoints inlined: each result stands alone
    _refuse_clashes(spec, [n for n, _ in sums])
    adjoint_pass = None
    if sums:
        adjoint_pass = ir.Pass(ops=tuple((n, "sum") for n, _ in sums), body=temps.code(sums))
    adjoints = temps.code([("d" + r.name, adjoint[r.name]) for r in live])

    # Step 2: per element, d<input> from the output adjoints and the reduction adjoints.
    grads = []
    for inp in spec.inputs:
        if inp.role == "index":
            continue
        x = symbol(inp.name)
        g = jvp(spec, elem_out, x)
        for r in live:
            g += grad(r.name) * scale[r.name] * diff(r.expr, x, spec, r.where)
        grads.append(("d" + inp.name, g))
    elem_grads = temps.code(grads)

    body = ir.RowDerived(passes=tuple(passes), stabilizers=tuple(spec.stabilizers),
                         elem_outputs=elem_outputs, row_outputs=row_outputs,
                         adjoint_pass=adjoint_pass, adjoints=adjoints, elem_grads=elem_grads,
                         online=_online(spec, temps, elem_names),
                         picks=_picks(spec, temps))
    inputs = tuple(ir.Operand(i.name, i.role, differentiable=i.role != "index")
                   for i in spec.inputs)
    outputs = tuple(ir.Operand(o.name, "row" if o in elem_out else "scalar")
                    for o in spec.outputs)
    return body, inputs, outputs


def _closed_sum(term: sp.Expr, spec: OpSpec, elem_names: set[str],
                n_sym: sp.Symbol) -> sp.Expr | None:
    """The row sum of `term` in closed form, when the term is affine in the per-element
    symbols and each one it reads has a forward reduction summing exactly it: Σ(a + b·x) =
    N·a + b·Σx. LayerNorm's ∂var/∂mu sums to 0 that way (Σ -2(x - mu) with mu = mean(x)):
    no pass, and an exact 0 rather than a rounded one. None when it has no closed form."""
    elems = [symbol(n) for n in sorted(elem_names) if n != "i" and symbol(n) in term.free_symbols]
    if not elems:
        return None if term.has(symbol("i")) else n_sym * term
    try:
        poly = sp.Poly(sp.expand(term), *elems)
    except sp.PolynomialError:
        return None
    if poly.total_degree() > 1 or any(c.has(symbol("i")) for c in poly.coeffs()):
        return None
    total = n_sym * poly.coeff_monomial(1)
    for x in elems:
        by = next((r for r in spec.reductions if r.op in ("sum", "mean")
                   and sp.expand(r.expr - x) == 0), None)
        if by is None:
            return None
        total += poly.coeff_monomial(x) * (n_sym * symbol(by.name) if by.op == "mean"
                                           else symbol(by.name))
    return sp.simplify(total)


def _online(spec: OpSpec, temps: Temps, elem_names: set[str]) -> tuple[ir.Online, ...]:
    """The sums that may be accumulated in their stabilizer's pass (ir.Online): each reads
    one reduction, a stabilizer max of a bare row input x, and its term rescales by a factor
    free of the element symbols and vanishes as x → -inf (params at their defaults: the
    sign of a temperature decides it)."""
    red = {r.name: r for r in spec.reductions}
    out = []
    for r in spec.reductions:
        reads = names(r.expr) & set(red)
        if r.op not in ("sum", "mean") or len(reads) != 1:
            continue
        (m,) = reads
        x = red[m].expr
        if m not in spec.stabilizers or not isinstance(x, sp.Symbol) or x.name not in elem_names:
            continue
        factor = _rescale_factor(r.expr, symbol(m), elem_names)
        at = {symbol(m): 0} | {symbol(p.name): p.default for p in spec.params
                               if p.default is not None}
        if factor is not None and _vanishes_below(r.expr.subs(at), x):
            out.append(ir.Online(name=r.name, op=r.op, max=m,
                                 term=temps.code([(r.name, r.expr)]), factor=factor))
    return tuple(out)


def _picks(spec: OpSpec, temps: Temps) -> tuple[ir.Pick, ...]:
    """The sums of where(i == s, e, 0), s an index input and e free of reductions."""
    index = {i.name for i in spec.inputs if i.role == "index"}
    reductions = {r.name for r in spec.reductions}
    i = symbol("i")
    out = []
    for r in spec.reductions:
        e = r.expr
        if r.op != "sum" or not isinstance(e, sp.Piecewise) or len(e.args) != 2:
            continue
        (value, cond), (other, always) = e.args
        if other != 0 or always != sp.true or not isinstance(cond, sp.Eq):
            continue
        s = ({cond.lhs, cond.rhs} - {i}).pop() if i in (cond.lhs, cond.rhs) else None
        if isinstance(s, sp.Symbol) and s.name in index and not names(value) & reductions:
            out.append(ir.Pick(name=r.name, index=s.name, value=temps.code([(r.name, value)])))
    return tuple(out)


def _rescale_factor(term: sp.Expr, m: sp.Symbol, elem_names: set[str]) -> sp.Expr | None:
    """f(a, b) = term(m = b) / term(m = a) when it is free of the element symbols, else None."""
    a, b = symbol(ir.RESCALE_FROM), symbol(ir.RESCALE_TO)
    ratio = sp.simplify(sp.powsimp(term.subs(m, b) / term.subs(m, a)))
    if names(ratio) & elem_names or not ratio.has(a, b) or ratio.has(sp.nan, sp.zoo):
        return None
    return ratio


def _vanishes_below(term: sp.Expr, x: sp.Symbol) -> bool:
    try:
        return sp.limit(term, x, -sp.oo) == 0
    except (NotImplementedError, ValueError, TypeError):
        return False


def _refuse_clashes(spec: OpSpec, generated: list[str]) -> None:
    declared = ({i.name for i in spec.inputs} | {p.name for p in spec.params}
                | {r.name for r in spec.reductions} | {o.name for o in spec.outputs})
    clash = sorted(declared & set(generated))
    if clash:
        raise EulerError(f"'{clash[0]}' is the name of a generated row sum; rename it",
                         file=spec.where.file, line=spec.where.line)


def _check_stabilizers(spec: OpSpec) -> None:
    """A stabilizer gets no gradient, which is right only if the outputs do not depend on
    it: evaluate the op with each stabilizer shifted and compare."""
    rng = np.random.default_rng(1)
    base = _row_eval(spec, rng, shifts={})
    for name in spec.stabilizers:
        shifted = _row_eval(spec, np.random.default_rng(1), shifts={name: 1.375})
        for out, a, b in zip(spec.outputs, base, shifted):
            err = np.max(np.abs(a - b) / np.maximum(np.abs(a), 1.0))
            if not err < 1e-9:
                where = next(r.where for r in spec.reductions if r.name == name)
                raise where.error(f"'{name}' is listed as a stabilizer, but output "
                                  f"'{out.name}' changes when it shifts (by {err:.1e}); "
                                  "a stabilizer must cancel out")


def _row_eval(spec: OpSpec, rng, shifts: dict[str, float], rows: int = 3, n: int = 9):
    """The forward of a row op in float64, straight from the spec's expressions."""
    values = {}
    for inp in spec.inputs:
        if inp.role == "index":
            values[inp.name] = rng.integers(0, n, size=(rows, 1)).astype(np.float64)
        else:
            lo, hi = spec.domain_of(inp.name)
            values[inp.name] = rng.uniform(lo, hi, size=(rows, n) if inp.role == "row" else (n,))
    values.update({p.name: (p.default if p.default is not None else 0.5) for p in spec.params})
    values["i"] = np.arange(n, dtype=np.float64)
    values["N"] = float(n)
    for r in spec.reductions:
        fn = compile_exprs([r.expr], list(values))
        term = np.broadcast_to(fn(**values)[0], (rows, n))
        op = {"sum": np.sum, "mean": np.mean, "max": np.max}[r.op]
        values[r.name] = op(term, axis=-1, keepdims=True) + shifts.get(r.name, 0.0)
    fn = compile_exprs([o.expr for o in spec.outputs], list(values))
    return [np.broadcast_to(v, (rows, n)) for v in fn(**values)]
