"""The planner's block-per-row shapes (generator/plan.block_shape: threads, the launch-bounds
minimum of blocks an SM, registers cached a thread) and the launch facts row_launch writes
for them into the manifest, which the runtime launches from."""
from __future__ import annotations

import pytest

from eulergen.generator import plan as planner

ROW_PLAN = planner.KernelPlan("row.cu.j2", planner.DTYPES, threads=256,
                              vec=tuple(planner.VEC.items()),
                              warp_slots=tuple(planner.WARP_SLOTS.items()))


def shape(dtype: str, *, sweeps: int = 2, cached: int = 1, weights: bool = False,
          wgrad: bool = False, forward: bool = True) -> planner.BlockShape:
    return planner.block_shape(dtype, sweeps=sweeps, cached=cached, weights=weights,
                               wgrad=wgrad, forward=forward)


@pytest.mark.parametrize("dtype", planner.DTYPES)
@pytest.mark.parametrize("sweeps", [1, 3])
def test_weight_gradient_kernels_take_512_threads_unbounded_with_the_dtype_slots(dtype, sweeps):
    """Their partials live in registers too: 1024 threads (64 registers) would spill."""
    got = shape(dtype, sweeps=sweeps, weights=True, wgrad=True, forward=False)
    assert got == planner.BlockShape(planner.BLOCK_THREADS_MAX_WGRAD, 0, planner.BLOCK_SLOTS[dtype])
    assert got.threads == 512


@pytest.mark.parametrize("dtype", planner.DTYPES)
@pytest.mark.parametrize("forward", [True, False])
def test_a_one_sweep_kernel_without_weights_takes_short_blocks_many_an_sm(dtype, forward):
    """cross_entropy's forward: max, online sum and the picked logit in one read of the row."""
    got = shape(dtype, sweeps=1, cached=1, forward=forward)
    assert got == planner.BlockShape(planner.BLOCK_THREADS_ONE_SWEEP,
                                     planner.BLOCK_MIN_BLOCKS_ONE_SWEEP, planner.BLOCK_SLOTS[dtype])
    assert (got.threads, got.min_blocks) == (256, 8)


@pytest.mark.parametrize("forward", [True, False])
@pytest.mark.parametrize("cached,slots", [(0, 10), (1, 10), (2, 5), (3, 3)])
def test_fp32_re_read_kernels_without_weights_split_ten_groups_among_the_cached_operands(
        forward, cached, slots):
    """One 1024-thread block an SM, so that 40 registers a thread can hold the row (cached 0:
    nothing to split, all ten groups' worth of the bound stays)."""
    got = shape("f32", sweeps=2, cached=cached, forward=forward)
    assert got == planner.BlockShape(planner.BLOCK_THREADS_MAX, 1, slots)
    assert planner.BLOCK_REREAD_GROUPS["f32"] == 10


def test_bf16_forward_without_weights_keeps_one_group_and_two_blocks_an_sm():
    got = shape("bf16", sweeps=2, cached=1, forward=True)
    assert got == planner.BlockShape(1024, planner.BLOCK_MIN_BLOCKS_FORWARD, planner.BLOCK_SLOTS["bf16"])
    assert (got.min_blocks, got.slots) == (2, 1)


@pytest.mark.parametrize("dtype,kw", [
    ("bf16", dict(sweeps=2, cached=2, forward=False)),              # softmax's backward
    ("f32", dict(sweeps=2, cached=1, weights=True, forward=True)),   # a norm's forward
    ("bf16", dict(sweeps=2, cached=1, weights=True, forward=True)),
    ("f32", dict(sweeps=1, cached=1, weights=True, forward=True)),   # weights: no short blocks
    ("f32", dict(sweeps=3, cached=2, weights=True, forward=False)),  # backward, no weight grads
])
def test_the_rest_take_1024_threads_unbounded_with_the_dtype_slots(dtype, kw):
    assert shape(dtype, **kw) == planner.BlockShape(planner.BLOCK_THREADS_MAX, 0,
                                                    planner.BLOCK_SLOTS[dtype])


@pytest.mark.parametrize("dtype", planner.DTYPES)
@pytest.mark.parametrize("block", [planner.BlockShape(256, 8, 1), planner.BlockShape(1024, 1, 10),
                                   planner.BlockShape(1024, 1, 5), planner.BlockShape(512, 0, 2)])
@pytest.mark.parametrize("wgrad", [False, True])
def test_row_launch_writes_the_block_it_is_given(dtype, block, wgrad):
    """threads and cols_per_thread (registers a thread: vec · slots) follow the BlockShape;
    the rest is the layout's."""
    plan = dict(planner.row_launch(ROW_PLAN, dtype, "block_per_row", wgrad=wgrad, block=block))
    assert plan["layout"] == "block_per_row"
    assert plan["threads"] == block.threads
    assert plan["cols_per_thread"] == planner.VEC[dtype] * block.slots
    assert plan["threads_min"] == planner.BLOCK_THREADS_MIN
    assert plan["rows_per_block"] == 1
    # past what a warp keeps in registers, the block kernel is the fast one
    assert plan["min_cols"] == 32 * planner.VEC[dtype] * planner.WARP_SLOTS[dtype] + 1
    assert ("wgrad_partials" in plan) is wgrad


@pytest.mark.parametrize("dtype", planner.DTYPES)
def test_row_launch_of_warp_rows_ignores_the_block_shape(dtype):
    plans = {dict(planner.row_launch(ROW_PLAN, dtype, "warp_per_row", wgrad=False, block=b))["threads"]
             for b in (planner.BlockShape(256, 8, 1), planner.BlockShape(1024, 1, 10))}
    assert plans == {32 * planner.WARP_ROWS_PER_BLOCK}
