"""The runtime's own kernels on the GPU (`pytest -m gpu tests/gpu/test_support_gpu.py`):
templates/step_control.cu.j2's step scalars against their numpy forms bit for bit,
moves.cu.j2's row moves against theirs (a strided source, bf16 bits, int32 ids), inside a
CUDA graph replayed at new positions too; each op compiled once through
runtime/engine/compile.py's cache. (The draw: tests/gpu/test_sample_gpu.py; the bf16 steps:
tests/gpu/test_bf16_gpu.py; the loss mean: the model tests.)"""
from __future__ import annotations

import numpy as np
import pytest

from eulergen.runtime.engine.manifest import BUILTIN_MANIFEST, load_manifest
from eulergen.runtime.generate.moves import scatter_rows, take_row
from eulergen.runtime.train import step_control as sc
from eulergen.step_record import RECORD

pytestmark = pytest.mark.gpu


def test_the_step_kernels_give_the_numpy_forms_bits(cp):
    rule = sc.StepRule(spike_factor=4.0, grad_clip=1.0, micro_steps=2, ranks=1, zero=False,
                       skip_at=0, scale_at=1, lr_at=2, step_at=3)
    rng = np.random.default_rng(0)
    want, want_c = np.zeros(len(RECORD)), np.zeros(4, np.float32)
    got, got_c = cp.zeros(len(RECORD)), cp.zeros(4, cp.float32)
    for step in range(40):
        losses = (2.0 + 0.1 * rng.standard_normal(2)).astype(np.float32) * (20 if step == 25 else 1)
        norm = np.float32([0.5 + rng.random()] if step != 30 else [np.inf])
        want[sc.AT["lr"]] = got[sc.AT["lr"]] = 1e-3 * step
        for i, loss in enumerate(losses):
            sc.accumulate(want, np.float32([loss]), i == 0)
            sc.accumulate(got, cp.asarray(np.float32([loss])), i == 0)
        sc.decide(want, want_c, norm, None, rule)
        sc.decide(got, got_c, cp.asarray(norm), None, rule)
        np.testing.assert_array_equal(got.get().view(np.uint64), want.view(np.uint64),
                                      err_msg=f"step {step}")
        np.testing.assert_array_equal(got_c.get().view(np.uint32), want_c.view(np.uint32))
    mine, theirs = np.zeros(1, np.float32), cp.zeros(1, cp.float32)
    sc.rank_loss(want, rule, mine)
    sc.rank_loss(got, rule, theirs)
    assert theirs.get().tobytes() == mine.tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.uint16, np.int32])
def test_scatter_and_take_move_every_bit_as_numpy_does(cp, dtype):
    rng = np.random.default_rng(1)
    B, T, S, H, D = 3, 5, 16, 2, 64
    qkv = rng.integers(0, 2 ** 15, (B, T, 3 * H, D)).astype(dtype)
    src = qkv[:, :, H:2 * H]                           # k of a fused qkv: strided rows
    positions = np.stack([rng.permutation(S)[:T] for _ in range(B)]).astype(np.int32)
    want = np.zeros((B, S, H, D), dtype)
    got = cp.asarray(want)
    scatter_rows(src, positions, want)
    scatter_rows(cp.asarray(qkv)[:, :, H:2 * H], cp.asarray(positions), got)
    np.testing.assert_array_equal(got.get(), want)
    index = np.int32([7])
    row, dev_row = np.zeros((B, H, D), dtype), cp.zeros((B, H, D), dtype)
    take_row(want, index, row)
    take_row(got, cp.asarray(index), dev_row)
    np.testing.assert_array_equal(dev_row.get(), row)


def test_a_captured_scatter_reads_the_positions_when_it_replays(cp):
    """After a warm-up launch (which compiles), the scatter is captured once and replayed
    with new device-held positions: no compile or allocation inside the capture."""
    from eulergen.runtime.engine.cuda_graph import capture
    src = cp.arange(2 * 3 * 8, dtype=cp.float32).reshape(2, 3, 8)
    positions = cp.asarray(np.int32([[0, 1, 2], [3, 4, 5]]))
    dst = cp.zeros((2, 8, 8), cp.float32)
    scatter_rows(src, positions, dst)
    graph = capture(cp.cuda.Stream(non_blocking=True), lambda: scatter_rows(src, positions, dst))
    moved = np.int32([[7, 5, 6], [1, 0, 2]])
    positions[...] = cp.asarray(moved)
    dst[...] = 0
    graph.launch()
    cp.cuda.Device().synchronize()
    want = np.zeros((2, 8, 8), np.float32)
    scatter_rows(src.get(), moved, want)
    np.testing.assert_array_equal(dst.get(), want)


def test_each_support_op_compiles_once_through_the_one_cache(cp):
    from eulergen.runtime.engine.compile import compile_file, op_options
    x = cp.zeros((2, 3, 4), cp.float32)
    take_row(x, cp.zeros(1, cp.int32), cp.zeros((2, 4), cp.float32))
    op = load_manifest(BUILTIN_MANIFEST).ops["moves"]
    assert compile_file(op.cuda, op_options(op), op.template).from_cache == "memory"
