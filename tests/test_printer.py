"""The CUDA and numpy printers: exact fp32 forms, and numpy text that computes the math."""
from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest
import sympy as sp
from sympy.codegen.cfunctions import log1p

from eulergen.generator import ir
from eulergen.generator.primitives import logsumexp, sigmoid, softplus
from eulergen.generator.printer import (cuda_expr, numpy_expr, numpy_helpers, numpy_imports,
                                        print_cuda, print_numpy)

x, y, z = sp.symbols("x y z", real=True)

# Expressions covering every construct the printers handle, with their values at sample points.
EXPRESSIONS = [
    sp.Rational(1, 2) * x * (1 + sp.tanh(sp.sqrt(2 / sp.pi) * (x + sp.Rational("0.044715") * x**3))),
    x * y / sp.sqrt(z**2 + 1),
    1 / (z**2 + 1) + (z**2 + 1)**-2 + (x**2 + 1)**-3,
    (z**2 + 1) ** sp.Rational(3, 2) + sp.sqrt(z**2 + 1) + (z**2 + 1) ** sp.Rational(-5, 2),
    sp.Max(x, 0) + sp.Min(y, 0, x) - sp.Abs(z),
    sp.Heaviside(x, 0) + 2 * sp.Heaviside(y, 1) + 3 * sp.Heaviside(z),
    sigmoid(x) * (1 - sigmoid(y)) + softplus(z),
    logsumexp(x, y, z) + sp.exp(x - logsumexp(x, y)),
    sp.erf(x / sp.sqrt(2)) + log1p(z**2) + sp.log(z**2 + 1),
    sp.sin(x) * sp.cos(y) - sp.pi * sp.exp(-x**2),
    sp.Piecewise((x, sp.Eq(y, z)), (y, x < z), (0, True)),
    -(x + y) ** 2 / (3 * (z**2 + 2)),
    sp.sign(x) * y,
]


def _numpy_eval(expr, env):
    lines = [f"r = {numpy_expr(expr)}"]
    src = "\n".join(numpy_imports(lines) + numpy_helpers(lines) + lines)
    scope = dict(env)
    exec(compile(src, "<printed>", "exec"), scope)
    return scope["r"]


@pytest.mark.parametrize("expr", EXPRESSIONS, ids=lambda e: str(e)[:40])
def test_numpy_printer_computes_the_expression(expr):
    rng = np.random.default_rng(0)
    pts = rng.uniform(-2, 2, size=(3, 20))
    pts[:, :3] = [[0.0, 1.0, -1.5], [0.0, 1.0, 0.5], [0.0, 1.0, -1.5]]  # ties and zeros
    got = np.broadcast_to(_numpy_eval(expr, dict(x=pts[0], y=pts[1], z=pts[2])), pts[0].shape)
    want = [float(expr.subs({x: a, y: b, z: c}).rewrite(sp.exp).evalf(30))
            for a, b, c in pts.T.tolist()]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_numpy_printer_keeps_float32_and_is_stable_at_extremes():
    v = np.array([-1e4, -80.0, 0.0, 80.0, 1e4], dtype=np.float32)
    for expr in (sigmoid(x), softplus(x), logsumexp(x, -x), sp.erf(x), sp.Heaviside(x, 0) * x,
                 sp.Piecewise((x, x > 0), (0, True))):
        r = _numpy_eval(expr, {"x": v})
        assert r.dtype == np.float32, f"{expr}: {r.dtype}"
        assert np.isfinite(r).all(), f"{expr}: {r}"


@pytest.mark.parametrize("expr,text", [
    (x**2, "x*x"),
    (x**3, "x*x*x"),
    (1 / x, "1.0f/x"),
    (x**-2, "1.0f/(x*x)"),
    (sp.sqrt(x), "sqrtf(x)"),
    (1 / sp.sqrt(x), "rsqrtf(x)"),
    (x**sp.Rational(3, 2), "x*sqrtf(x)"),
    (x**sp.Rational(-3, 2), "rsqrtf(x)/x"),
    (x**sp.Rational(-5, 2), "rsqrtf(x)/(x*x)"),
    (x**sp.Rational(1, 3), "powf(x, 0.3333333333333333f)"),
    (x**y, "powf(x, y)"),
    (sp.Rational("0.044715") * x, "0.044715f*x"),
    (sp.sqrt(2 / sp.pi) * x, "0.7978845608028654f*x"),
    (sp.pi * x, "3.141592653589793f*x"),
    (sp.Max(x, 0), "fmaxf(x, 0.0f)"),
    (sp.Heaviside(x, 0), "(x > 0.0f ? 1.0f : 0.0f)"),
    (sp.Heaviside(x, 1), "(x >= 0.0f ? 1.0f : 0.0f)"),
    (sp.Piecewise((x, sp.Eq(y, z)), (0, True)), "(y == z ? x : 0.0f)"),
    (sigmoid(x), "eg_sigmoid(x)"),
    (softplus(x), "eg_softplus(x)"),
    (logsumexp(x, y, z), "eg_logaddexp(eg_logaddexp(x, y), z)"),
    (sp.And(y <= x, x - y < 4), "y <= x && x - y < 4.0f"),
    (x - y - 2, "x - y - 2.0f"),
])
def test_cuda_printer_forms(expr, text):
    assert cuda_expr(expr) == text


def test_cuda_printer_emits_no_double():
    for expr in EXPRESSIONS:
        text = cuda_expr(expr)
        assert "M_PI" not in text and "double" not in text
        assert not re.search(r"\b(exp|log|tanh|erf|sqrt|pow|sin|cos|fabs|fmax|fmin|log1p)\(", text), text
        # every numeric literal carries the f suffix
        for lit in re.findall(r"(?<![\w.])\d+\.?\d*(?:e[+-]?\d+)?f?", text):
            assert lit.endswith("f"), f"double literal {lit!r} in {text}"


def test_print_cuda_declares_temps_and_results_or_assigns_for_updates():
    code = ir.Code(temps=(ir.Assign("t0", x * y),), results=(ir.Assign("m", x + sp.Symbol("t0")),))
    assert print_cuda(code) == ["const float t0 = x*y;", "const float m = t0 + x;"]
    assert print_cuda(code, declare_results=False) == ["const float t0 = x*y;", "m = t0 + x;"]
    assert print_numpy(code) == ["t0 = x*y", "m = t0 + x"]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_printed_cuda_compiles_for_sm90_without_f64(tmp_path):
    helpers = """
__device__ __forceinline__ float eg_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float eg_softplus(float x) { return fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x))); }
__device__ __forceinline__ float eg_logaddexp(float a, float b) {
  float m = fmaxf(a, b); return m + log1pf(expf(-fabsf(a - b))); }
"""
    # CUDA's own sinf/cosf use f64 in their large-argument range reduction: not ours to test.
    exprs = [e for e in EXPRESSIONS if not e.has(sp.sin, sp.cos)]
    body = "\n".join(f"  r += {cuda_expr(e)};" for e in exprs)
    src = helpers + ('extern "C" __global__ void k(const float* in, float* out) {\n'
                     "  const float x = in[0], y = in[1], z = in[2];\n  float r = 0.0f;\n"
                     f"{body}\n  out[0] = r;\n}}\n")
    (tmp_path / "k.cu").write_text(src)
    subprocess.run(["nvcc", "-arch=sm_90", "--ptx", "k.cu", "-o", "k.ptx"], cwd=tmp_path,
                   check=True, capture_output=True)
    ptx = (tmp_path / "k.ptx").read_text()
    assert ".f64" not in ptx, "fp32 expression compiled to double-precision instructions"
