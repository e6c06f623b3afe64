"""The generated C (generated/c/<op>.c, `eulergen export-c`'s CPU build) against the generated
numpy modules, the reference it is printed from the same expressions as: every op's C
functions, compiled with the C compiler and called through ctypes by the signatures the
manifest records, on float32 data. The tolerance is float32 rounding's (the two order their
sums and spell their quotients differently)."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

import c_calls
from c_calls import call, close, row_operand, row_sides, shared_library, strides
from eulergen.runtime.engine.backend import NUMPY
from eulergen.runtime.engine.manifest import load_numpy_module
from eulergen.runtime.engine.ops import OpLibrary

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


@pytest.fixture(scope="module")
def lib():
    return OpLibrary(NUMPY)


@pytest.fixture(scope="module")
def compiled(lib, tmp_path_factory):
    """Every op's C in one shared library (each file its own translation unit)."""
    files = sorted({str(op.c) for op in lib.ops.values() if op.c is not None})
    return shared_library(files, tmp_path_factory.mktemp("c_ops") / "ops.so")


def _ops(kind):
    return sorted(n for n, op in OpLibrary(NUMPY).ops.items() if op.kind == kind and op.c)


@pytest.mark.parametrize("name", _ops("pointwise"))
def test_pointwise_c_equals_numpy(lib, compiled, name):
    op, mod = lib.op(name), load_numpy_module(lib.op(name))
    rng = c_calls.rng(name)
    ins = {o.name: rng.uniform(-3, 3, (5, 12)).astype(np.float32) for o in op.inputs}
    out = {o.name: np.empty((5, 12), np.float32) for o in op.outputs}
    call(compiled, op.c_function("forward"), {**ins, **out, **op.params, "n": 60})
    close(out[op.outputs[0].name], mod.forward(*ins.values()), f"{name} forward")
    biases = {f"_bias_{n}": rng.uniform(-1, 1, 12).astype(np.float32) for n in ins}
    call(compiled, op.c_function("forward", "bias"),
         {**ins, **biases, **out, **op.params, "rows": 5, "cols": 12})
    close(out[op.outputs[0].name], mod.forward_bias(*ins.values(), *biases.values()),
          f"{name} forward_bias")


@pytest.mark.parametrize("name", _ops("row"))
def test_row_c_equals_numpy(lib, compiled, name):
    op, mod = lib.op(name), load_numpy_module(lib.op(name))
    rng = c_calls.rng(name)
    rows, cols = 4, 24
    for fusion, side in row_sides(op, "forward"):
        ins = {o.name: row_operand(rng, o.role, rows, cols) for o in side.inputs}
        out = {o.name: np.empty((rows, cols) if o.role == "row" else rows, np.float32)
               for o in side.outputs}
        call(compiled, op.c_function("forward", fusion),
             {**ins, **out, **op.params, "rows": rows, "cols": cols})
        want = getattr(mod, "forward_add" if fusion else "forward")(*ins.values())
        for got, w in zip(out.values(), want if isinstance(want, tuple) else (want,)):
            close(got, w, f"{name} forward {fusion}")


def test_rope_c_equals_numpy_at_a_position(lib, compiled):
    op, mod = lib.op("rope"), load_numpy_module(lib.op("rope"))
    qkv = c_calls.rng("rope").uniform(-1, 1, (2, 3, 5, 8)).astype(np.float32)
    x = qkv[:, :, 1:4]                       # heads of a wider buffer, as the model's qk
    want = mod.forward(x, pos0=9)
    call(compiled, op.c_function("forward"),
         {"x": x, **strides(x, "x"), "y": x, **strides(x, "y"), **op.params,
           "B": 2, "T": 3, "H": 3, "D": 8, "pos0": 9})   # in place
    close(qkv[:, :, 1:4], want, "rope")


@pytest.mark.parametrize("name", _ops("attention"))
def test_attention_decode_c_equals_numpy(lib, compiled, name):
    op, mod = lib.op(name), load_numpy_module(lib.op(name))
    rng = c_calls.rng(name)
    B, tq, H, KVH, D, pos0 = 2, 3, 4, 2, 16, 5
    q = rng.normal(size=(B, tq, H, D)).astype(np.float32)
    k, v = (rng.normal(size=(B, 11, KVH, D)).astype(np.float32) for _ in range(2))
    o = np.empty_like(q)
    call(compiled, op.c_function("decode"),
         {"q": q, "k": k, "v": v, "o": o, "tq": tq, "pos0": pos0, "batch": B, "n_heads": H,
           "n_kv_heads": KVH, "head_dim": D, **op.params,
           **strides(q, "q"), **strides(k, "k"), **strides(v, "v"), **strides(o, "o")})
    close(o, mod.decode(q, k, v, pos0), f"{name} decode")


def test_embedding_c_gathers_rows_and_adds_positions(lib, compiled):
    rng = c_calls.rng("embedding")
    wte, wpe = (rng.normal(size=(n, 6)).astype(np.float32) for n in (10, 4))
    ids = rng.integers(0, 10, (2, 4)).astype(np.int32)
    out = np.empty((2, 4, 6), np.float32)
    fn = lib.op("embedding").c_function("forward")
    call(compiled, fn, {"ids": ids, "wte": wte, "wpe": wpe, "out": out, "BT": 8, "T": 4,
                         "C": 6, "V": 10})
    assert np.array_equal(out, wte[ids] + wpe[None])
    call(compiled, fn, {"ids": ids, "wte": wte, "wpe": None, "out": out, "BT": 8, "T": 4,
                         "C": 6, "V": 10})
    assert np.array_equal(out, wte[ids])
