"""CUDA and numpy printers: sympy expressions (and `ir.Code`) → lines of source.

One small recursive printer per target rather than sympy's code printers, because the
output must be exact about precision: every CUDA literal is a float (`0.5f`), every call a
float intrinsic (`expf`, `rsqrtf`), constants such as sqrt(2/pi) fold to one literal, and
small integer powers are products (`x*x`). The numpy printer writes the same math with
`np.*` and stable forms (`np.logaddexp`), so the reference and the kernels agree.
"""
from __future__ import annotations

from typing import Iterable

import sympy as sp
from sympy.codegen.cfunctions import log1p
from sympy.core.function import Application

from eulergen.errors import EulerError
from eulergen.generator import ir
from eulergen.generator.primitives import logsumexp, sigmoid, softplus

# Precedence of what a printed fragment is, so a parent knows when to parenthesise it.
_TERNARY, _OR, _AND, _CMP, _ADD, _MUL, _NEG, _POW, _ATOM = range(9)

_CMP_OPS = {"==": "==", "!=": "!=", "<": "<", "<=": "<=", ">": ">", ">=": ">="}


class _Printer:
    """The shared walk. Subclasses say how literals, calls and powers look."""

    one: str

    def expr(self, e: sp.Basic) -> str:
        return self._p(e)[0]

    def _p(self, e: sp.Basic) -> tuple[str, int]:
        if e is sp.true or e is sp.false:
            return self.boolean(bool(e)), _ATOM
        if isinstance(e, sp.Symbol):
            return e.name, _ATOM
        if isinstance(e, sp.Expr) and e.is_number:
            return self.number(e)
        if isinstance(e, sp.Add):
            return self._add(e)
        if isinstance(e, sp.Mul):
            return self._mul(e)
        if isinstance(e, sp.Pow):
            return self._pow(e.base, e.exp)
        if isinstance(e, sp.Piecewise):
            return self._piecewise(e)
        if isinstance(e, sp.Rel):
            if e.rel_op not in _CMP_OPS:
                raise EulerError(f"cannot print comparison {e.rel_op!r}")
            a, b = (self._wrap(x, _CMP + 1) for x in e.args)
            return f"{a} {_CMP_OPS[e.rel_op]} {b}", _CMP
        if isinstance(e, (sp.And, sp.Or)):
            return self.logic(e)
        if isinstance(e, sp.ITE):  # a condition on a where(): sympy folds it into if-then-else
            c, a, b = (self.expr(x) for x in e.args)
            return self.select(c, a, b), _ATOM
        if isinstance(e, sp.Not):
            return self.logic(e)
        if isinstance(e, Application):  # Function, and Max/Min, which are not Functions
            return self.call(e), _ATOM
        raise EulerError(f"cannot print {type(e).__name__} ({e})")

    def _wrap(self, e: sp.Basic, need: int) -> str:
        """Print e, in parentheses if it binds looser than `need`."""
        text, prec = self._p(e)
        return f"({text})" if prec < need else text

    def _add(self, e: sp.Add) -> tuple[str, int]:
        # Positive terms first, so `b - a` rather than `-a + b`; numbers last.
        terms = sorted(e.args, key=lambda t: (t.could_extract_minus_sign(), t.is_number))
        out = self._wrap(terms[0], _ADD)
        for t in terms[1:]:
            if t.could_extract_minus_sign():
                out += " - " + self._wrap(-t, _ADD + 1)
            else:
                out += " + " + self._wrap(t, _ADD)
        return out, _ADD

    def _mul(self, e: sp.Mul) -> tuple[str, int]:
        # All numeric factors (2, sqrt(2), 1/sqrt(pi)) fold into one leading literal.
        factors = sp.Mul.make_args(e)
        coeff = sp.Mul(*(f for f in factors if f.is_number))
        if coeff.is_negative:
            return "-" + self._wrap(-e, _MUL), _NEG
        num, den = [], []
        for f in factors:
            if f.is_number:
                continue
            d = self.denominator(f)
            if d is None:
                num.append(f)
            else:
                den.append(d)
        parts = [] if coeff == 1 else [self.number(coeff)[0]]
        parts += [self._wrap(f, _MUL) for f in num]
        text = "*".join(parts) if parts else self.one
        if den:
            dtext, dprec = self._p(sp.Mul(*den))
            text += "/" + (dtext if dprec >= _POW else f"({dtext})")
        return text, _MUL

    divides_by_sqrt = False   # x**(-1/2) factors as a division by sqrt(x), not an rsqrt

    def denominator(self, f: sp.Expr) -> sp.Expr | None:
        """If factor f is best written as a division, what to divide by."""
        if isinstance(f, sp.Pow) and f.exp.is_Integer and f.exp < 0:
            return f.base ** -f.exp
        if self.divides_by_sqrt and isinstance(f, sp.Pow) and f.exp == -sp.S.Half:
            return sp.sqrt(f.base)
        return None

    def _piecewise(self, e: sp.Piecewise) -> tuple[str, int]:
        *branches, (last, cond) = e.args
        if cond is not sp.true:
            raise EulerError(f"where() without an otherwise branch cannot be printed ({e})")
        text = self.expr(last)
        for value, c in reversed(branches):
            text = self.select(self.expr(c), self.expr(value), text)
        return text, _ATOM

    # Subclass interface -------------------------------------------------------------
    def number(self, e: sp.Expr) -> tuple[str, int]:
        raise NotImplementedError

    def boolean(self, value: bool) -> str:
        raise NotImplementedError

    def select(self, cond: str, a: str, b: str) -> str:
        raise NotImplementedError

    def logic(self, e: sp.Basic) -> tuple[str, int]:
        raise NotImplementedError

    def call(self, e: sp.Function) -> str:
        raise NotImplementedError

    def _pow(self, base: sp.Expr, exp: sp.Expr) -> tuple[str, int]:
        raise NotImplementedError


