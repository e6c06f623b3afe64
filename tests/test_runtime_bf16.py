"""bf16 storage helpers: uint16 bit patterns, round-to-nearest-even like the kernels'
__float2bfloat16_rn (and torch's float → bfloat16)."""
from __future__ import annotations

import numpy as np
import pytest

from eulergen.runtime.ops import from_bf16, to_bf16


def test_widening_is_exact_and_rounding_is_idempotent():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(10_000).astype(np.float32) * 100
    b = to_bf16(x)
    assert b.dtype == np.uint16
    np.testing.assert_array_equal(to_bf16(from_bf16(b)), b)
    # One bf16 ulp is 2^-7 relative; round-to-nearest is within half of it.
    assert np.max(np.abs(from_bf16(b) - x) / np.abs(x)) <= 2.0 ** -8


def test_ties_round_to_even():
    # 1 + 2^-8 lies halfway between bf16 1.0 and 1 + 2^-7: even mantissa (1.0) wins;
    # 1 + 3·2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6: 1 + 2^-6 (even) wins.
    x = np.float32([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, -(1 + 2.0 ** -8)])
    np.testing.assert_array_equal(from_bf16(to_bf16(x)), [1.0, 1 + 2.0 ** -6, -1.0])


def test_specials_survive():
    x = np.float32([np.inf, -np.inf, np.nan, 0.0, -0.0, 3.4e38])
    y = from_bf16(to_bf16(x))
    assert y[0] == np.inf and y[1] == -np.inf and np.isnan(y[2])
    assert y[3] == 0 and np.signbit(y[4]) and y[5] == np.inf   # max float rounds up to inf
    nan_low_payload = np.uint32(0x7F800001).view(np.float32)
    assert np.isnan(from_bf16(to_bf16(np.float32([nan_low_payload]))))[0]


def test_matches_torch_bfloat16_rounding():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(100_000), rng.standard_normal(1000) * 1e30,
                        rng.standard_normal(1000) * 1e-38]).astype(np.float32)
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(to_bf16(x), want)
