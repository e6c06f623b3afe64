"""Property: any formula built from the whitelist differentiates correctly — the generated
backward agrees with central differences of the generated forward, in float64."""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from eulergen.errors import EulerError
from eulergen.generator.derive import derive
from eulergen.generator.numpy_module import load_module_from_source, render_numpy_module
from eulergen.generator.spec import load_spec

# Pieces wrapped so that values stay moderate on [-2, 2]. max/min/where put kinks and
# jumps at places that depend on the formula; the sample points are fixed and hypothesis
# is derandomized, so a formula whose kink sits within eps of a point cannot come and go.
# max's second argument is offset so that it never ties its first over a whole region
# (there each side gets `kink` times its gradient, by the declared convention).
LEAVES = st.sampled_from(["x", "y", "0.5", "1.5", "2"])
UNARY = ["exp(tanh({}))", "sigmoid({})", "softplus({})", "tanh({})", "sin({})", "cos({})",
         "erf({})", "sqrt(1 + ({})**2)", "log(1 + ({})**2)", "log1p(({})**2)", "-({})",
         "({})**2", "({})**3", "abs(1 + ({})**2)"]
BINARY = ["({}) + ({})", "({}) - ({})", "({})*({})", "({})/(1.5 + ({})**2)",
          "logsumexp({}, {})", "min(2 + ({})**2, 1 + ({})**2)", "max({}, 0.25 + {})",
          "where({} > 0.5, {}, 1)"]


def formulas():
    return st.recursive(
        LEAVES,
        lambda inner: st.one_of(
            st.builds(lambda f, a: f.format(a), st.sampled_from(UNARY), inner),
            st.builds(lambda f, a, b: f.format(a, b), st.sampled_from(BINARY), inner, inner)),
        max_leaves=6)


def load(text: str):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "prop.yaml"
        path.write_text(f"name: prop\nkind: pointwise\ninputs: [x, y]\nkink: 0\n"
                        f"outputs:\n  out: \"{text}\"\ndomain: {{x: [-2, 2], y: [-2, 2]}}\n")
        try:
            derived = derive(load_spec(path))
        except EulerError as err:
            # Formulas that fold to 1/0 (x/(x - x)) are refused, rightly: not this property.
            if "divides by zero" in str(err) or "not a real expression" in str(err):
                reject()
            raise
    return load_module_from_source("prop", render_numpy_module(derived))


@settings(max_examples=100, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(formulas())
def test_random_whitelist_formula_differentiates_correctly(text):
    mod = load(text)
    rng = np.random.default_rng(0)
    x, y = rng.uniform(-2, 2, (2, 50))
    dout = rng.uniform(-1, 1, 50)
    dx, dy = mod.backward(x, y, dout)
    eps = 1e-5
    for got, (plus, minus) in [(dx, ((x + eps, y), (x - eps, y))),
                               (dy, ((x, y + eps), (x, y - eps)))]:
        want = dout * (mod.forward(*plus) - mod.forward(*minus)) / (2 * eps)
        # Rounding in f(x ± eps) is ~1e-16·|f|/eps; 1e-6·|f| keeps a gradient that small
        # (erf near 1) from failing on noise.
        scale = max(np.max(np.abs(want)) * 1e-2, 1e-6 * np.max(np.abs(mod.forward(x, y))), 1e-9)
        err = np.max(np.abs(got - want) / np.maximum(np.abs(want), scale))
        assert err < 1e-4, f"{text}: max relative error {err:.2e}"