def _numbers_last(args: tuple) -> list:
    """max(x, 0) reads better than max(0, x); sympy sorts numbers first."""
    return sorted(args, key=lambda a: bool(a.is_number))


def _float_value(e: sp.Expr) -> float:
    try:
        value = float(e)
    except TypeError as err:
        raise EulerError(f"constant {e} is not a real number") from err
    if value != value or value in (float("inf"), float("-inf")):
        raise EulerError(f"constant {e} is not finite")
    return value


def _flt(value: float) -> str:
    """A C float literal: shortest round-trip decimal of the double, with an f suffix."""
    if abs(value) > 3.4028234663852886e38:
        raise EulerError(f"constant {value!r} overflows float32")
    return repr(float(value)) + "f"


class CudaPrinter(_Printer):
    one = "1.0f"
    rsqrt = "rsqrtf"   # the C printer's libm has none

    _FUNCS = {sp.exp: "expf", sp.log: "logf", sp.tanh: "tanhf", sp.erf: "erff",
              log1p: "log1pf", sp.sin: "eg_sinf", sp.cos: "eg_cosf", sp.Abs: "fabsf",
              sigmoid: "eg_sigmoid", softplus: "eg_softplus"}

    def number(self, e):
        value = _float_value(e)
        return _flt(value), (_NEG if value < 0 else _ATOM)

    def boolean(self, value):
        return "true" if value else "false"

    def select(self, cond, a, b):
        return f"({cond} ? {a} : {b})"

    def logic(self, e):
        if isinstance(e, sp.Not):
            return "!" + self._wrap(e.args[0], _ATOM), _NEG
        op, prec = ("&&", _AND) if isinstance(e, sp.And) else ("||", _OR)
        return f" {op} ".join(self._wrap(a, prec + 1) for a in e.args), prec

    def call(self, e):
        f = e.func
        if f in self._FUNCS:
            return f"{self._FUNCS[f]}({self.expr(e.args[0])})"
        if f in (sp.Max, sp.Min, logsumexp):
            name = {sp.Max: "fmaxf", sp.Min: "fminf", logsumexp: "eg_logaddexp"}[f]
            text, *rest = [self.expr(a) for a in _numbers_last(e.args)]
            for a in rest:
                text = f"{name}({text}, {a})"
            return text
        if f is sp.Heaviside:
            x = self._wrap(e.args[0], _CMP + 1)
            h0 = _float_value(e.args[1]) if len(e.args) > 1 else 0.5
            if h0 == 0.0:
                return f"({x} > 0.0f ? 1.0f : 0.0f)"
            if h0 == 1.0:
                return f"({x} >= 0.0f ? 1.0f : 0.0f)"
            return f"({x} > 0.0f ? 1.0f : ({x} < 0.0f ? 0.0f : {_flt(h0)}))"
        if f is sp.sign:
            x = self._wrap(e.args[0], _CMP + 1)
            return f"(float)(({x} > 0.0f) - ({x} < 0.0f))"
        raise EulerError(f"no CUDA form for function {f.__name__}")

    def _pow(self, base, exp):
        if base is sp.E:
            return f"expf({self.expr(exp)})", _ATOM
        b = self._wrap(base, _ATOM)
        if exp.is_Integer:
            n = int(exp)
            if 1 <= abs(n) <= 4:
                prod = "*".join([b] * abs(n))
                if n > 0:
                    return prod, (_MUL if n > 1 else _ATOM)
                return f"1.0f/{prod if n == -1 else f'({prod})'}", _MUL
        if exp == sp.S.Half:
            return f"sqrtf({self.expr(base)})", _ATOM
        if exp == -sp.S.Half:
            return f"{self.rsqrt}({self.expr(base)})", _ATOM
        if exp.is_Rational and exp.q == 2 and abs(exp.p) <= 7:
            # x**(±k/2): a square root (or rsqrt) times a small power, not powf:
            # norm backwards hold (var + eps)**(-3/2) in every element's expression.
            whole = abs(exp.p) // 2
            root = f"{'sqrtf' if exp > 0 else self.rsqrt}({self.expr(base)})"
            power = self._wrap(base ** whole, _POW) if whole > 1 else b
            return (f"{power}*{root}" if exp > 0 else f"{root}/{power}"), _MUL
        return f"powf({self.expr(base)}, {self.expr(exp)})", _ATOM


