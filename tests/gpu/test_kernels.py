"""Every generated kernel against the numpy backend, on the GPU (`pytest -m gpu tests/gpu`).

Ops are read from generated/manifest.json, so a new op is tested without editing this
file. Each case poisons its outputs with NaN before the launch (an element the kernel
fails to write stays NaN and fails), and compares against the numpy module evaluated in
float64 on the very same input values.

Tolerances. fp32: the largest error over an output divided by the largest magnitude of
the reference (an ∞-norm relative error) must be below 1e-5. A plain element-wise
relative error is meaningless where an output crosses zero (gelu near 0): there the fp32
rounding of each term, not the kernel, sets the error, and it is small against the
output's scale. Where a whole output is such a difference of nearly equal terms (a
layernorm gradient over rows of length 1 is exactly 0, computed as 300 − 300), its own
magnitude is no scale at all; so the error may also be up to 16× that of the same numpy
formula evaluated in float32 (FMA contraction in the kernel rounds differently). For a
well-conditioned output that allowance is far below 1e-5 of its scale and changes nothing.
bf16: each element within half a bf16 ulp (2^-8 relative: the fp32 result rounded once to
bf16) plus the fp32 allowance above, for results that land next to a rounding midpoint.
Per-row outputs a kernel stores as float32 (a loss) take the fp32 tolerance in both.
"""
from __future__ import annotations

import sys

import numpy as np
import pytest
import yaml

from eulergen import GENERATED_DIR, PACKAGE_DIR
from eulergen.errors import EulerError
from eulergen.runtime.engine.manifest import load_manifest

pytestmark = pytest.mark.gpu

MANIFEST = GENERATED_DIR / "manifest.json"
OPS = load_manifest(MANIFEST).ops if MANIFEST.exists() else {}


def _ops(*kinds):
    return sorted(n for n, o in OPS.items() if o.kind in kinds)


def progress(*parts):
    print(*parts, file=sys.stderr, flush=True)


# ---- values ------------------------------------------------------------------------------

def domain(op, name) -> tuple[float, float]:
    spec = PACKAGE_DIR / op.spec
    bounds = (yaml.safe_load(spec.read_text()).get("domain") or {}) if spec.is_file() else {}
    lo, hi = bounds.get(name, (-3.0, 3.0))
    return float(lo), float(hi)


def host_values(rng, shape, lo, hi, dtype) -> np.ndarray:
    """float64 values exactly representable in the storage dtype."""
    from eulergen.runtime.engine.bf16 import from_bf16, to_bf16
    x = rng.uniform(lo, hi, size=shape).astype(np.float32)
    if dtype == "bf16":
        x = from_bf16(to_bf16(x))
    return x.astype(np.float64)


def device(cp, host: np.ndarray, dtype: str):
    from eulergen.runtime.engine.bf16 import to_bf16
    x32 = host.astype(np.float32)
    return cp.asarray(to_bf16(x32) if dtype == "bf16" else x32)


def poisoned(cp, shape, np_dtype):
    if np.dtype(np_dtype) == np.uint16:
        return cp.full(shape, 0x7FC0, dtype=cp.uint16)   # bf16 quiet NaN
    return cp.full(shape, np.nan, dtype=np_dtype)


def as_f64(cp, a) -> np.ndarray:
    from eulergen.runtime.engine.bf16 import from_bf16
    h = cp.asnumpy(a)
    return (from_bf16(h) if h.dtype == np.uint16 else h).astype(np.float64)


def as_tuple(r):
    return r if isinstance(r, tuple) else (r,)


