"""The planner's block-per-row shapes (generator/plan.block_shape: threads, the launch-bounds
minimum of blocks an SM, registers cached a thread) and the launch geometry row_launch makes
of them (eulergen/launch.py), which the manifest carries and the runtime launches from."""
from __future__ import annotations

import pytest

from eulergen import launch
from eulergen.generator import plan as planner


def shape(dtype: str, *, stage: str = "forward", sweeps: int = 2, cached: int = 1,
          weights: bool = False, wgrad: bool = False) -> planner.RowShape:
    return planner.block_shape(dtype, stage=stage, sweeps=sweeps, cached=cached,
                               weights=weights, wgrad=wgrad)


def pair(dtype: str, **kw) -> planner.RowShape:
    return planner.RowShape(planner.BLOCK_PAIR_THREADS, planner.BLOCK_PAIR_MIN_BLOCKS,
                            planner.BLOCK_PAIR_SLOTS[dtype], dtype in planner.PREFETCH_DTYPES,
                            threads_min=planner.BLOCK_PAIR_THREADS_MIN, **kw)


@pytest.mark.parametrize("dtype", planner.DTYPES)
@pytest.mark.parametrize("sweeps", [1, 3])
def test_weight_gradient_kernels_take_512_threads_unbounded_with_the_dtype_slots(dtype, sweeps):
    """Their partials live in registers too: 1024 threads (64 registers) would spill. Twice
    the groups a thread of a block without (BLOCK_WGRAD_SLOTS: 8192 columns at 512 threads),
    and a grid, the workspace's partial rows, of four blocks an SM."""
    got = shape(dtype, stage="backward", sweeps=sweeps, weights=True, wgrad=True)
    assert got == planner.RowShape(planner.BLOCK_THREADS_MAX_WGRAD, 0,
                                   planner.BLOCK_WGRAD_SLOTS[dtype],
                                   dtype in planner.PREFETCH_DTYPES)
    assert got.threads == 512 and got.slots == 2 * planner.BLOCK_SLOTS[dtype]
    assert got.threads * got.slots * planner.VEC[dtype] == 8192
    geometry = planner.row_launch(dtype, "block_per_row", wgrad=True, shape=got, aligned=True)
    assert geometry.grid_max == 132 * 4


@pytest.mark.parametrize("dtype", planner.DTYPES)
@pytest.mark.parametrize("stage", ["forward", "backward"])
def test_a_one_sweep_kernel_without_weights_takes_short_blocks_many_an_sm(dtype, stage):
    """cross_entropy's forward: max, online sum and the picked logit in one read of the row."""
    got = shape(dtype, stage=stage, sweeps=1, cached=1)
    assert got == planner.RowShape(planner.BLOCK_THREADS_ONE_SWEEP,
                                   planner.BLOCK_MIN_BLOCKS_ONE_SWEEP, planner.BLOCK_SLOTS[dtype],
                                   dtype in planner.PREFETCH_DTYPES, whole=True)
    assert (got.threads, got.min_blocks) == (256, 8)


@pytest.mark.parametrize("stage", ["forward", "backward", "fwdbwd"])
@pytest.mark.parametrize("cached,slots,batch", [(0, 10, 2), (1, 10, 2), (2, 5, 1), (3, 3, 1)])
def test_fp32_re_read_kernels_without_weights_split_ten_groups_among_the_cached_operands(
        stage, cached, slots, batch):
    """One 1024-thread block an SM, so that 40 registers a thread can hold the row (cached 0:
    nothing to split, all ten groups' worth of the bound stays). They do not prefetch the next
    row: its groups would not fit beside these. Reading one operand, their first sweep loads
    two re-read groups at a time; reading two, it has two loads in flight already."""
    got = shape("f32", stage=stage, sweeps=2, cached=cached)
    assert got == planner.RowShape(planner.BLOCK_THREADS_MAX, 1, slots, False, batch, True,
                                   threads_min=64)
    assert planner.BLOCK_REREAD_GROUPS["f32"] == 10
    assert planner.BLOCK_REREAD_BATCH == 2


@pytest.mark.parametrize("dtype,kw", [
    ("bf16", dict(sweeps=2, cached=1)), ("bf16", dict(stage="backward", sweeps=2, cached=1)),
    ("f32", dict(sweeps=1, cached=1)), ("f32", dict(sweeps=2, cached=1, weights=True)),
    ("f32", dict(stage="backward", sweeps=2, cached=1, wgrad=True, weights=True)),
    ("f32", dict(stage="backward_rows", sweeps=2, cached=2, weights=True)),
])
def test_only_the_fp32_re_read_shape_batches(dtype, kw):
    assert shape(dtype, **kw).batch == 1
    assert planner.warp_shape(dtype, stage="forward", wgrad=False).batch == 1


