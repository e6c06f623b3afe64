"""The decoder's few-row GEMMs (generated/cuda/gemv.cu, from templates/gemv.cu.j2) without a
GPU: compiled by g++ over the CUDA emulator (tests/cudagen_emulator), each kernel launched
with its geometry's grid and block, against the float64 product. The kernel sums in float32
and rounds once, so it is within one rounding of the output's dtype plus float32's error of
a k-term sum (stated at each check). Then a pointwise op's `gemv` variant (its kernels in
generated/cuda/<op>.cu): y = op(x·wᵀ + b) against the op's generated numpy forward of the
float64 product, a user's op's with its params by name."""
from __future__ import annotations

import ctypes
import shutil

import numpy as np
import pytest

from eulergen import GENERATED_DIR
from eulergen.errors import EulerError
from eulergen.generator import build
from eulergen.generator.plan import GEMV_LAUNCHES
from eulergen.runtime.engine import bf16
from eulergen.runtime.engine.manifest import load_manifest, load_numpy_module

from emulated import emulated_library, runner

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")

OPS = load_manifest(GENERATED_DIR / "manifest.json").ops
GEMV = OPS["gemv"]
CTYPES = {"long long": ctypes.c_longlong, "int": ctypes.c_int, "float": ctypes.c_float}
FUSED = ["gelu", "relu"]     # a smooth op and one with a kink: the same template


def _library(folder, cu, kernels, source=GENERATED_DIR / "cuda", extra=()):
    """`source`/`cu` with a `run_<kernel>(grid, its params…)` for each of `kernels`, and the
    `extra` runners."""
    lib = emulated_library(folder, cu, [
        *(runner(k.name, f"int grid, {k.c_params}", "grid", k.geometry.threads,
                 f"{k.name}({k.call_args})") for k in kernels), *extra], source)
    for k in kernels:
        getattr(lib, f"run_{k.name}").argtypes = (ctypes.c_int, *(
            ctypes.c_void_p if c.endswith("*") else CTYPES[c] for _, c in k.args))
    return lib


@pytest.fixture(scope="module")
def gemv(tmp_path_factory):
    return _library(tmp_path_factory.mktemp("gemv"), "gemv.cu", GEMV.kernels.values())


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    """op -> its .cu built with runners for its `gemv` variant's kernels."""
    return {op: _fused_library(tmp_path_factory.mktemp(op), OPS[op]) for op in FUSED}


def _fused_library(folder, op):
    """The op's .cu (where its manifest says) with runners for its `gemv` variant's kernels,
    and for the kernels of the pair it stands for: the op's forward and its bias variant
    (unaligned: any column count), each on one block (a grid-stride and a row loop)."""
    kernels = [k for k in op.kernels.values() if k.fusion == "gemv"]
    pair = [k for k in op.kernels.values() if k.stage == "forward" and not k.part
            and (k.fusion == "" or (k.fusion == "bias" and not k.geometry.aligned))]
    lib = _library(folder, op.cuda.name, kernels, op.cuda.parent, extra=[
        runner(k.name, k.c_params, "1", k.geometry.threads, f"{k.name}({k.call_args})")
        for k in pair])
    for k in pair:
        getattr(lib, f"run_{k.name}").argtypes = tuple(
            ctypes.c_void_p if c.endswith("*") else CTYPES[c] for _, c in k.args)
    return lib


