"""The numpy printer writes small integer powers as products, as the CUDA printer does:
numpy 2 has a fast path for x**2 only, and a float32 x**3 through pow costs as much as the
rest of a CPU training step."""
from __future__ import annotations

import numpy as np
import pytest
import sympy as sp

from eulergen.generator.printer import numpy_expr

x, y = sp.symbols("x y", real=True)


@pytest.mark.parametrize("expr, text", [
    (x**2, "x*x"),
    (x**3, "x*x*x"),
    (x**4, "x*x*x*x"),
    (x**-1, "1.0/x"),
    (x**-3, "1.0/(x*x*x)"),
    (y * x**-2, "y/(x*x)"),
    ((x + 1)**2, "(x + 1.0)**2"),            # a compound base: one evaluation, np.square
    ((x + 1)**3, "(x + 1.0)**2*(x + 1.0)"),
    ((x + 1)**-3, "1.0/((x + 1.0)**2*(x + 1.0))"),
    ((x + 1)**sp.Rational(-3, 2), "1.0/((x + 1.0)*np.sqrt(x + 1.0))"),
    (x**7, "x**7"),
])
def test_small_powers_are_products(expr, text):
    assert numpy_expr(expr) == text


@pytest.mark.parametrize("expr", [x**3 - 2 * x**-3, (x + y)**4 / (x**2 + 1)**3,
                                  (x**2 + y**2)**sp.Rational(-5, 2), x * (x + 1)**-4])
def test_expanded_powers_compute_the_expression(expr):
    rng = np.random.default_rng(0)
    env = {"x": rng.uniform(0.5, 2.0, 64), "y": rng.uniform(-2.0, 2.0, 64), "np": np}
    got = eval(numpy_expr(expr), env)  # noqa: S307 - printer output under test
    want = sp.lambdify((x, y), expr, "numpy")(env["x"], env["y"])
    np.testing.assert_allclose(got, want, rtol=1e-12)
    x32 = {**env, "x": env["x"].astype(np.float32), "y": env["y"].astype(np.float32)}
    assert eval(numpy_expr(expr), x32).dtype == np.float32  # noqa: S307