@pytest.mark.parametrize("stage", ["forward", "fwdbwd"])
def test_bf16_forwards_without_weights_keep_one_group_and_1024_threads(stage):
    """Forward: two blocks an SM (cross-entropy's fused fwdbwd ran slower in pairs of 512)."""
    got = shape("bf16", stage=stage, sweeps=2, cached=1)
    blocks = planner.BLOCK_MIN_BLOCKS_FORWARD if stage == "forward" else 0
    assert got == planner.RowShape(1024, blocks, planner.BLOCK_SLOTS["bf16"], True, whole=True)
    assert got.slots == 1 and got.threads_min == planner.BLOCK_THREADS_MIN


@pytest.mark.parametrize("dtype,kw,want", [
    # the split backward's rows kernel, either dtype
    ("f32", dict(stage="backward_rows", sweeps=3, cached=2, weights=True), {}),
    ("bf16", dict(stage="backward_rows", sweeps=2, cached=2, weights=True), {}),
    # a norm's bf16 forward
    ("bf16", dict(stage="forward", sweeps=2, cached=1, weights=True), {}),
    # softmax's bf16 backward: swept whole, as the others without weights
    ("bf16", dict(stage="backward", sweeps=2, cached=2), {"whole": True}),
])
def test_two_blocks_of_512_an_sm_where_they_ran_faster(dtype, kw, want):
    got = shape(dtype, **kw)
    assert got == pair(dtype, **want)
    assert (got.threads, got.min_blocks, got.threads_min) == (512, 2, 64)
    assert got.slots * planner.VEC[dtype] == 16


@pytest.mark.parametrize("dtype,kw", [
    ("f32", dict(sweeps=2, cached=1, weights=True)),                  # a norm's fp32 forward
    ("f32", dict(sweeps=1, cached=1, weights=True)),                  # weights: no short blocks
    ("f32", dict(stage="backward", sweeps=3, cached=2, weights=True)),  # no weight grads
    ("bf16", dict(stage="backward", sweeps=3, cached=2, weights=True)),
])
def test_the_rest_take_1024_threads_unbounded_with_the_dtype_slots(dtype, kw):
    assert shape(dtype, **kw) == planner.RowShape(planner.BLOCK_THREADS_MAX, 0,
                                                  planner.BLOCK_SLOTS[dtype],
                                                  dtype in planner.PREFETCH_DTYPES)


@pytest.mark.parametrize("dtype", planner.DTYPES)
@pytest.mark.parametrize("sweeps", [1, 2, 3])
@pytest.mark.parametrize("stage", ["forward", "backward", "fwdbwd"])
def test_only_block_rows_without_weights_sweep_their_re_read_groups_whole(dtype, sweeps, stage):
    """The norms (weights) took more registers for it; warp rows hold their row whole."""
    assert shape(dtype, stage=stage, sweeps=sweeps).whole
    assert not shape(dtype, stage=stage, sweeps=sweeps, weights=True).whole
    assert not shape(dtype, stage="backward", sweeps=sweeps, weights=True, wgrad=True).whole
    assert not shape(dtype, stage="backward_rows", sweeps=sweeps, weights=True).whole
    for wgrad in (False, True):
        assert not planner.warp_shape(dtype, stage="forward", wgrad=wgrad, levels=sweeps).whole


@pytest.mark.parametrize("dtype", planner.DTYPES)
@pytest.mark.parametrize("block", [planner.RowShape(256, 8, 1, True),
                                   planner.RowShape(1024, 1, 10, False),
                                   planner.RowShape(1024, 1, 5, False),
                                   planner.RowShape(512, 0, 2, False)])
@pytest.mark.parametrize("wgrad", [False, True])
def test_row_launch_writes_the_block_it_is_given(dtype, block, wgrad):
    """threads and cols_per_thread (registers a thread: vec · slots) follow the RowShape;
    the rest is the layout's."""
    g = planner.row_launch(dtype, "block_per_row", wgrad=wgrad, shape=block, aligned=True)
    assert isinstance(g, launch.BlockPerRow)
    assert g.threads == block.threads
    assert g.cols_per_thread == planner.VEC[dtype] * block.slots
    assert g.threads_min == block.threads_min
    # past what a warp keeps in registers, the block kernel is the fast one
    assert g.min_cols == 32 * planner.VEC[dtype] * planner.WARP_SLOTS[dtype] + 1
    assert g.wgrad is wgrad
    assert g.launch(rows=7, cols=1).partials == 7   # a partial row a block


