"""Numerically stable primitives as sympy Functions.

sympy's own forms (1/(1 + exp(-x)), log(1 + exp(x))) overflow in float32 and, worse,
differentiate into expressions that do. These Functions keep their identity through
`diff`, so derived backward passes stay in stable form (sigmoid' = sigmoid·(1 − sigmoid),
softplus' = sigmoid, ∂logsumexp/∂a_k = exp(a_k − logsumexp)) and the printers map each
one to a stable implementation. erf and tanh are sympy's own; log1p is sympy.codegen's.
"""
from __future__ import annotations

import sympy as sp
from mpmath.libmp import prec_to_dps
from sympy.codegen.cfunctions import log1p

__all__ = ["sigmoid", "softplus", "logsumexp", "log1p"]


class sigmoid(sp.Function):
    """1 / (1 + exp(-x))."""
    nargs = 1

    @classmethod
    def eval(cls, x):
        if x.is_zero:
            return sp.S.Half
        return None

    def fdiff(self, argindex=1):
        s = sigmoid(self.args[0])
        return s * (1 - s)

    def _eval_is_real(self):
        return self.args[0].is_real

    def _eval_rewrite_as_exp(self, x, **kwargs):
        return 1 / (1 + sp.exp(-x))

    def _eval_evalf(self, prec):
        return _evalf(self._eval_rewrite_as_exp(*self.args), prec)


class softplus(sp.Function):
    """log(1 + exp(x))."""
    nargs = 1

    def fdiff(self, argindex=1):
        return sigmoid(self.args[0])

    def _eval_is_real(self):
        return self.args[0].is_real

    def _eval_rewrite_as_exp(self, x, **kwargs):
        return sp.log(1 + sp.exp(x))

    def _eval_evalf(self, prec):
        return _evalf(self._eval_rewrite_as_exp(*self.args), prec)


class logsumexp(sp.Function):
    """log(exp(a_1) + … + exp(a_n)), any n ≥ 1 (printed as nested log-add-exp)."""

    @classmethod
    def eval(cls, *args):
        if len(args) == 0:
            raise TypeError("logsumexp takes at least one argument")
        if len(args) == 1:
            return args[0]
        return None

    def fdiff(self, argindex=1):
        return sp.exp(self.args[argindex - 1] - self)

    def _eval_is_real(self):
        return all(a.is_real for a in self.args) or None

    def _eval_rewrite_as_exp(self, *args, **kwargs):
        return sp.log(sp.Add(*(sp.exp(a) for a in args)))

    def _eval_evalf(self, prec):
        return _evalf(self._eval_rewrite_as_exp(*self.args), prec)


def _evalf(explicit: sp.Expr, prec: int) -> sp.Expr:
    """Numeric value through the explicit form built from this call's own arguments
    (`rewrite(exp)` would also rewrite the arguments: sin into complex exponentials)."""
    return explicit.evalf(prec_to_dps(prec))

