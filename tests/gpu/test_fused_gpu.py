"""The fused variants' kernels (generator/fuse.py) on the GPU, against the numpy backend's
fused functions, in fp32 and bf16, through OpLibrary as the model calls them:

- a norm's `add` fusion: forward_add (x + branch and the norm of it) and backward_add, the
  norm's dx added to the stream's gradient in place over it, at row lengths from 17 to a
  vocabulary's (the split backward from plan.WGRAD_SPLIT_COLS), with weight gradients
  reduced in a fixed order (two calls give the same bits);
- a norm in the autocast precision (its float32 stream, gradient and weights, bf16 branch,
  output and dy, the bf16 copy of dx);
- a pointwise op's `bias` fusion: forward_bias and backward_bias over [rows, F] with a bias
  [F] a row, its gradient's column sums reduced in a fixed order, on aligned arrays and on
  views one element in (the `_unaligned` kernels);
- the model: a gradient-accumulated step (the fused bias and norm weight gradients added
  on the second micro-step) against one step over the whole batch.

Tolerances are tests/gpu/test_kernels.py's (check): fp32 within 1e-5 of an output's scale,
bf16 within half an ulp, each plus the float32 evaluation-order allowance.
"""
from __future__ import annotations

import numpy as np
import pytest

from eulergen.runtime.engine import bf16
from eulergen.runtime.engine.manifest import load_manifest
from test_kernels import (MANIFEST, as_f64, check, device, domain, host_values,  # noqa: E402
                          poisoned, progress, reference)

pytestmark = pytest.mark.gpu

OPS = load_manifest(MANIFEST).ops if MANIFEST.exists() else {}
ADD_OPS = sorted(n for n, o in OPS.items() if "add" in o.fusions)
BIAS_OPS = sorted(n for n, o in OPS.items() if "bias" in o.fusions)
# 17: short rows; 768: GPT-2's; 1000 and 5001: a block's rows (bf16: held in registers);
# 50257: a vocabulary row, the split backward in both dtypes
ADD_SHAPES = [(37, 17), (3000, 768), (40, 1000), (19, 5001), (9, 50257)]
BIAS_SHAPES = [(1, 7), (37, 100), (8192, 768), (1024, 3072)]


def _storage(dtype):
    return np.float32 if dtype == "f32" else np.uint16


def _fused(ref, fusion: str, call: str):
    """The numpy backend's call of a fused variant, as reference() takes it."""
    return lambda name, *arrays, **params: getattr(ref, call)(name, *arrays, fusion=fusion,
                                                              **params)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("rows,cols", ADD_SHAPES)
@pytest.mark.parametrize("name", ADD_OPS)
def test_add_fusion_matches_numpy_and_adds_into_the_stream_gradient_in_place(
        name, rows, cols, dtype, cp, libs):
    gpu, ref = libs
    op = OPS[name]
    fusion = op.fusions["add"]
    progress(f"add fusion {name} {rows}x{cols} {dtype}")
    rng = np.random.default_rng(rows + cols)
    x, branch = (host_values(rng, (rows, cols), -2, 2, dtype) for _ in range(2))
    weights = [host_values(rng, (cols,), *domain(op, o.name), dtype)
               for o in fusion.backward.inputs if o.role == "weight"]
    outs = tuple(poisoned(cp, (rows, cols), _storage(dtype)) for _ in range(2))
    gpu.forward(name, device(cp, x, dtype), device(cp, branch, dtype),
                *[device(cp, w, dtype) for w in weights], out=outs, fusion="add")
    for o, got, want in zip(fusion.forward.outputs, outs,
                            reference(_fused(ref, "add", "forward"), name, x, branch, *weights)):
        check(f"{name}.forward_add.{o.name}", got, want, cp)

    h = as_f64(cp, outs[0])                    # the stream as the kernel stored it
    dy, dh = (host_values(rng, (rows, cols), -1, 1, dtype) for _ in range(2))
    want = reference(_fused(ref, "add", "backward"), name, h, *weights, dy, dh)
    results = []
    for _ in range(2):
        stream = device(cp, dh, dtype)
        dws = tuple(poisoned(cp, (cols,), _storage(dtype)) for _ in weights)
        gpu.backward(name, device(cp, h, dtype), *[device(cp, w, dtype) for w in weights],
                     device(cp, dy, dtype), stream, out=(stream, *dws), fusion="add")
        results.append((stream, *dws))
    for g, got, w in zip(fusion.backward.grads, results[0], want):
        check(f"{name}.backward_add.d{g}", got, w, cp)
    for g, a, b in zip(fusion.backward.grads, *results):
        assert cp.asnumpy(a).tobytes() == cp.asnumpy(b).tobytes(), f"{name}.d{g}: two runs differ"