def reference(fn, name, *host, **params) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each result of a numpy call in float64, paired with the float32 result that deviates
    most from it: the call on the same inputs, or on inputs moved by one float32 ulp. The
    second shows how ill-conditioned an output is (layernorm's dx on rows of length 1 is pure
    cancellation), so the GPU is allowed the rounding any float32 evaluation order could give."""
    f64 = as_tuple(fn(name, *host, **params))
    rng = np.random.default_rng(0)

    def as32(h, nudge):
        if h is None or h.dtype != np.float64:
            return h
        h32 = h.astype(np.float32)
        return h32 * (1 + nudge * rng.choice([-1, 1], size=h.shape) * 2.0 ** -23).astype(np.float32)

    runs = [as_tuple(fn(name, *[as32(h, nudge) for h in host], **params)) for nudge in (0, 1)]
    out = []
    for i, a in enumerate(f64):
        if a is None:
            out.append(None)
            continue
        a = np.asarray(a)
        worst = max((np.asarray(r[i], dtype=np.float64) for r in runs),
                    key=lambda b: float(np.max(np.abs(b - a))) if a.size else 0.0)
        out.append((a, worst))
    return out


def check(name: str, got_dev, want: tuple[np.ndarray, np.ndarray], cp) -> None:
    want, want32 = want
    got = as_f64(cp, got_dev)
    assert got.shape == want.shape, f"{name}: shape {got.shape}, expected {want.shape}"
    assert not np.isnan(got).any(), f"{name}: {int(np.isnan(got).sum())} elements unwritten or NaN"
    scale = float(np.max(np.abs(want))) if want.size else 0.0
    noise = 16 * float(np.max(np.abs(want32 - want))) if want.size else 0.0
    err = np.abs(got - want)
    if got_dev.dtype == np.uint16:
        bad = err > 2.0 ** -8 * np.abs(want) + max(1e-5 * scale, noise)
        assert not bad.any(), (f"{name} (bf16): {int(bad.sum())} elements past half an ulp, "
                               f"worst {err.max():.3e} at scale {scale:.3e}")
    else:
        worst = float(err.max()) if err.size else 0.0
        assert worst <= max(1e-5 * scale, noise), (
            f"{name} (fp32): ∞-norm relative error {worst / scale if scale else worst:.2e} "
            f"(float32 numpy: {noise / 16 / scale if scale else noise / 16:.2e})")


def both_dtypes(f):
    return pytest.mark.parametrize("dtype", ["f32", "bf16"])(f)


# ---- pointwise ---------------------------------------------------------------------------

POINTWISE_SIZES = [1, 7, 4097, (1 << 20) + 3]


@both_dtypes
@pytest.mark.parametrize("n", POINTWISE_SIZES)
@pytest.mark.parametrize("name", _ops("pointwise"))
def test_pointwise_forward_and_backward_match_numpy(name, n, dtype, cp, libs):
    gpu, ref = libs
    op = OPS[name]
    rng = np.random.default_rng(n)
    xs = [host_values(rng, (n,), *domain(op, o.name), dtype) for o in op.inputs]
    progress(f"pointwise {name} n={n} {dtype}")
    outs = tuple(poisoned(cp, (n,), np.float32 if dtype == "f32" else np.uint16)
                 for _ in op.outputs)
    gpu.forward(name, *[device(cp, x, dtype) for x in xs], out=outs)
    for o, got, w in zip(op.outputs, outs, reference(ref.forward, name, *xs)):
        check(f"{name}.{o.name}", got, w, cp)
    if not op.grads:
        return
    douts = [host_values(rng, (n,), -1, 1, dtype) for _ in op.outputs]
    grads = tuple(poisoned(cp, (n,), np.float32 if dtype == "f32" else np.uint16)
                  for _ in op.grads)
    gpu.backward(name, *[device(cp, a, dtype) for a in xs + douts], out=grads)
    for g, got, w in zip(op.grads, grads, reference(ref.backward, name, *xs, *douts)):
        check(f"{name}.d{g}", got, w, cp)


@pytest.mark.parametrize("name", _ops("pointwise")[:1])
def test_pointwise_on_unaligned_views(name, cp, libs):
    """Views starting one element in take the kernels' scalar path for every element."""
    gpu, ref = libs
    op = OPS[name]
    rng = np.random.default_rng(5)
    xs = [host_values(rng, (1001,), *domain(op, o.name), "f32") for o in op.inputs]
    outs = tuple(poisoned(cp, (1001,), np.float32)[1:] for _ in op.outputs)
    gpu.forward(name, *[device(cp, x, "f32")[1:] for x in xs], out=outs)
    for o, got, w in zip(op.outputs, outs, reference(ref.forward, name, *[x[1:] for x in xs])):
        check(f"{name}.{o.name}[1:]", got, w, cp)


