"""The generated C of training (generated/c/<op>.train.c and the update ops' <op>.c, what
`eulergen export-c --train` builds) against the generated numpy modules, which the numpy
trainer runs: every op's backward (and its fused variants'), attention's forward over whole
sequences, the embedding's backward and each optimizer's step, called through ctypes by the
signatures the manifest records. Tolerance: c_calls.TOL, float32 rounding's."""
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
    """Every op's C of training, and the update ops' C, in one shared library."""
    files = sorted({str(op.c_train) for op in lib.ops.values() if op.c_train}
                   | {str(op.c) for op in lib.ops.values() if op.kind == "update" and op.c})
    return shared_library(files, tmp_path_factory.mktemp("c_train") / "train.so")


def _ops(kind):
    return sorted(n for n, op in OpLibrary(NUMPY).ops.items() if op.kind == kind and op.c_train)


def _grads(got: dict, want, names, what) -> None:
    for name, w in zip(names, want if isinstance(want, tuple) else (want,)):
        close(got[name], w, f"{what} {name}")


@pytest.mark.parametrize("name", _ops("pointwise"))
def test_pointwise_backward_c_equals_numpy(lib, compiled, name):
    op, mod = lib.op(name), load_numpy_module(lib.op(name))
    rng = c_calls.rng(name)
    ins = {o.name: rng.uniform(-3, 3, (5, 12)).astype(np.float32) for o in op.inputs}
    douts = {f"d{o.name}": rng.uniform(-1, 1, (5, 12)).astype(np.float32) for o in op.outputs}
    grads = {f"d{o.name}": np.empty((5, 12), np.float32) for o in op.inputs}
    call(compiled, op.c_function("backward"), {**ins, **douts, **grads, **op.params, "n": 60})
    _grads(grads, mod.backward(*ins.values(), *douts.values()), grads, f"{name} backward")
    biases = {f"_bias_{n}": rng.uniform(-1, 1, 12).astype(np.float32) for n in ins}
    grads |= {f"d{b}": np.empty(12, np.float32) for b in biases}
    call(compiled, op.c_function("backward", "bias"),
         {**ins, **biases, **douts, **grads, **op.params, "rows": 5, "cols": 12})
    _grads(grads, mod.backward_bias(*ins.values(), *biases.values(), *douts.values()), grads,
           f"{name} backward_bias")


@pytest.mark.parametrize("name", _ops("row"))
def test_row_backward_c_equals_numpy(lib, compiled, name):
    op, mod = lib.op(name), load_numpy_module(lib.op(name))
    rng = c_calls.rng(name)
    rows, cols = 4, 24
    for fusion, side in row_sides(op, "backward"):
        ins = {o.name: row_operand(rng, o.role, rows, cols) for o in side.inputs}
        douts = {f"d{o.name}": row_operand(rng, "row", rows, cols) if o.role == "row"
                 else rng.uniform(-2, 2, rows).astype(np.float32)   # a per-row output's
                 for o in side.outputs}
        grads = {f"d{o.name}": np.empty_like(ins[o.name]) for o in side.inputs
                 if o.role != "index"}
        call(compiled, op.c_function("backward", fusion),
             {**ins, **douts, **grads, **op.params, "rows": rows, "cols": cols})
        want = getattr(mod, "backward_add" if fusion else "backward")(*ins.values(),
                                                                       *douts.values())
        _grads(grads, want, grads, f"{name} backward {fusion}")


def test_the_fused_cross_entropy_writes_dx_over_its_logits(lib, compiled):
    """The model's loss: dlogits written over the logits it reads, padded columns -inf."""
    op, mod = lib.op("cross_entropy"), load_numpy_module(lib.op("cross_entropy"))
    rng = c_calls.rng("fused")
    x = rng.normal(size=(3, 16)).astype(np.float32)
    x[:, 12:] = -np.inf
    target = rng.integers(0, 12, 3).astype(np.int32)
    dloss = np.full(3, 1 / 3, np.float32)
    want = mod.backward(x, target, dloss)
    call(compiled, op.c_function("backward"),
         {"x": x, "target": target, "dloss": dloss, "dx": x, "rows": 3, "cols": 16})
    close(x, want, "cross_entropy dx over x")
    assert np.all(x[:, 12:] == 0)


def _qkv(rng, B, T, H, KVH, D):
    """q, k, v as heads of one [B, T, H + 2 KVH, D] buffer, the model's qkv."""
    qkv = rng.normal(size=(B, T, H + 2 * KVH, D)).astype(np.float32)
    return qkv, (qkv[:, :, :H], qkv[:, :, H:H + KVH], qkv[:, :, H + KVH:])


