"""Row ops with a sum of exponentials that may be accumulated against a running max
(ir.Online: softmax, log_softmax, cross_entropy), on the GPU, on rows with -inf entries: a
leading run, scattered, all but the last column (warps whose every element is -inf), and
none. Row lengths run from 1 to a GPT-2 vocabulary (17 and 768 take the warp-per-row
kernels, which keep the two-pass form; 2048 and 50257 the block-per-row ones, past their
registers, which accumulate online). fp32 only: the ∞-norm
relative error against numpy in float64 must be below 1e-5, -inf outputs where numpy
has them, and a second launch must give the same bits (fixed merge order).
"""
from __future__ import annotations

import numpy as np
import pytest

from eulergen import GENERATED_DIR
from eulergen.runtime.engine.manifest import load_manifest

from masked_logits import masked_rows

pytestmark = pytest.mark.gpu

MANIFEST = GENERATED_DIR / "manifest.json"
OPS = load_manifest(MANIFEST).ops if MANIFEST.exists() else {}
NAMES = [n for n in ("softmax", "log_softmax", "cross_entropy") if n in OPS]


def close(what: str, got: np.ndarray, want: np.ndarray) -> None:
    finite = np.isfinite(want)
    assert np.array_equal(got[~finite], want[~finite]), f"{what}: infinities differ"
    scale = float(np.max(np.abs(want[finite])))
    err = float(np.max(np.abs(got[finite] - want[finite])))
    assert err <= 1e-5 * scale, f"{what}: ∞-norm relative error {err / scale:.2e}"


@pytest.mark.parametrize("cols", [1, 17, 768, 2048, 50257])
@pytest.mark.parametrize("name", NAMES)
def test_online_row_kernels_match_numpy_on_rows_with_minus_infinity(name, cols, cp, libs):
    gpu, ref = libs
    op = OPS[name]
    rows = 12
    rng = np.random.default_rng(cols)
    x = masked_rows(rng, rows, cols)
    host = [x]
    if any(o.role == "index" for o in op.inputs):
        host.append(np.array([rng.choice(np.flatnonzero(np.isfinite(r))) for r in x], np.int32))
    dev = [cp.asarray(h.astype(np.float32) if h.dtype == np.float64 else h) for h in host]
    scalar = op.outputs[0].role == "scalar"
    dout = rng.uniform(-1, 1, (rows,) if scalar else (rows, cols)).astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        want_y = ref.forward(name, *host)
        want_dx = ref.backward(name, *host, dout.astype(np.float64))[0]

    y = gpu.forward(name, *dev)
    close(f"{name} y", cp.asnumpy(y).astype(np.float64), want_y)
    dx = gpu.backward(name, *dev, cp.asarray(dout))[0]
    close(f"{name} dx", cp.asnumpy(dx).astype(np.float64), want_dx)
    again = gpu.forward(name, *dev)
    assert cp.asnumpy(again).tobytes() == cp.asnumpy(y).tobytes(), f"{name}: two runs differ"
    if scalar:
        loss, dlogits = gpu.fused(name, *dev, cp.asarray(dout))
        close(f"{name} fused loss", cp.asnumpy(loss).astype(np.float64), want_y)
        close(f"{name} fused dx", cp.asnumpy(dlogits).astype(np.float64), want_dx)