def test_a_2_28_element_pointwise_forward_writes_every_element(cp, libs):
    names = _ops("pointwise")
    if not names:
        pytest.skip("no pointwise op in the manifest")
    name = "gelu" if "gelu" in names else names[0]
    gpu, ref = libs
    op = OPS[name]
    n = 1 << 28
    progress(f"pointwise {name} n=2^28 f32")
    rng = np.random.default_rng(28)
    cp.random.seed(28)
    ins = []
    for o in op.inputs:
        lo, hi = domain(op, o.name)
        ins.append(cp.random.random(n, dtype=cp.float32) * np.float32(hi - lo) + np.float32(lo))
    outs = tuple(poisoned(cp, (n,), np.float32) for _ in op.outputs)
    gpu.forward(name, *ins, out=outs)
    for o, y in zip(op.outputs, outs):
        assert not bool(cp.isnan(y).any()), f"{name}.{o.name}: unwritten elements at 2^28"
    # The reference on a sample that includes the first and last elements.
    idx = np.unique(np.concatenate([rng.integers(0, n, 1 << 20), [0, 1, n - 2, n - 1]]))
    idx_dev = cp.asarray(idx)
    want = reference(ref.forward, name, *[cp.asnumpy(a[idx_dev]).astype(np.float64) for a in ins])
    for o, y, w in zip(op.outputs, outs, want):
        check(f"{name}.{o.name} (2^28, sampled)", y[idx_dev], w, cp)
    del ins, outs
    cp.get_default_memory_pool().free_all_blocks()


# ---- row ---------------------------------------------------------------------------------

# (rows, cols): cols from one element to a GPT-2 vocabulary row; 37 rows is not a multiple
# of the 8 rows a warp-per-row block takes, and 3000 rows exceed grid_max · rows_per_block,
# so workers loop over rows and the weight-gradient partials hold several rows each. 12000
# columns: LayerNorm's backward split (plan.WGRAD_SPLIT_COLS), RMSNorm's fused, re-reading
# the columns it does not cache; 50257: both split. In bf16, stages without weight gradients
# hold 1000 (a block of one warp), 2048 and 5001 (a tail past the last whole vector) in a
# block's registers (block_held).
ROW_SHAPES = [(5, 1), (37, 17), (3000, 17), (64, 768), (40, 1000), (33, 2048), (19, 5001),
              (24, 12000), (9, 50257)]


def row_inputs(op, rng, rows, cols, dtype):
    host = []
    for o in op.inputs:
        if o.role == "index":
            host.append(rng.integers(0, cols, size=rows).astype(np.int32))
        elif o.role == "weight":
            host.append(host_values(rng, (cols,), *domain(op, o.name), dtype))
        else:
            host.append(host_values(rng, (rows, cols), *domain(op, o.name), dtype))
    return host


def to_device(cp, host, dtype):
    return [cp.asarray(h) if h.dtype == np.int32 else device(cp, h, dtype) for h in host]


def _storage(dtype):
    return np.float32 if dtype == "f32" else np.uint16


def _out_shape(o, rows, cols):
    return (rows,) if o.role == "scalar" else (rows, cols)


def _out_dtype(o, dtype):
    # Per-row scalars (a loss) are stored as float32 whatever the storage dtype.
    return np.float32 if o.role == "scalar" else _storage(dtype)