@pytest.mark.parametrize("name", _ops("attention"))
def test_attention_forward_and_backward_c_equal_numpy(lib, compiled, name):
    op, mod = lib.op(name), load_numpy_module(lib.op(name))
    rng = c_calls.rng(name)
    B, T, H, KVH, D = 2, 7, 4, 2, 16
    _, (q, k, v) = _qkv(rng, B, T, H, KVH, D)
    o, lse = np.empty((B, T, H, D), np.float32), np.empty((B, H, T), np.float32)
    sizes = {"batch": B, "T": T, "n_heads": H, "n_kv_heads": KVH, "head_dim": D, **op.params}
    views = {"q": q, "k": k, "v": v, **strides(q, "q"), **strides(k, "k"), **strides(v, "v")}
    call(compiled, op.c_function("forward"),
         {**views, "o": o, **strides(o, "o"), "lse": lse, **sizes})
    want_o, want_lse = mod.forward(q, k, v)
    close(o, want_o, f"{name} o")
    close(lse, want_lse, f"{name} lse")
    dout = rng.normal(size=o.shape).astype(np.float32)
    dqkv, (dq, dk, dv) = _qkv(rng, B, T, H, KVH, D)
    call(compiled, op.c_function("backward"),
         {**views, "o": o, **strides(o, "o"), "lse": lse, "dout": dout,
          **strides(dout, "dout"), "dq": dq, "dk": dk, "dv": dv, **strides(dq, "dq"),
          **strides(dk, "dk"), **strides(dv, "dv"), **sizes})
    _grads({"dq": dq, "dk": dk, "dv": dv}, mod.backward(q, k, v, o, lse, dout),
           ("dq", "dk", "dv"), f"{name} backward")


def test_rope_backward_c_equals_numpy_in_place(lib, compiled):
    op, mod = lib.op("rope"), load_numpy_module(lib.op("rope"))
    qkv = c_calls.rng("rope").uniform(-1, 1, (2, 3, 5, 8)).astype(np.float32)
    dy = qkv[:, :, 1:4]                      # heads of a wider buffer, as the model's d.qk
    want = mod.backward(dy, dy, pos0=0)      # rope's backward reads no x
    call(compiled, op.c_function("backward"),
         {"dy": dy, **strides(dy, "dy"), "dx": dy, **strides(dy, "dx"), **op.params,
          "B": 2, "T": 3, "H": 3, "D": 8, "pos0": 0})
    close(qkv[:, :, 1:4], want, "rope backward")


@pytest.mark.parametrize("add", [False, True])
def test_embedding_backward_c_sums_as_numpy(lib, compiled, add):
    """Bit for bit: the same additions in the same order."""
    rng = c_calls.rng("embedding")
    wte, wpe = (rng.normal(size=(n, 6)).astype(np.float32) for n in (10, 5))
    ids = rng.integers(0, 4, (3, 4)).astype(np.int32)            # repeated ids
    dout = rng.normal(size=(3, 4, 6)).astype(np.float32)
    want = [rng.normal(size=a.shape).astype(np.float32) for a in (wte, wpe)]
    got = [a.copy() for a in want]
    lib.backward("embedding", ids, wte, wpe, dout, out=tuple(want), accumulate=(add, add))
    call(compiled, lib.op("embedding").c_function("backward"),
         {"ids": ids, "dout": dout, "dwte": got[0], "dwpe": got[1], "BT": 12, "T": 4, "C": 6,
          "V": 10, "P": 5, "add_wte": add, "add_wpe": add})
    assert all(np.array_equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("name", sorted(n for n, op in OpLibrary(NUMPY).ops.items()
                                         if op.kind == "update" and op.c))
def test_an_optimizers_step_c_equals_numpy_and_skips(lib, compiled, name):
    op, mod = lib.op(name), load_numpy_module(lib.op(name))
    rng = c_calls.rng(name)
    arrays = {o.name: rng.uniform(0, 1, 50).astype(np.float32) for o in op.inputs}   # v >= 0
    want = {n: a.copy() for n, a in arrays.items()}
    control = {"skip": 0.0, "grad_scale": 0.5, "lr": 3e-3, "step": 7.0}
    fixed = {k: val for k, val in op.params.items() if val is not None}
    mod.step(*want.values(), np.array([control[s] for s in mod.CONTROL]), **fixed)
    before = {n: a.copy() for n, a in arrays.items()}
    values = {**arrays, **fixed, "n": 50}
    call(compiled, op.c_function("step"), {**values, "control": np.array(
        [1.0 if s == "skip" else control[s] for s in mod.CONTROL], np.float32)})
    assert all(np.array_equal(arrays[n], before[n]) for n in arrays), "skipped: unchanged"
    call(compiled, op.c_function("step"), {**values, "control": np.array(
        [control[s] for s in mod.CONTROL], np.float32)})
    for o in op.inputs:
        close(arrays[o.name], want[o.name], f"{name} {o.name}")
