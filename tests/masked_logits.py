"""Rows of logits with -inf entries, for the row kernels' online max and sum: shared by the
emulated (tests/test_cuda_emulated.py) and the GPU (tests/gpu/test_row_online.py) tests."""
from __future__ import annotations

import numpy as np


def masked_rows(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Logits in [-10, 10] (float32 values, as float64) with -inf entries as attention-style
    masks make them, row r of kind r % 4: none, a leading run of two thirds of the row,
    scattered (40%), all but the last column (lanes and warps whose every element is -inf
    merge with the one finite one). Every row keeps its last column finite."""
    x = rng.uniform(-10, 10, (rows, cols)).astype(np.float32).astype(np.float64)
    x[1::4, : (2 * cols) // 3] = -np.inf
    x[2::4][rng.random((len(x[2::4]), cols)) < 0.4] = -np.inf
    x[3::4, :-1] = -np.inf
    x[:, -1] = np.where(np.isfinite(x[:, -1]), x[:, -1], 1.5)
    return x
