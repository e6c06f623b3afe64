"""OpSpec → DerivedOp: every backward pass, derived by sympy and CSE'd.

Pointwise and pair ops are one Jacobian-vector product per input. Row ops are reverse mode
over the small DAG of per-element expressions and row reductions (DESIGN.md, "Row ops"),
with every partial taken on the per-element expression. Update and attention ops need no
backward beyond ∂score/∂s. CSE temporaries are numbered t0, t1, … across the whole op, so
codes printed into one kernel never collide.
"""
from __future__ import annotations

import functools

import numpy as np
import sympy as sp

from eulergen.errors import EulerError, Where
from eulergen.generator import ir
from eulergen.generator.numeric import compile_exprs, random_inputs
from eulergen.generator.spec import OpSpec, symbol


def derive(spec: OpSpec) -> ir.DerivedOp:
    return _derive(spec)


@functools.lru_cache(maxsize=None)
def _derive(spec: OpSpec) -> ir.DerivedOp:
    for f in _differentiated(spec):
        if spec.kink is None and f.expr.has(sp.Max, sp.Min, sp.Abs):
            raise f.where.error("max/min/abs have a kink at 0; declare the value of their "
                                "step there, e.g. `kink: 0` (as PyTorch)")
    temps = _Temps()
    kind = spec.kind
    if kind == "pointwise":
        body, inputs, outputs = _pointwise(spec, temps)
    elif kind == "row":
        body, inputs, outputs = _row(spec, temps)
    elif kind == "pair":
        body, inputs, outputs = _pair(spec, temps)
    elif kind == "update":
        body, inputs, outputs = _update(spec, temps)
    else:
        body, inputs, outputs = _attention(spec)
    return ir.DerivedOp(name=spec.name, kind=kind, inputs=inputs, outputs=outputs,
                        params=spec.params, body=body, where=spec.where,
                        spec_sha256=spec.sha256, fast_math=spec.fast_math)


def _differentiated(spec: OpSpec):
    """The formulas a backward pass differentiates (update steps are not)."""
    yield from spec.outputs
    yield from spec.reductions
    yield from (f for f in (spec.score,) if f is not None)


# Common pieces ------------------------------------------------------------------------------

class _Temps:
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
                                     lambda e: e.is_number or bool(_names(e) & fixed))
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


def _names(expr: sp.Basic) -> set[str]:
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


def _d(name: str) -> sp.Symbol:
    return symbol("d" + name)


def _diff(expr: sp.Expr, wrt: sp.Symbol, spec: OpSpec, where: Where) -> sp.Expr:
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


def _jvp(spec: OpSpec, outputs, wrt: sp.Symbol) -> sp.Expr:
    """Σ_outputs d<out>·∂out/∂wrt."""
    return sp.Add(*(_d(o.name) * _diff(o.expr, wrt, spec, o.where) for o in outputs))


# Pointwise ----------------------------------------------------------------------------------

def _pointwise(spec: OpSpec, temps: _Temps):
    forward = temps.code([(o.name, o.expr) for o in spec.outputs])
    grads = {"d" + i.name: _jvp(spec, spec.outputs, symbol(i.name)) for i in spec.inputs}
    for f in spec.backward:
        _check_override(spec, f, grads[f.name])
        grads[f.name] = f.expr
    backward = temps.code(list(grads.items()))
    inputs = tuple(ir.Operand(i.name, "elem") for i in spec.inputs)
    outputs = tuple(ir.Operand(o.name, "elem") for o in spec.outputs)
    return ir.PointwiseDerived(forward=forward, backward=backward), inputs, outputs


def _check_override(spec: OpSpec, f, derived: sp.Expr) -> None:
    """An explicit backward must agree with the derived one on the op's domain."""
    names = [i.name for i in spec.inputs] + ["d" + o.name for o in spec.outputs]
    names += [p.name for p in spec.params]
    fn = compile_exprs([f.expr, derived], names)
    rng = np.random.default_rng(0)
    values = random_inputs(spec, names, rng, 64)
    got, want = (np.broadcast_to(v, (64,)) for v in fn(**values))
    err = np.max(np.abs(got - want) / np.maximum(np.abs(want), 1.0))
    if not err < spec.tolerance:
        raise f.where.error(f"explicit backward disagrees with the derived one "
                            f"(max relative error {err:.2e} > {spec.tolerance:g})")


# Pair -------------------------------------------------------------------------------------

def _pair(spec: OpSpec, temps: _Temps):
    forward = temps.code([(o.name, o.expr) for o in spec.outputs])
    grads = []
    for i in spec.inputs:
        for half in "01":
            grads.append((f"d{i.name}{half}", _jvp(spec, spec.outputs, symbol(i.name + half))))
    backward = temps.code(grads)
    out_names = dict.fromkeys(o.name[:-1] for o in spec.outputs)
    inputs = tuple(ir.Operand(i.name, "pair") for i in spec.inputs)
    outputs = tuple(ir.Operand(n, "pair") for n in out_names)
    return ir.PairDerived(index=spec.index, forward=forward, backward=backward), inputs, outputs


