"""What the tests of the generated C (tests/test_c_ops.py, test_c_train_ops.py) share: the
files built into one shared library, a C function called through ctypes by the signature
the manifest records, and the comparison with the numpy module it is printed beside."""
from __future__ import annotations

import ctypes
import subprocess

import numpy as np

# float32 rounding's: the C and the numpy modules order their sums and spell their
# quotients differently
TOL = 2e-5


def shared_library(files, out, std: str = "c99") -> ctypes.CDLL:
    """`files` (each its own translation unit) built into the shared library `out` (the
    generated C is C99; the programs' are C11)."""
    done = subprocess.run(["cc", f"-std={std}", "-O2", "-shared", "-fPIC", "-Wall", "-Werror",
                           "-Wno-unused-function", *map(str, files), "-o", str(out), "-lm"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return ctypes.CDLL(str(out))


def call(so, fn, values: dict) -> None:
    """Call C function `fn` (a CFunction) with `values` by its parameter names."""
    types = {"long long": ctypes.c_longlong, "int": ctypes.c_int, "float": ctypes.c_float}
    args = []
    for name, ctype in fn.args:
        v = values[name]
        if ctype.endswith("*"):
            args.append(None if v is None else v.ctypes.data_as(ctypes.c_void_p))
        else:
            args.append(types[ctype](v))
    getattr(so, fn.name)(*args)


def close(got, want, what) -> None:
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
    assert err < TOL, f"{what}: relative error {err:.1e}"


def strides(a, prefix) -> dict:
    """The (batch, token, head) strides of a [B, T, H, D] view, as the C functions take them."""
    return {f"{prefix}_{s}": a.strides[n] // a.itemsize for n, s in enumerate(("sb", "st", "sh"))}


def rng(name):
    return np.random.default_rng(sum(map(ord, name)))


def row_operand(rng, role: str, rows: int, cols: int):
    """A row op's operand: an index (int32 [rows], a column), a row [rows, cols] or a weight
    [cols] of floats in [-2, 2]."""
    if role == "index":
        return rng.integers(0, cols, rows).astype(np.int32)
    return rng.uniform(-2, 2, (rows, cols) if role == "row" else cols).astype(np.float32)


def row_sides(op, stage: str) -> list:
    """(fusion, operands) of a row op's `stage` call: its own, and its add fusion's."""
    return [("", op)] + ([("add", getattr(op.fusions["add"], stage))] if "add" in op.fusions
                         else [])