class NumpyPrinter(_Printer):
    """numpy source over arrays of one float dtype. Literals are Python floats, which
    numpy treats as weakly typed, so float32 inputs stay float32."""
    one = "1.0"
    divides_by_sqrt = True

    _FUNCS = {sp.exp: "np.exp", sp.log: "np.log", sp.tanh: "np.tanh", sp.erf: "_erf",
              log1p: "np.log1p", sp.sin: "np.sin", sp.cos: "np.cos", sp.Abs: "np.abs",
              sp.sign: "np.sign", sigmoid: "_sigmoid"}

    def number(self, e):
        value = _float_value(e)
        return repr(value), (_NEG if value < 0 else _ATOM)

    def boolean(self, value):
        return "True" if value else "False"

    def select(self, cond, a, b):
        return f"np.where({cond}, {a}, {b})"

    def logic(self, e):
        if isinstance(e, sp.Not):
            return f"np.logical_not({self.expr(e.args[0])})", _ATOM
        name = "np.logical_and" if isinstance(e, sp.And) else "np.logical_or"
        args = [self.expr(a) for a in e.args]
        text = args[0]
        for a in args[1:]:
            text = f"{name}({text}, {a})"
        return text, _ATOM

    def call(self, e):
        f = e.func
        if f in self._FUNCS:
            return f"{self._FUNCS[f]}({self.expr(e.args[0])})"
        if f is softplus:
            return f"np.logaddexp(0.0, {self.expr(e.args[0])})"
        if f in (sp.Max, sp.Min, logsumexp):
            name = {sp.Max: "np.maximum", sp.Min: "np.minimum", logsumexp: "np.logaddexp"}[f]
            text, *rest = [self.expr(a) for a in _numbers_last(e.args)]
            for a in rest:
                text = f"{name}({text}, {a})"
            return text
        if f is sp.Heaviside:
            h0 = _float_value(e.args[1]) if len(e.args) > 1 else 0.5
            return f"np.heaviside({self.expr(e.args[0])}, {h0!r})"
        raise EulerError(f"no numpy form for function {f.__name__}")

    def _pow(self, base, exp):
        if base is sp.E:
            return f"np.exp({self.expr(exp)})", _ATOM
        if exp == sp.S.Half:
            return f"np.sqrt({self.expr(base)})", _ATOM
        if exp == -sp.S.Half:
            return f"1.0/np.sqrt({self.expr(base)})", _MUL
        b = self._wrap(base, _ATOM)
        if exp.is_Integer:
            n = int(exp)
            # small powers as products, as in CUDA: numpy 2 has a fast path for x**2 only,
            # and x**3 through pow costs as much as the rest of a float32 training step.
            # A compound base is evaluated once per square (b**2 is np.square), not per factor.
            if 1 <= abs(n) <= 4:
                if n in (1, -1):
                    prod, prec = b, _ATOM
                elif isinstance(base, sp.Symbol):
                    prod, prec = "*".join([b] * abs(n)), _MUL
                else:
                    prod, prec = {2: (f"{b}**2", _POW), 3: (f"{b}**2*{b}", _MUL),
                                  4: (f"({b}**2)**2", _POW)}[abs(n)]
                if n > 0:
                    return prod, prec
                return f"1.0/{prod if prec >= _POW else f'({prod})'}", _MUL
            if n < 0:
                return f"1.0/{b}**{-n}", _MUL
            return f"{b}**{n}", _POW
        if exp.is_Rational and exp.q == 2 and abs(exp.p) <= 7:
            # x**(±k/2): a square root times a small power (norm backwards' (var + eps)**-1.5)
            whole = abs(exp.p) // 2
            root = f"np.sqrt({self.expr(base)})"
            power = self._wrap(base ** whole, _POW) if whole > 1 else b
            return (f"{power}*{root}" if exp > 0 else f"1.0/({power}*{root})"), _MUL
        return f"{b}**{self._wrap(exp, _ATOM)}", _POW


