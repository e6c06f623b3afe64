"""Numbers from sympy expressions, for checks inside the generator: expressions compiled
through the numpy printer (so they run the exact code the numpy backend runs), and random
points in an op's declared domain."""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import sympy as sp

from eulergen.generator.printer import numpy_expr, numpy_helpers, numpy_imports


def compile_exprs(exprs: Sequence[sp.Basic], names: Sequence[str]) -> Callable[..., list]:
    """A function of keyword arrays `names` returning the value of each expression."""
    lines = [f"    r{n} = {numpy_expr(e)}" for n, e in enumerate(exprs)]
    results = ", ".join(f"r{n}" for n in range(len(exprs)))
    head = numpy_imports(lines) + numpy_helpers(lines)
    src = "\n".join(head + [f"def _f({', '.join(names)}):"] + lines
                    + [f"    return [{results}]"])
    scope: dict = {}
    exec(compile(src, "<eulergen expressions>", "exec"), scope)  # our printer's text only
    fn = scope["_f"]
    return lambda **values: fn(**{k: values[k] for k in names})


def random_inputs(spec, names: Sequence[str], rng: np.random.Generator, n: int) -> dict:
    """float64 samples for `names`: inputs uniform in their domain, output gradients
    uniform in [-1, 1], params at their defaults (runtime params at 0.5)."""
    params = {p.name: (p.default if p.default is not None else 0.5) for p in spec.params}
    out = {}
    for name in names:
        if name in params:
            out[name] = params[name]
        elif name.startswith("d") and any(o.name == name[1:] for o in spec.outputs):
            out[name] = rng.uniform(-1.0, 1.0, n)
        else:
            lo, hi = spec.domain_of(name)
            out[name] = rng.uniform(lo, hi, n)
    return out