@pytest.mark.parametrize("dtype", planner.DTYPES)
@pytest.mark.parametrize("prefetch", [False, True])
def test_row_launch_caps_the_warp_grid_exactly_where_the_kernel_prefetches(dtype, prefetch):
    """A prefetching warp takes several rows, so its grid is capped; a warp that holds one row
    at a time takes an uncapped grid, a row a warp (weight gradients stay capped: the grid
    sizes their workspace)."""
    shape = planner.RowShape(32 * planner.WARP_ROWS_PER_BLOCK, 0, planner.WARP_SLOTS[dtype], prefetch)
    g = planner.row_launch(dtype, "warp_per_row", wgrad=False, shape=shape, aligned=True)
    assert g.threads == shape.threads and g.rows_per_block == planner.WARP_ROWS_PER_BLOCK
    assert (g.grid_max is not None) is prefetch
    assert g.max_cols == 32 * planner.VEC[dtype] * shape.slots
    wgrad = planner.row_launch(dtype, "warp_per_row", wgrad=True, shape=shape, aligned=True)
    assert wgrad.grid_max is not None
    at = wgrad.launch(rows=10 ** 6, cols=64)   # a partial row a warp
    assert at.partials == at.grid[0] * planner.WARP_ROWS_PER_BLOCK


@pytest.mark.parametrize("dtype", planner.DTYPES)
@pytest.mark.parametrize("levels", [1, 2, 3])
def test_a_warp_backward_with_weight_gradients_over_two_levels_takes_warps_not_a_prefetch(
        dtype, levels):
    """Where the row waits on two reduction levels or more, a prefetching dtype gives up the
    prefetch for 7 blocks an SM, and the grid (the workspace's partial rows) holds them all;
    other kernels keep the dtype's prefetch and 4 blocks an SM of workspace."""
    shape = planner.warp_shape(dtype, stage="backward", wgrad=True, levels=levels)
    deep = levels >= 2 and dtype in planner.PREFETCH_DTYPES
    assert shape.prefetch == (dtype in planner.PREFETCH_DTYPES and not deep)
    assert shape.min_blocks == (planner.WARP_DEEP_WGRAD_BLOCKS if deep else 0)
    g = planner.row_launch(dtype, "warp_per_row", wgrad=True, shape=shape, aligned=True)
    assert g.grid_max == 132 * (planner.WARP_DEEP_WGRAD_BLOCKS if deep else 4)
    no_wgrad = planner.warp_shape(dtype, stage="backward", wgrad=False, levels=levels)
    assert no_wgrad.prefetch == (dtype in planner.PREFETCH_DTYPES) and no_wgrad.min_blocks == 0


@pytest.mark.parametrize("dtype", planner.DTYPES)
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("wgrad", [False, True])
def test_a_block_that_holds_its_row_takes_a_block_a_row_unless_it_prefetches(dtype, prefetch,
                                                                             wgrad):
    """A prefetching block loops over rows (the next one's loads in flight), and weight
    gradients size their workspace by the grid: both stay capped. The others take a block a
    row over rows their registers hold, and the capped grid beyond (BlockPerRow.launch)."""
    block = planner.RowShape(1024, 1, 10, prefetch)
    g = planner.row_launch(dtype, "block_per_row", wgrad=wgrad, shape=block, aligned=True)
    held = 1024 * planner.VEC[dtype] * 10
    assert g.uncapped_cols == (0 if prefetch or wgrad else held)
    rows = 10 * g.grid_max
    uncapped = not prefetch and not wgrad
    assert g.launch(rows, held).grid == ((rows if uncapped else g.grid_max),)
    assert g.launch(rows, held + 1).grid == (g.grid_max,)


@pytest.mark.parametrize("dtype", planner.DTYPES)
def test_a_held_block_is_planned_for_its_dtypes_stages_without_weight_gradients(dtype):
    """block_held: the HELD_SLOTS dtypes' stages without weight gradients (forwards,
    backwards and fused stages of ops without weights), never the split backward's rows
    kernel; it holds max_cols columns in registers, takes no prefetch and launches a block a
    row."""
    shape = planner.held_shape(dtype, stage="forward", wgrad=False)
    if dtype not in planner.HELD_SLOTS:
        assert shape is None
        return
    assert shape.slots == planner.HELD_SLOTS[dtype] and not shape.prefetch
    assert planner.held_shape(dtype, stage="backward", wgrad=True) is None
    assert planner.held_shape(dtype, stage="backward_rows", wgrad=False) is None
    g = planner.row_launch(dtype, "block_held", wgrad=False, shape=shape, aligned=True)
    assert isinstance(g, launch.BlockHeld)
    assert g.max_cols == shape.threads * g.cols_per_thread \
        == shape.threads * planner.VEC[dtype] * shape.slots
    assert g.min_cols == 32 * planner.VEC[dtype] * planner.WARP_SLOTS[dtype] + 1
    rows = 100_000
    assert shape.threads_min == 32   # one warp fills its groups up to 1024 columns
    for cols, threads in ((g.min_cols, 32), (1024, 32), (1025, 64), (2048, 64), (3001, 96),
                          (g.max_cols, shape.threads)):
        assert g.launch(rows, cols)[:2] == ((rows,), (threads,)), cols
