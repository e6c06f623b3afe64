"""The Linear layers' bias-gradient column sums on the GPU (`pytest -m gpu
tests/gpu/test_colsum_gpu.py`): runtime/engine/colsum.py at GPT-2's shapes against the
float64 sums (within half a unit of the output's dtype plus float32's error of a rows-term
sum, as tests/test_colsum_emulated.py states it), the same bits at every run, a float32
gradient of bf16 rows (autocast) added to, and rows the aligned kernel cannot take. The
model's bias gradients through it: tests/gpu/test_model_gpu.py and test_scale_gpu.py."""
from __future__ import annotations

import numpy as np
import pytest

from eulergen.runtime.engine import bf16

pytestmark = pytest.mark.gpu


def _matrix(cp, rows, cols, dt, seed):
    host = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    stored = bf16.to_bf16(host) if dt == "bf16" else host
    exact = (bf16.from_bf16(stored) if dt == "bf16" else stored).astype(np.float64)
    return exact, cp.asarray(stored)


def _within(got, want, x):
    got_ = got.get()
    half = 2.0 ** -8 if got_.dtype == np.uint16 else 2.0 ** -24
    got_ = (bf16.from_bf16(got_) if got_.dtype == np.uint16 else got_).astype(np.float64)
    bound = half * np.abs(want) + x.shape[0] * 2.0 ** -24 * np.abs(x).sum(0) + 1e-30
    assert (np.abs(got_ - want) <= bound).all(), np.abs(got_ - want).max()


def _workspace(cp, rows, cols, dt):
    from eulergen.runtime.engine.cuda_ops import workspace_elements
    from eulergen.runtime.engine.kinds import support
    n = workspace_elements(support.entry("colsum"), "partials", (rows, cols), dt)
    return cp.zeros(n, cp.float32)


@pytest.mark.parametrize("dt,out", [("f32", "f32"), ("bf16", "bf16"), ("bf16", "f32")])
@pytest.mark.parametrize("cols", [768, 2304, 3840])
def test_the_column_sums_of_a_step_are_right_and_the_same_at_every_run(cp, dt, out, cols):
    from eulergen.runtime.engine.colsum import colsum
    x, xd = _matrix(cp, 8192, cols, dt, cols)
    ws = _workspace(cp, 8192, cols, dt)
    db = cp.zeros(cols, cp.float32 if out == "f32" else cp.uint16)
    colsum(xd, db, workspace=ws)
    first = db.copy()
    colsum(xd, db, workspace=ws)
    assert (db == first).all()
    _within(db, x.sum(0), x)
    colsum(xd, db, workspace=ws, add=True)   # a later micro-step: one rounding of the sum
    old = first.get()
    old = (bf16.from_bf16(old) if old.dtype == np.uint16 else old).astype(np.float64)
    _within(db, old + x.sum(0), x)


@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_rows_the_aligned_kernel_cannot_take_are_summed_by_the_other(cp, dt):
    from eulergen.runtime.engine.colsum import colsum
    x, xd = _matrix(cp, 1000, 40, dt, 3)
    view = xd[:, 1:38]                              # 37 columns, rows 40 apart, off 16 bytes
    db = cp.zeros(37, cp.float32)
    colsum(view, db, workspace=_workspace(cp, 1000, 37, dt))
    _within(db, x[:, 1:38].sum(0), x[:, 1:38])