@both_dtypes
@pytest.mark.parametrize("rows,cols", ROW_SHAPES)
@pytest.mark.parametrize("name", _ops("row"))
def test_row_forward_and_backward_match_numpy(name, rows, cols, dtype, cp, libs):
    gpu, ref = libs
    op = OPS[name]
    progress(f"row {name} {rows}x{cols} {dtype}")
    rng = np.random.default_rng(rows * 100_003 + cols)
    host = row_inputs(op, rng, rows, cols, dtype)
    outs = tuple(poisoned(cp, _out_shape(o, rows, cols), _out_dtype(o, dtype)) for o in op.outputs)
    gpu.forward(name, *to_device(cp, host, dtype), out=outs)
    for o, got, w in zip(op.outputs, outs, reference(ref.forward, name, *host)):
        check(f"{name}.{o.name}", got, w, cp)
    if not op.grads:
        return
    douts = [host_values(rng, _out_shape(o, rows, cols), -1, 1,
                         "f32" if o.role == "scalar" else dtype) for o in op.outputs]
    douts_dev = [cp.asarray(d.astype(np.float32)) if o.role == "scalar" else device(cp, d, dtype)
                 for o, d in zip(op.outputs, douts)]
    role = {o.name: o.role for o in op.inputs}
    grads = tuple(poisoned(cp, (cols,) if role[g] == "weight" else (rows, cols), _storage(dtype))
                  for g in op.grads)
    gpu.backward(name, *to_device(cp, host, dtype), *douts_dev, out=grads)
    for g, got, w in zip(op.grads, grads, reference(ref.backward, name, *host, *douts)):
        check(f"{name}.d{g}", got, w, cp)
    # Weight grads are reduced across rows in a fixed order (no float atomics): a second
    # call gives the same bits.
    again = tuple(poisoned(cp, g.shape, g.dtype) for g in grads)
    gpu.backward(name, *to_device(cp, host, dtype), *douts_dev, out=again)
    for g, a, b in zip(op.grads, grads, again):
        assert cp.asnumpy(a).tobytes() == cp.asnumpy(b).tobytes(), f"{name}.d{g}: two runs differ"


@both_dtypes
@pytest.mark.parametrize("shift_in,shift_out", [(1, 1), (3, 3), (1, 0)])
@pytest.mark.parametrize("name", _ops("row"))
def test_row_kernels_on_views_that_start_off_a_16_byte_boundary(name, shift_in, shift_out, dtype,
                                                                cp, libs):
    """Row inputs and outputs that start `shift` elements into a buffer: at equal shifts the
    kernels take a scalar head, a 16-byte body and a scalar tail per row (rows of 203
    columns start at every offset); at different ones, scalar accesses throughout."""
    gpu, ref = libs
    op = OPS[name]
    rows, cols = 11, 203
    progress(f"row {name} views shifted {shift_in}/{shift_out} {dtype}")
    rng = np.random.default_rng(shift_in * 10 + shift_out)
    host = row_inputs(op, rng, rows, cols, dtype)

    def shifted(a, shift):
        flat = cp.empty(a.size + shift, dtype=a.dtype)
        view = flat[shift:].reshape(a.shape)
        view[...] = a
        return view
    dev = [shifted(d, shift_in) if o.role == "row" else d
           for o, d in zip(op.inputs, to_device(cp, host, dtype))]
    outs = tuple(shifted(poisoned(cp, _out_shape(o, rows, cols), _out_dtype(o, dtype)),
                         shift_out if o.role == "row" else 0) for o in op.outputs)
    gpu.forward(name, *dev, out=outs)
    for o, got, w in zip(op.outputs, outs, reference(ref.forward, name, *host)):
        check(f"{name}.{o.name}", got, w, cp)
    if not op.grads:
        return
    douts = [host_values(rng, _out_shape(o, rows, cols), -1, 1,
                         "f32" if o.role == "scalar" else dtype) for o in op.outputs]
    douts_dev = [cp.asarray(d.astype(np.float32)) if o.role == "scalar"
                 else shifted(device(cp, d, dtype), shift_in) for o, d in zip(op.outputs, douts)]
    role = {o.name: o.role for o in op.inputs}
    grads = tuple(poisoned(cp, (cols,), _storage(dtype)) if role[g] == "weight"
                  else shifted(poisoned(cp, (rows, cols), _storage(dtype)), shift_out)
                  for g in op.grads)
    gpu.backward(name, *dev, *douts_dev, out=grads)
    for g, got, w in zip(op.grads, grads, reference(ref.backward, name, *host, *douts)):
        check(f"{name}.d{g}", got, w, cp)


def _fused_ops():
    return sorted(n for n in _ops("row") if any(k.stage == "fwdbwd" for k in OPS[n].kernels.values()))