def _run(lib, stage, dt, bound, x, w, b, y, rows, beta, cols=1):
    """Launch the kernel of `stage` in `dt` for at most `bound` rows over host arrays (the
    storage: bf16 as uint16 bits), `cols` output columns a block, with its geometry's grid."""
    k = GEMV.kernel(stage, dt, rows=bound)
    n = w.shape[0]
    at = k.geometry.launch(n, cols)
    getattr(lib, f"run_{k.name}")(
        at.grid[0], x.ctypes.data, x.strides[0] // x.itemsize, w.ctypes.data,
        w.strides[0] // w.itemsize, None if b is None else b.ctypes.data, y.ctypes.data,
        y.strides[0] // y.itemsize, rows, n, x.shape[1], cols, beta)


def _operands(rows, n, k, dt, seed, w_scale=1.0):
    """x [rows, k], w [n, k] (times w_scale), b [n] as float64 values the storage holds
    exactly, and their storage."""
    rng = np.random.default_rng(seed)
    vals = [rng.standard_normal(s) for s in ((rows, k), (n, k), n)]
    vals[1] *= w_scale
    if dt == "bf16":
        stored = [bf16.to_bf16(v.astype(np.float32)) for v in vals]
        return [bf16.from_bf16(s).astype(np.float64) for s in stored], stored
    stored = [v.astype(np.float32) for v in vals]
    return [s.astype(np.float64) for s in stored], stored


def _bound(x, w, k):
    """float32's error bound of a k-term sum of x·w products, a column: k·2⁻²⁴·Σ|x·w|
    (the sum order is the kernel's own, any order within it)."""
    return k * 2.0 ** -24 * (np.abs(x) @ np.abs(w).T)


# k: within one chunk a warp (lanes left idle), several chunks, and more chunks than a
# column's warps keep in flight (the loop goes round), with a partial chunk at the end; cols:
# a block a column, or 2 and 4 of the 5 columns a block (the last block's columns past n idle)
@pytest.mark.parametrize("dt", ["f32", "bf16"])
@pytest.mark.parametrize("rows,bound,k,cols", [(1, 1, 64, 1), (1, 2, 1032, 2), (2, 2, 1032, 4),
                                               (2, 2, 4376, 1), (2, 2, 4376, 4)])
def test_a_kernel_gives_the_product_plus_bias_within_one_rounding(gemv, dt, rows, bound, k,
                                                                  cols):
    n = 5
    (x, w, b), (xs, ws, bs) = _operands(rows, n, k, dt, 1)
    store = bs.dtype
    y = np.full((rows + 2, n + 3), 7, store)          # a strided out, rows after `rows` kept
    _run(gemv, "gemv", dt, bound, xs, ws, bs, y[:, :n], rows, 0.0, cols)
    want = x @ w.T + b
    got = (bf16.from_bf16(y) if dt == "bf16" else y).astype(np.float64)
    ulp = 2.0 ** -8 if dt == "bf16" else 2.0 ** -24    # half a unit in the last place
    np.testing.assert_array_less(np.abs(got[:rows, :n] - want),
                                 ulp * np.abs(want) + _bound(x, w, k) + 1e-30)
    assert (y[rows:] == store.type(7)).all() and (y[:, n:] == store.type(7)).all()


@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_beta_one_adds_the_old_output_before_the_one_rounding(gemv, dt):
    rows, n, k = 2, 4, 264
    (x, w, _), (xs, ws, _) = _operands(rows, n, k, dt, 2)
    old = np.arange(rows * n, dtype=np.float64).reshape(rows, n) - 3.0    # exact in bf16
    y = bf16.to_bf16(old.astype(np.float32)) if dt == "bf16" else old.astype(np.float32)
    _run(gemv, "gemv", dt, 2, xs, ws, None, y, rows, 1.0, 4)
    want = x @ w.T + old
    got = (bf16.from_bf16(y) if dt == "bf16" else y).astype(np.float64)
    ulp = 2.0 ** -8 if dt == "bf16" else 2.0 ** -24
    np.testing.assert_array_less(np.abs(got - want), ulp * np.abs(want) + _bound(x, w, k) + 1e-30)


def test_bf16_operands_write_float32_logits(gemv):
    """The sampler's logits: bf16 x and w, float32 out, one float32 rounding of the sum."""
    rows, n, k = 1, 9, 776
    (x, w, _), (xs, ws, _) = _operands(rows, n, k, "bf16", 3)
    y = np.zeros((rows, n), np.float32)
    _run(gemv, "gemv_f32_out", "bf16", 1, xs, ws, None, y, rows, 0.0, 2)
    want = x @ w.T
    np.testing.assert_array_less(np.abs(y - want), 2.0 ** -24 * np.abs(want) + _bound(x, w, k))


def test_every_row_bound_has_a_kernel_of_each_storage_and_the_wide_bf16_form():
    bounds = sorted({k.geometry.rows for k in GEMV.kernels.values()})
    assert bounds == sorted({g.rows for g in GEMV_LAUNCHES}) and bounds[0] == 1
    for r in bounds:
        for stage, dt in (("gemv", "f32"), ("gemv", "bf16"), ("gemv_f32_out", "bf16")):
            assert GEMV.kernel(stage, dt, rows=r).geometry.rows == r


def test_a_launch_packs_columns_into_blocks_only_while_every_sm_keeps_its_blocks():
    from eulergen.runtime.engine.gemv import BLOCKS_PER_SM, columns
    sms = 132
    assert columns(50304, sms) == 4                         # the head: 12,576 blocks
    assert columns(2 * BLOCKS_PER_SM * sms, sms) == 2       # 4 a block would leave SMs short
    assert columns(768, sms) == 1                           # fewer columns than SMs' blocks


def lipschitz(derivative, z) -> float:
    """max |f'| near the values z, `derivative` (f' of an array: the op's generated numpy
    backward with dy = 1) on a fine grid: how far an error in f's argument can move f
    (tests/gpu/test_gemv_gpu.py's bound too)."""
    grid = np.linspace(z.min() - 1, z.max() + 1, 20001)
    return float(np.abs(derivative(grid)).max())


def test_every_single_input_pointwise_op_and_no_gated_one_has_the_gemv_variant():
    pointwise = {n: op for n, op in OPS.items() if op.kind == "pointwise"}
    for name, op in pointwise.items():
        sigs = [k for k in op.kernels.values() if k.fusion == "gemv"]
        want = len(op.inputs) == 1 and len(op.outputs) == 1
        assert bool(sigs) == want, name
        if want:   # a kernel per row bound of the gemv op and storage dtype, as gemv's own
            assert {(k.dtype, k.geometry) for k in sigs} == {
                (k.dtype, k.geometry) for k in GEMV.kernels.values() if k.stage == "gemv"}
            assert all(k.stage == "forward" and "gemv" not in op.fusions for k in sigs)
    fused = {n for n, op in pointwise.items() if any(k.fusion == "gemv" for k in op.kernels.values())}
    assert {"gelu", "gelu_erf", "relu", "relu2", "silu"} <= fused


# k: one partial chunk, several chunks with a partial one, more chunks than a column's warps
# keep in flight; (k is a whole number of 16-byte vectors: gemv.takes refuses any other);
# n = 13 columns: 2 and 4 a block leave the last block's columns past n idle
@pytest.mark.parametrize("op", FUSED)
@pytest.mark.parametrize("dt", ["f32", "bf16"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("rows,bound,k,cols", [(1, 1, 264, 1), (1, 2, 1032, 2),
                                               (2, 2, 4376, 4)])
def test_the_gemv_variant_gives_the_bits_of_the_pair_it_stands_for(
        gemv, fused, op, dt, with_bias, rows, bound, k, cols):
    """y = op(x·wᵀ + b) in one kernel: the bits of the gemv kernel storing x·wᵀ, then the
    op's bias variant (or, without a bias, its forward) reading it; and within
    _check_fused's bound of the float64 op. w is scaled by 1/√k, so x·wᵀ + b ~ N(0, 2): the
    op's curved part (and relu's kink) is what the columns see."""
    n = 13
    (x, w, b), (xs, ws, bs) = _operands(rows, n, k, dt, k + rows, 1 / np.sqrt(k))
    if not with_bias:
        b, bs = np.zeros(n), None
    store = xs.dtype
    y = np.full((rows + 2, n + 3), 7, store)          # a strided out, rows after `rows` kept
    got = _run_fused(fused[op], OPS[op], dt, bound, xs, ws, bs, y, rows, cols)
    assert (y[rows:] == store.type(7)).all() and (y[:, n:] == store.type(7)).all()
    fc, pair = np.zeros((rows, n), store), np.zeros((rows, n), store)
    _run(gemv, "gemv", dt, bound, xs, ws, None, fc, rows, 0.0, cols)
    lib, entry = fused[op], OPS[op]
    if bs is None:
        run = getattr(lib, f"run_{entry.kernel('forward', dt).name}")
        run(fc.ctypes.data, pair.ctypes.data, fc.size)
    else:
        run = getattr(lib, f"run_{entry.kernel('forward', dt, fusion='bias', aligned=False).name}")
        run(fc.ctypes.data, bs.ctypes.data, pair.ctypes.data, rows, n)
    np.testing.assert_array_equal(y[:rows, :n], pair)
    _check_fused(entry, x, w, b, got[:rows, :n], dt)


def _run_fused(lib, op, dt, bound, xs, ws, bs, y, rows, cols, *params):
    """The op's gemv kernel for at most `bound` rows over host storage, `cols` output columns
    a block, the op's params in its order; y widened to float64."""
    kernel = op.kernel("forward", dt, fusion="gemv", rows=bound)
    n, k = ws.shape
    getattr(lib, f"run_{kernel.name}")(
        kernel.geometry.launch(n, cols).grid[0], xs.ctypes.data, xs.strides[0] // xs.itemsize,
        ws.ctypes.data, k, None if bs is None else bs.ctypes.data, y.ctypes.data,
        y.strides[0] // y.itemsize, rows, n, k, cols, *params)
    return (bf16.from_bf16(y) if dt == "bf16" else y).astype(np.float64)


def _check_fused(op, x, w, b, got, dt, **params):
    """got against op(x·wᵀ + b) in float64 (the op's numpy forward): the float32 sum's error
    and its rounding to y's dtype (as the unfused pair stores it) moved by at most max|op'|
    (the op's own derivative), the op in float32 within test_cuda_emulated's 1e-5 of the
    largest value, then one rounding to y's dtype."""
    mod = load_numpy_module(op)
    z = x @ w.T + b
    want = mod.forward(z, **params)
    ulp = 2.0 ** -8 if dt == "bf16" else 2.0 ** -24    # half a unit in the last place
    product = np.abs(x @ w.T)
    # the sum's error, its rounding as stored, the bias add's
    bound_z = _bound(x, w, x.shape[1]) + ulp * product + 2.0 ** -24 * np.abs(z)
    slope = lipschitz(lambda g: mod.backward(g, np.ones_like(g), **params), z)
    np.testing.assert_array_less(
        np.abs(got - want),
        ulp * np.abs(want) + slope * bound_z + 1e-5 * np.abs(want).max() + 1e-30)
    assert not np.allclose(want, z, atol=0.05), "the op should change these sums"


SWISH = """name: swish
kind: pointwise
doc: x·sigmoid(beta·x); beta is also the plain gemv kernels' argument, not the variant's
inputs: [x]
params: {beta: 1.5}
outputs:
  y: x*sigmoid(beta*x)
"""


def test_a_users_op_gets_the_variant_with_its_params_by_name(tmp_path, monkeypatch):
    monkeypatch.setenv("EULERGEN_CACHE", str(tmp_path / "cache"))
    (tmp_path / "ops").mkdir()
    (tmp_path / "ops" / "swish.yaml").write_text(SWISH)
    (manifest,) = build.ensure_built(["swish"], [tmp_path / "ops"])
    op = load_manifest(manifest).ops["swish"]
    (tmp_path / "emu").mkdir()
    lib = _fused_library(tmp_path / "emu", op)
    rows, n, k = 2, 13, 520
    (x, w, b), (xs, ws, bs) = _operands(rows, n, k, "bf16", 5, 1 / np.sqrt(k))
    y = np.zeros((rows, n), np.uint16)
    got = _run_fused(lib, op, "bf16", 2, xs, ws, bs, y, rows, 2, 0.25)   # beta not its default
    _check_fused(op, x, w, b, got, "bf16", beta=0.25)


def test_a_param_named_as_a_gemv_argument_is_refused_naming_the_spec_and_key(tmp_path,
                                                                              monkeypatch):
    monkeypatch.setenv("EULERGEN_CACHE", str(tmp_path / "cache"))
    (tmp_path / "ops").mkdir()
    spec = tmp_path / "ops" / "swish.yaml"
    spec.write_text(SWISH.replace("beta", "k"))
    with pytest.raises(EulerError, match="gemv kernels") as err:
        build.ensure_built(["swish"], [tmp_path / "ops"])
    assert (err.value.file, err.value.key) == (str(spec), "params.k")