# Update ----------------------------------------------------------------------------------

def _update(spec: OpSpec, temps: _Temps):
    updated = frozenset(f.name for f in spec.update)
    step = temps.code([(f.name, f.expr) for f in spec.update], fixed=updated)
    inputs = tuple(ir.Operand(i.name, i.role, differentiable=False) for i in spec.inputs)
    outputs = tuple(ir.Operand(f.name, "state", differentiable=False) for f in spec.update)
    return ir.UpdateDerived(step=step), inputs, outputs


# Attention ---------------------------------------------------------------------------------

def _attention(spec: OpSpec):
    dscore = _diff(spec.score.expr, symbol("s"), spec, spec.score.where)
    body = ir.AttentionDerived(score=spec.score.expr, dscore=dscore,
                               mask=spec.mask.expr if spec.mask else None)
    inputs = (ir.Operand("q", "q"), ir.Operand("k", "k"), ir.Operand("v", "v"))
    return body, inputs, (ir.Operand("o", "o"),)


# Row ----------------------------------------------------------------------------------------

def _row(spec: OpSpec, temps: _Temps):
    elem_names = {i.name for i in spec.inputs if i.role in ("row", "weight")} | {"i"}
    red = {r.name: r for r in spec.reductions}
    stab = set(spec.stabilizers)
    n_sym = symbol("N")
    scale = {r.name: (1 / n_sym if r.op == "mean" else sp.S.One) for r in spec.reductions}

    # Forward: reductions grouped by level (a reduction needs every one it reads done).
    level: dict[str, int] = {}
    for r in spec.reductions:
        level[r.name] = 1 + max((level[n] for n in _names(r.expr) if n in red), default=-1)
    passes = []
    for lv in sorted(set(level.values())):
        group = [r for r in spec.reductions if level[r.name] == lv]
        body = temps.code([(r.name, r.expr) for r in group])
        passes.append(ir.Pass(ops=tuple((r.name, r.op) for r in group), body=body))
    elem_out = [o for o in spec.outputs if _names(o.expr) & elem_names]
    row_out = [o for o in spec.outputs if not _names(o.expr) & elem_names]
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
    # Σ dy·exp(x - m): not z), so that render_row can form it in an earlier sweep.
    varying = [symbol(n) for n in elem_names] + [_d(o.name) for o in elem_out]

    def row_sum(name: str, term: sp.Expr) -> sp.Expr:
        factor, per_elem = term.as_independent(*varying, as_Add=False)
        sums.append((name, per_elem))
        return factor * symbol(name)
    for j, rj in reversed(list(enumerate(live))):
        wrt = symbol(rj.name)
        total = sp.Add(*(_d(o.name) * _diff(o.expr, wrt, spec, o.where) for o in row_out))
        per_elem = _jvp(spec, elem_out, wrt)
        if per_elem != 0:
            total += row_sum(f"sum_d{rj.name}", per_elem)
        for rk in live[j + 1:]:
            term = _diff(rk.expr, wrt, spec, rk.where)
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
        g = _jvp(spec, elem_out, x)
        for r in live:
            g += _d(r.name) * scale[r.name] * _diff(r.expr, x, spec, r.where)
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


def _online(spec: OpSpec, temps: _Temps, elem_names: set[str]) -> tuple[ir.Online, ...]:
    """The sums that may be accumulated in their stabilizer's pass (ir.Online): each reads
    one reduction, a stabilizer max of a bare row input x, and its term rescales by a factor
    free of the element symbols and vanishes as x → -inf (params at their defaults: the
    sign of a temperature decides it)."""
    red = {r.name: r for r in spec.reductions}
    out = []
    for r in spec.reductions:
        reads = _names(r.expr) & set(red)
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


def _picks(spec: OpSpec, temps: _Temps) -> tuple[ir.Pick, ...]:
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
        if isinstance(s, sp.Symbol) and s.name in index and not _names(value) & reductions:
            out.append(ir.Pick(name=r.name, index=s.name, value=temps.code([(r.name, value)])))
    return tuple(out)


def _rescale_factor(term: sp.Expr, m: sp.Symbol, elem_names: set[str]) -> sp.Expr | None:
    """f(a, b) = term(m = b) / term(m = a) when it is free of the element symbols, else None."""
    a, b = symbol(ir.RESCALE_FROM), symbol(ir.RESCALE_TO)
    ratio = sp.simplify(sp.powsimp(term.subs(m, b) / term.subs(m, a)))
    if _names(ratio) & elem_names or not ratio.has(a, b) or ratio.has(sp.nan, sp.zoo):
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