@both_dtypes
@pytest.mark.parametrize("rows,cols", [(37, 17), (64, 768), (9, 50257)])
@pytest.mark.parametrize("name", _fused_ops())
def test_fused_fwdbwd_writes_the_gradient_over_its_input(name, rows, cols, dtype, cp, libs):
    """lib.fused (cross-entropy: loss and dlogits in one pass), dlogits aliasing logits."""
    gpu, ref = libs
    op = OPS[name]
    progress(f"fused {name} {rows}x{cols} {dtype}")
    rng = np.random.default_rng(cols)
    host = row_inputs(op, rng, rows, cols, dtype)
    douts = [host_values(rng, (rows,), 0.5, 1.5, "f32") for o in op.outputs]
    dev = to_device(cp, host, dtype)
    outs = tuple(poisoned(cp, (rows,), np.float32) for _ in op.outputs)
    row_inputs_dev = [d for o, d in zip(op.inputs, dev) if o.differentiable and o.role == "row"]
    gpu.fused(name, *dev, *[cp.asarray(d.astype(np.float32)) for d in douts],
              out=outs + tuple(row_inputs_dev))
    want = reference(ref.fused, name, *host, *douts)
    for label, got, w in zip([o.name for o in op.outputs] + [f"d{g}" for g in op.grads],
                             outs + tuple(row_inputs_dev), want):
        check(f"{name}.fused.{label}", got, w, cp)


# ---- pair (rope) ---------------------------------------------------------------------------

# Positions stay below 64: an fp32 angle pos·base^(-2k/D) carries pos times the rounding
# of base^(-2k/D), about 1e-7 rad per unit of position, which past ~100 positions alone
# exceeds 1e-5 of the output's scale (PyTorch's fp32 tables share that limit).
@both_dtypes
@pytest.mark.parametrize("shape", [(1, 1, 1, 2), (2, 17, 3, 64), (3, 64, 4, 128)])
@pytest.mark.parametrize("name", _ops("pair"))
def test_pair_forward_and_backward_on_views_of_a_fused_buffer(name, shape, dtype, cp, libs):
    gpu, ref = libs
    op = OPS[name]
    B, T, H, D = shape
    progress(f"pair {name} {shape} {dtype}")
    rng = np.random.default_rng(D)
    # Each input is one slot of a [B, T, 3, H, D] buffer: a strided view, as q and k are
    # views of a fused qkv projection.
    fused = host_values(rng, (B, T, 3, H, D), -3, 3, dtype)
    fused_dev = device(cp, fused, dtype)
    xs = [fused[:, :, i] for i in range(len(op.inputs))]
    outs = tuple(poisoned(cp, shape, _storage(dtype)) for _ in op.outputs)
    gpu.forward(name, *[fused_dev[:, :, i] for i in range(len(op.inputs))], out=outs)
    for o, got, w in zip(op.outputs, outs, reference(ref.forward, name, *xs)):
        check(f"{name}.{o.name}", got, w, cp)
    douts = [host_values(rng, shape, -1, 1, dtype) for _ in op.outputs]
    grads = tuple(poisoned(cp, shape, _storage(dtype)) for _ in op.grads)
    gpu.backward(name, *[fused_dev[:, :, i] for i in range(len(op.inputs))],
                 *[device(cp, d, dtype) for d in douts], out=grads)
    for g, got, w in zip(op.grads, grads, reference(ref.backward, name, *xs, *douts)):
        check(f"{name}.d{g}", got, w, cp)


# Each case: (shape, pos0, where the operands sit, in place). 'fused': slots of a [B, T, 3, H,
# D] buffer (16-byte aligned: the vector path); 'offset': one element into a flat buffer (no
# operand 16-byte aligned: the scalar path; a 16-byte access there faults). B·T·H·D of
# 3.1M at H·D/2 = 2048 pairs a token, far more than a block's threads.
PAIR_PATHS = {
    "vector path": ((16, 48, 32, 128), 0, "fused", False),
    "vector path, pos0 > 0": ((16, 48, 32, 128), 9, "fused", False),
    "vector path in place": ((16, 48, 32, 128), 5, "fused", True),
    "unaligned offset: scalar path": ((4, 17, 8, 64), 3, "offset", False),
    "unaligned offset in place": ((4, 17, 8, 64), 0, "offset", True),
    "D/2 = 6, no multiple of the vector": ((3, 20, 5, 12), 2, "fused", False),
    "D/2 = 264, two table chunks": ((2, 9, 3, 528), 4, "fused", False),
    "D/2 = 24: a thread's vectors cross heads": ((4, 33, 100, 48), 2, "fused", False),
}