@pytest.mark.parametrize("rows,cols", ADD_SHAPES)
@pytest.mark.parametrize("name", ADD_OPS)
def test_autocast_norm_reads_a_float32_stream_and_writes_float32_gradients(name, rows, cols,
                                                                          cp, libs):
    """precision="autocast": the op's forward from the float32 stream (the stem's) and the
    add fusion's (a bf16 branch, the sum float32), y bf16; the add backward's dx added in
    place into the float32 d_stream with its bf16 copy, and the op's own backward (ln_f's,
    no copy); the float32 weight gradients, each call twice for the same bits."""
    gpu, ref = libs
    op = OPS[name]
    fusion = op.fusions["add"]
    progress(f"autocast {name} {rows}x{cols}")
    rng = np.random.default_rng(rows + 3 * cols)
    x, dh = (host_values(rng, (rows, cols), -2, 2, "f32") for _ in range(2))
    branch, dy = (host_values(rng, (rows, cols), -2, 2, "bf16") for _ in range(2))
    weights = [host_values(rng, (cols,), *domain(op, o.name), "f32")
               for o in fusion.backward.inputs if o.role == "weight"]
    ws = [device(cp, w, "f32") for w in weights]
    y = poisoned(cp, (rows, cols), np.uint16)
    gpu.forward(name, device(cp, x, "f32"), *ws, out=y, precision="autocast")
    check(f"{name}.forward (autocast)", y, reference(ref.forward, name, x, *weights)[0], cp)
    outs = (poisoned(cp, (rows, cols), np.float32), poisoned(cp, (rows, cols), np.uint16))
    gpu.forward(name, device(cp, x, "f32"), device(cp, branch, "bf16"), *ws, out=outs,
                fusion="add", precision="autocast")
    for o, got, want in zip(fusion.forward.outputs, outs,
                            reference(_fused(ref, "add", "forward"), name, x, branch, *weights)):
        check(f"{name}.forward_add.{o.name} (autocast)", got, want, cp)

    h = as_f64(cp, outs[0])
    for call, extra in (("backward_add", [dh]), ("backward", [])):
        fused = call == "backward_add"
        fn = _fused(ref, "add", "backward") if fused else ref.backward
        want = reference(fn, name, h, *weights, dy, *extra)
        results = []
        for _ in range(2):
            dx = device(cp, dh, "f32") if fused else poisoned(cp, (rows, cols), np.float32)
            copy = poisoned(cp, (rows, cols), np.uint16) if fused else None
            dws = tuple(poisoned(cp, (cols,), np.float32) for _ in weights)
            gpu.backward(name, device(cp, h, "f32"), *ws, device(cp, dy, "bf16"),
                         *([dx] if fused else []), out=(dx, *dws), copy=copy,
                         fusion="add" if fused else "", precision="autocast")
            results.append((dx, *dws))
            if copy is not None:   # dx as written, rounded once
                assert cp.asnumpy(copy).tobytes() == cp.asnumpy(
                    bf16.to_bf16(dx)).tobytes(), f"{name}.{call}: the copy"
        for g, got, w in zip(fusion.backward.grads, results[0], want):
            check(f"{name}.{call}.d{g} (autocast)", got, w, cp)
        for g, a, b in zip(fusion.backward.grads, *results):
            assert cp.asnumpy(a).tobytes() == cp.asnumpy(b).tobytes(), f"{name}.d{g}: two runs"


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("rows,cols", BIAS_SHAPES)
@pytest.mark.parametrize("name", BIAS_OPS)
def test_bias_fusion_matches_numpy_with_the_bias_gradient_summed_over_rows(
        name, rows, cols, dtype, cp, libs):
    gpu, ref = libs
    op = OPS[name]
    fusion = op.fusions["bias"]
    progress(f"bias fusion {name} {rows}x{cols} {dtype}")
    rng = np.random.default_rng(rows * 7 + cols)
    host = [host_values(rng, (cols,), -1, 1, dtype) if o.role == "bias"
            else host_values(rng, (rows, cols), *domain(op, o.name), dtype)
            for o in fusion.forward.inputs]
    outs = tuple(poisoned(cp, (rows, cols), _storage(dtype)) for _ in fusion.forward.outputs)
    gpu.forward(name, *[device(cp, a, dtype) for a in host], out=outs, fusion="bias")
    for o, got, want in zip(fusion.forward.outputs, outs,
                            reference(_fused(ref, "bias", "forward"), name, *host)):
        check(f"{name}.forward_bias.{o.name}", got, want, cp)
    douts = [host_values(rng, (rows, cols), -1, 1, dtype) for _ in fusion.forward.outputs]
    shapes = {o.name: a.shape for o, a in zip(fusion.forward.inputs, host)}
    results = []
    for _ in range(2):
        grads = tuple(poisoned(cp, shapes[g], _storage(dtype)) for g in fusion.backward.grads)
        gpu.backward(name, *[device(cp, a, dtype) for a in host + douts], out=grads,
                     fusion="bias")
        results.append(grads)
    want = reference(_fused(ref, "bias", "backward"), name, *host, *douts)
    for g, got, w in zip(fusion.backward.grads, results[0], want):
        check(f"{name}.backward_bias.d{g}", got, w, cp)
    for g, a, b in zip(fusion.backward.grads, *results):
        assert cp.asnumpy(a).tobytes() == cp.asnumpy(b).tobytes(), f"{name}.d{g}: two runs differ"


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_bias_fusion_on_views_off_a_16_byte_boundary(dtype, cp, libs):
    """Arrays one element into their buffers take the `_unaligned` kernels."""
    gpu, ref = libs
    name = "gelu" if "gelu" in BIAS_OPS else BIAS_OPS[0]
    fusion = OPS[name].fusions["bias"]
    rows, cols = 33, 256
    rng = np.random.default_rng(9)

    def shifted(a):
        flat = cp.empty(a.size + 1, dtype=a.dtype)
        view = flat[1:].reshape(a.shape)
        view[...] = a
        return view

    host = [host_values(rng, (cols,) if o.role == "bias" else (rows, cols), -2, 2, dtype)
            for o in fusion.forward.inputs]
    dy = host_values(rng, (rows, cols), -1, 1, dtype)
    shapes = [a.shape for a in host]
    grads = tuple(shifted(poisoned(cp, s, _storage(dtype))) for s in shapes)
    gpu.backward(name, *[shifted(device(cp, a, dtype)) for a in host + [dy]], out=grads,
                 fusion="bias")
    want = reference(_fused(ref, "bias", "backward"), name, *host, dy)
    for g, got, w in zip(fusion.backward.grads, grads, want):
        check(f"{name}.backward_bias.d{g} (views)", got, w, cp)


