"""The CUDA printer computes the same numbers as the numpy printer: every code block of
every shipped op, printed as CUDA, compiled as host C++ (the expressions are plain C with
float intrinsics) and run on sample points, against the numpy text in float64.

This catches what compiling alone cannot: precedence, operand order, ternary forms."""
from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from eulergen.generator import ir
from eulergen.generator.derive import derive
from eulergen.generator.printer import numpy_helpers, numpy_imports, print_cuda, print_numpy
from eulergen.generator.ops_path import find_ops
from eulergen.generator.spec import load_spec

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")

# Host stand-ins for the device helpers templates/common.cuh.j2 defines.
PRELUDE = r"""
#include <math.h>
#include <stdio.h>
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline float eg_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
static inline float eg_softplus(float x) { return fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x))); }
static inline float eg_logaddexp(float a, float b) {
  float m = fmaxf(a, b); return m + log1pf(expf(-fabsf(a - b))); }
static inline float eg_sinf(float x) { return sinf(x); }
static inline float eg_cosf(float x) { return cosf(x); }
"""
INTEGER_NAMES = {"i": 3, "target": 3, "pos": 5, "k": 2}   # index symbols: small integers
SIZE_NAMES = {"N": 8, "D": 8}
SAMPLES = 16


RUNTIME_VALUES = {"lr": 1e-3, "step": 3.0}


def blocks():
    """(label, code, declare_results, params) for every code block of every
    non-attention op; params at their defaults (runtime ones at typical values)."""
    for name, path in sorted(find_ops().items()):
        d = derive(load_spec(path))
        params = {p.name: p.default if p.default is not None else RUNTIME_VALUES.get(p.name, 0.5)
                  for p in d.params}
        b = d.body
        if isinstance(b, (ir.PointwiseDerived, ir.PairDerived)):
            yield f"{name}.forward", b.forward, True, params
            yield f"{name}.backward", b.backward, True, params
        elif isinstance(b, ir.RowDerived):
            passes = list(b.passes) + ([b.adjoint_pass] if b.adjoint_pass else [])
            for n, p in enumerate(passes):
                yield f"{name}.pass{n}", p.body, True, params
            for field in ("elem_outputs", "row_outputs", "adjoints", "elem_grads"):
                yield f"{name}.{field}", getattr(b, field), True, params
        elif isinstance(b, ir.UpdateDerived):
            yield f"{name}.step", b.step, False, params


def inputs_of(code: ir.Code) -> list[str]:
    defined = {a.name for a in code.temps}
    names = set()
    for a in code.temps + code.results:
        names |= {s.name for s in a.expr.free_symbols}
    return sorted(names - defined - ({a.name for a in code.results} - names))


def sample(names: list[str], params: dict, rng) -> np.ndarray:
    cols = []
    for n in names:
        if n in params:
            cols.append(np.full(SAMPLES, float(params[n])))
        elif n in INTEGER_NAMES:
            cols.append(rng.integers(0, INTEGER_NAMES[n] + 1, SAMPLES).astype(float))
        elif n in SIZE_NAMES:
            cols.append(np.full(SAMPLES, float(SIZE_NAMES[n])))
        else:
            cols.append(rng.uniform(0.5, 2.0, SAMPLES))
    # exactly representable in float32, so both sides start from the same numbers
    return np.array(cols).T.reshape(SAMPLES, len(names)).astype(np.float32).astype(np.float64)


def test_cuda_and_numpy_printers_agree_on_every_shipped_op(tmp_path):
    rng = np.random.default_rng(0)
    cases, data = [], []
    for label, code, declare, params in blocks():
        names = inputs_of(code)
        cases.append((label, code, declare, names))
        data.append(sample(names, params, rng))

    src = [PRELUDE]
    for n, ((label, code, declare, names), values) in enumerate(zip(cases, data)):
        src.append(f"// {label}")
        src.append(f"static void case{n}(const float* in, float* out) {{")
        qualifier = "const float " if declare else "float "
        src += [f"  {qualifier}{v} = in[{k}];" for k, v in enumerate(names)]
        if not declare:  # update results assign existing locals; make the untouched ones exist
            src += [f"  float {a.name} = 0.0f;" for a in code.results if a.name not in names]
        src += ["  " + line for line in print_cuda(code, declare_results=declare)]
        src += [f"  out[{k}] = {a.name};" for k, a in enumerate(code.results)] + ["}"]
    src.append("int main() {\n  float out[16];")
    for n, values in enumerate(data):
        rows = ", ".join("{" + ", ".join(f"{float(v)!r}f" for v in row) + "}" for row in values)
        width = max(values.shape[1], 1)
        src.append(f"  {{ static const float in[{SAMPLES}][{width}] = {{{rows or '{0}'}}};")
        src.append(f"    for (int s = 0; s < {SAMPLES}; ++s) {{ case{n}(in[s], out);")
        src.append(f'      for (int r = 0; r < {len(cases[n][1].results)}; ++r) '
                   'printf("%.9g ", out[r]); printf("\\n"); } }')
    src.append("  return 0;\n}")
    (tmp_path / "p.cpp").write_text("\n".join(src))
    subprocess.run(["g++", "-O0", "-o", "p", "p.cpp"], cwd=tmp_path, check=True,
                   capture_output=True)
    lines = subprocess.run([str(tmp_path / "p")], check=True, capture_output=True,
                           text=True).stdout.splitlines()

    for n, ((label, code, _, names), values) in enumerate(zip(cases, data)):
        numpy_lines = print_numpy(code)
        prelude = "\n".join(numpy_imports(numpy_lines) + numpy_helpers(numpy_lines))
        for s in range(SAMPLES):
            scope = dict(zip(names, values[s]))
            exec(compile(prelude + "\n" + "\n".join(numpy_lines), label, "exec"), scope)
            want = np.array([float(scope[a.name]) for a in code.results])
            got = np.array([float(v) for v in lines[n * SAMPLES + s].split()])
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6,
                                       err_msg=f"{label} at {dict(zip(names, values[s]))}")