def _pair_operands(cp, host: list[np.ndarray], where: str, dtype: str) -> list:
    """Device views holding `host`'s values, laid out as the case says."""
    B, T, H, D = host[0].shape
    if where == "fused":
        buf = device(cp, np.stack(host + [np.zeros_like(host[0])] * (3 - len(host)), 2), dtype)
        return [buf[:, :, i] for i in range(len(host))]
    views = []
    for h in host:
        flat = cp.zeros(1 + h.size, dtype=_storage(dtype))
        flat[1:] = device(cp, h, dtype).ravel()
        views.append(flat[1:].reshape(h.shape))
    return views


@both_dtypes
@pytest.mark.parametrize("case", PAIR_PATHS)
@pytest.mark.parametrize("name", _ops("pair"))
def test_pair_vector_and_scalar_paths_at_size(name, case, dtype, cp, libs):
    gpu, ref = libs
    op = OPS[name]
    shape, pos0, where, in_place = PAIR_PATHS[case]
    progress(f"pair {name} {case} {shape} {dtype}")
    rng = np.random.default_rng(shape[-1])
    xs = [host_values(rng, shape, -3, 3, dtype) for _ in op.inputs]
    douts = [host_values(rng, shape, -1, 1, dtype) for _ in op.outputs]
    want = reference(ref.forward, name, *xs, pos0=pos0)
    want_grads = reference(ref.backward, name, *xs, *douts, pos0=pos0)
    xs_dev = _pair_operands(cp, xs, where, dtype)
    douts_dev = _pair_operands(cp, douts, where, dtype)
    grads = (tuple(douts_dev[:len(op.grads)]) if in_place
             else tuple(poisoned(cp, shape, _storage(dtype)) for _ in op.grads))
    # The backward first: in place, the forward overwrites the inputs it reads.
    gpu.backward(name, *xs_dev, *douts_dev, out=grads, pos0=pos0)
    outs = (tuple(xs_dev[:len(op.outputs)]) if in_place
            else tuple(poisoned(cp, shape, _storage(dtype)) for _ in op.outputs))
    gpu.forward(name, *xs_dev, out=outs, pos0=pos0)
    for o, got, w in zip(op.outputs, outs, want):
        check(f"{name}.{o.name} {case}", got, w, cp)
    for g, got, w in zip(op.grads, grads, want_grads):
        check(f"{name}.d{g} {case}", got, w, cp)


# ---- update (adamw, lion, sgd_momentum; muon's matrix step: tests/gpu/test_optimizer_gpu.py) --

# autocast: float32 grads beside the weight's bf16 copy (training.precision autocast)
@pytest.mark.parametrize("dtype", ["f32", "bf16", "autocast"])
@pytest.mark.parametrize("n", [1, 13, 4099, (1 << 20) + 5])
@pytest.mark.parametrize("name", [n for n in _ops("update") if OPS[n].matrix is None])
def test_update_step_matches_numpy(name, n, dtype, cp, libs):
    from eulergen.runtime.engine.bf16 import to_bf16
    gpu, ref = libs
    op = OPS[name]
    progress(f"update {name} n={n} {dtype}")
    grads = "f32" if dtype == "autocast" else dtype
    rng = np.random.default_rng(n)
    host = [host_values(rng, (n,), *domain(op, o.name), grads if o.role == "grad" else "f32")
            for o in op.inputs]
    dev = [device(cp, h, grads if o.role == "grad" else "f32") for o, h in zip(op.inputs, host)]
    runtime = {k: (3.0 if k == "step" else 1e-3) for k, v in op.params.items() if v is None}
    host32 = [h.astype(np.float32) for h in host]
    copy = None if dtype == "f32" else cp.zeros(n, cp.uint16)
    gpu.step(name, *dev, copy=copy, **runtime)
    ref.step(name, *host, **runtime)
    ref.step(name, *host32, **runtime)
    for o, got, w, w32 in zip(op.inputs, dev, host, host32):
        if o.role == "state":   # state is float32 in every variant
            check(f"{name}.{o.name}", got, (w, w32.astype(np.float64)), cp)
    if copy is not None:   # the updated weight (the first state input), rounded once
        weight = next(d for o, d in zip(op.inputs, dev) if o.role == "state")
        np.testing.assert_array_equal(cp.asnumpy(copy), to_bf16(cp.asnumpy(weight)))


# ---- embedding -----------------------------------------------------------------------------