_CUDA = CudaPrinter()
_NUMPY = NumpyPrinter()

_CUDA_TYPES = {"f32": "float", "bf16": "float"}  # storage may be bf16; compute is fp32


def cuda_expr(expr: sp.Basic) -> str:
    """One expression as fp32 CUDA (attention's score and mask use this)."""
    return _CUDA.expr(expr)


def numpy_expr(expr: sp.Basic) -> str:
    """One expression as numpy source; see `numpy_helpers` for the helpers it may call."""
    return _NUMPY.expr(expr)


def print_cuda(code: ir.Code, dtype: str = "f32", *, declare_results: bool = True) -> list[str]:
    """`const float t0 = …;` for each temporary, then the results. Update ops pass
    declare_results=False: their results assign locals the template declared."""
    if dtype not in _CUDA_TYPES:
        raise EulerError(f"unknown compute dtype {dtype!r} (expected one of {sorted(_CUDA_TYPES)})")
    ctype = _CUDA_TYPES[dtype]
    lines = [f"const {ctype} {a.name} = {cuda_expr(a.expr)};" for a in code.temps]
    decl = f"const {ctype} " if declare_results else ""
    lines += [f"{decl}{a.name} = {cuda_expr(a.expr)};" for a in code.results]
    return lines


def print_numpy(code: ir.Code) -> list[str]:
    return [f"{a.name} = {numpy_expr(a.expr)}" for a in code.temps + code.results]


# Helpers the numpy printer may call, defined where a generated module uses them.
_NUMPY_HELPERS = {
    "_sigmoid": [
        "def _sigmoid(x):",
        '    """1 / (1 + exp(-x)) without overflow for either sign of x."""',
        "    return np.exp(-np.logaddexp(0.0, -x))",
    ],
    "_erf": [
        "def _erf(x):",
        '    """erf to double precision (numpy has none; math.erf is exact), in the dtype of x."""',
        "    x = np.asarray(x)",
        "    dtype = x.dtype if x.dtype.kind == 'f' else np.float64",
        "    return np.vectorize(math.erf, otypes=[dtype])(x)",
    ],
}


def numpy_helpers(lines: Iterable[str]) -> list[str]:
    """Definitions of the helpers that `lines` call, in a fixed order, blank-line separated.
    `_erf` needs `import math` at the top of the module (see `numpy_imports`)."""
    text = "\n".join(lines)
    out: list[str] = []
    for name, body in _NUMPY_HELPERS.items():
        if f"{name}(" in text:
            out += body + [""]
    return out


def numpy_imports(lines: Iterable[str]) -> list[str]:
    text = "\n".join(lines)
    return ["import math", "import numpy as np"] if "_erf(" in text else ["import numpy as np"]
