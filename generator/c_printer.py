"""The C printer: the CUDA printer's fp32 forms as portable C99 (libm's float functions),
for the C functions `eulergen export-c`'s CPU build runs (generated/c/<op>.c).

CUDA's device intrinsics have no libm twin: rsqrtf is 1/sqrtf (a factor x**(-1/2) a
division by sqrtf, as the numpy printer writes it), eg_sinf and eg_cosf (fp32 range
reduction, for NVRTC's sake) are libm's sinf and cosf, and the printer's stable primitives
are static functions defined, as templates/common.cuh.j2 defines them, at the top of the
file that calls them (`c_helpers`).
"""
from __future__ import annotations

from typing import Iterable

import sympy as sp

from eulergen.generator import ir
from eulergen.generator.printer import CudaPrinter


class CPrinter(CudaPrinter):
    rsqrt = "eg_rsqrtf"
    divides_by_sqrt = True   # as the numpy reference does: `eulergen sample` on the CPU
    _FUNCS = {**CudaPrinter._FUNCS, sp.sin: "sinf", sp.cos: "cosf"}


_C = CPrinter()

# Helpers the C printer may call, in a fixed order.
_HELPERS = {
    "eg_sigmoid": [
        "static inline float eg_sigmoid(float x) {",
        "  const float e = expf(-fabsf(x));   /* exp of a non-positive number: never overflows */",
        "  return x >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);",
        "}"],
    "eg_softplus": [
        "static inline float eg_softplus(float x) {",
        "  return fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x)));",
        "}"],
    "eg_logaddexp": [
        "static inline float eg_logaddexp(float a, float b) {",
        "  if (a == b) return a + 0.693147180559945309f;   /* two equal infinities too */",
        "  return fmaxf(a, b) + log1pf(expf(-fabsf(a - b)));",
        "}"],
    "eg_rsqrtf": ["static inline float eg_rsqrtf(float x) { return 1.0f / sqrtf(x); }"],
}


def c_expr(expr: sp.Basic) -> str:
    return _C.expr(expr)


def print_c(code: ir.Code) -> list[str]:
    """`const float t0 = …;` for each temporary, then each result."""
    return [f"const float {a.name} = {c_expr(a.expr)};" for a in code.temps + code.results]


def c_helpers(lines: Iterable[str]) -> list[str]:
    """Definitions of the helpers that `lines` call."""
    text = "\n".join(lines)
    return [line for name, body in _HELPERS.items() if f"{name}(" in text for line in body]