@pytest.mark.parametrize("structure", ["gpt2", "nanoeuler+bias"])
def test_an_accumulated_step_adds_the_fused_gradients_on_its_second_micro_step(structure, libs):
    """Two micro-steps of one row each against one step of both rows: the norms' weight
    gradients and the activation's bias gradient are written on the first and added on the
    second (through the tape's scratch); the stream's gradient is added into in the norms'
    own kernels on both."""
    from eulergen.runtime.train.config import load_config
    from eulergen.runtime.model.gpt import build
    from test_model_gpu import COMMON, STRUCTURES   # noqa: E402
    gpu, _ = libs
    cfg = load_config(None, STRUCTURES[structure] + COMMON).model
    rng = np.random.default_rng(3)
    x, y = (rng.integers(0, cfg.vocab_size, (2, 64)) for _ in range(2))
    full = build(cfg, gpu, 2, 64, tf32=False)
    full.init_weights(4)
    weights = full.state_dict()
    full.load_tokens(x, y)
    full.loss_and_grad()
    half = build(cfg, gpu, 1, 64, tf32=False)
    half.load_state_dict(weights)
    half.set_accumulation(2)
    for row in range(2):
        half.load_tokens(x[row:row + 1], y[row:row + 1])
        half.loss_and_grad(accumulate=row > 0)
    for name, g in full.grads.items():
        want = gpu.backend.asnumpy(g)
        got = gpu.backend.asnumpy(half.grads[name])
        err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-12)
        assert err < 1e-4, f"{structure} {name}: accumulated {err:.2e} off the full batch's"