@both_dtypes
@pytest.mark.parametrize("shape,vocab,C,positions", [((3, 17), 50, 1, True), ((2, 64), 7, 768, True),
                                                   ((8, 1024), 50304, 768, True),
                                                   ((4, 9), 100, 20, False)])
@pytest.mark.parametrize("name", _ops("embedding"))
def test_embedding_forward_and_deterministic_backward(name, shape, vocab, C, positions, dtype,
                                                      cp, libs):
    """Repeated ids (7 ids over 128 tokens) sum every row; C = 1 and 20 take the scalar
    path, 768 the 16-byte one; without positions wpe is absent (a null pointer)."""
    gpu, ref = libs
    progress(f"embedding {shape} V={vocab} C={C} {dtype}")
    rng = np.random.default_rng(C)
    ids = rng.integers(0, vocab, shape).astype(np.int32)
    wte = host_values(rng, (vocab, C), -1, 1, dtype)
    wpe = host_values(rng, (shape[-1], C), -1, 1, dtype) if positions else None
    dev = lambda a: None if a is None else device(cp, a, dtype)  # noqa: E731
    out = poisoned(cp, shape + (C,), _storage(dtype))
    gpu.forward(name, cp.asarray(ids), dev(wte), dev(wpe), out=out)
    check(f"{name}.out", out, reference(ref.forward, name, ids, wte, wpe)[0], cp)
    dout = host_values(rng, shape + (C,), -1, 1, dtype)
    grads = (poisoned(cp, (vocab, C), _storage(dtype)),
             poisoned(cp, (shape[-1], C), _storage(dtype)) if positions else None)
    gpu.backward(name, cp.asarray(ids), dev(wte), dev(wpe), dev(dout), out=grads)
    for label, got, w in zip(("dwte", "dwpe"), grads,
                             reference(ref.backward, name, ids, wte, wpe, dout)):
        if got is not None:
            check(f"{name}.{label}", got, w, cp)
    again = poisoned(cp, (vocab, C), _storage(dtype))
    gpu.backward(name, cp.asarray(ids), dev(wte), dev(wpe), dev(dout),
                 out=(again, None if wpe is None else cp.empty_like(grads[1])))
    assert bool((again == grads[0]).all()), "embedding backward is not bitwise repeatable"


# ---- bad input is refused before a launch --------------------------------------------------

def test_mismatched_shapes_and_dtypes_raise_before_launch(cp, libs):
    gpu, _ = libs
    pw = _ops("pointwise")
    rows = [n for n in _ops("row") if any(o.role == "weight" for o in OPS[n].inputs)]
    if not pw or not rows:
        pytest.skip("needs a pointwise op and a row op with a weight")
    name = pw[0]
    n_in = len(OPS[name].inputs)
    x = cp.ones(100, cp.float32)
    y = poisoned(cp, (99,), np.float32)
    with pytest.raises(EulerError, match="shape"):
        gpu.forward(name, *[x] * n_in, out=(y,) * len(OPS[name].outputs))
    assert bool(cp.isnan(y).all()), "a refused call wrote its output"
    with pytest.raises(EulerError, match="float32 or bf16"):
        gpu.forward(name, *[cp.ones(100, cp.float64)] * n_in)
    rn = rows[0]
    op = OPS[rn]
    args = [cp.zeros(8, cp.int32) if o.role == "index" else
            cp.ones(31, cp.float32) if o.role == "weight" else cp.ones((8, 32), cp.float32)
            for o in op.inputs]
    with pytest.raises(EulerError, match=r"has shape \(31,\), expected \(32,\)"):
        gpu.forward(rn, *args)
    args = [cp.zeros(8, cp.int32) if o.role == "index" else
            cp.ones(32, cp.uint16) if o.role == "weight" else cp.ones((8, 32), cp.float32)
            for o in op.inputs]
    with pytest.raises(EulerError, match="dtype uint16, expected float32"):
        gpu.forward(rn, *args)
    args = [cp.zeros(8, cp.int32) if o.role == "index" else
            cp.ones(32, cp.float32) if o.role == "weight" else cp.ones((32, 8), cp.float32).T
            for o in op.inputs]
    with pytest.raises(EulerError, match="not C-contiguous"):
        gpu.forward(rn, *args)
