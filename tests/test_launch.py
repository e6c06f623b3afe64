"""Launch geometry values (eulergen/launch.py), without rendering: each shape's JSON round
trip, and the grids its one `launch` gives at the edges the kernels rely on."""
from __future__ import annotations

import dataclasses

import pytest

from eulergen import launch
from eulergen.generator import plan as planner
from eulergen.generator.kinds import embedding

EXAMPLES = [
    planner.pointwise_launch("bf16", 1, False),
    planner.update_launch("f32"),
    planner.pair_launch("bf16"),
    planner.row_launch("f32", "warp_per_row", wgrad=True, shape=planner.warp_shape(
        "f32", stage="backward", wgrad=True), aligned=False),
    planner.row_launch("bf16", "block_held", wgrad=False, shape=planner.held_shape(
        "bf16", stage="forward", wgrad=False), aligned=True, fwdbwd=True),
    planner.row_launch("f32", "block_per_row", wgrad=False, shape=planner.block_shape(
        "f32", stage="forward", sweeps=2, cached=1, weights=False, wgrad=False), aligned=True,
        split_cols=0),
    planner.wgrad_cols_launch("bf16", 2, True),
    planner.WGRAD_REDUCE_LAUNCH,
    planner.bias_launch("bf16", "backward", True),
    *(planner.embedding_launch(part, "bf16") for part in embedding.PARTS),
    planner.ROW_NORMS_LAUNCH,
    launch.AttentionTiles(64, 128, 64, 64, 74240, "causal", role="backward_dkv"),
    launch.AttentionDecode(128, 256, 1, 64, 2000, "none"),
    launch.AttentionRowdot(256, 8),
    launch.Gemv(128, 4),
]


def test_every_shape_has_an_example_here():
    assert {type(g) for g in EXAMPLES} == set(launch.SHAPES.values())


@pytest.mark.parametrize("geometry", EXAMPLES, ids=lambda g: g.shape)
def test_json_round_trip_gives_the_same_value(geometry):
    data = geometry.to_json()
    assert data["shape"] == geometry.shape
    assert launch.from_json(data) == geometry
    assert set(data) - {"shape"} == {f.name for f in dataclasses.fields(geometry)}


def test_a_capped_grid_is_at_most_grid_max_and_at_least_one_block():
    g = launch.Update(threads=256, vec=4, grid_max=2112)
    assert g.launch(1).grid == (1,)
    assert g.launch(256 * 4 * 3000).grid == (2112,)
    assert launch.Pointwise(128, 8, 2).launch(10 ** 9).grid == (-(-10 ** 9 // (128 * 8 * 2)),)


def test_a_bias_launch_tiles_columns_by_row_groups_each_a_partial_row():
    g = launch.BiasRows(threads=128, vec=8, rows=4, blocks=1056, aligned=True)
    # 3072 bf16 columns: 3 blocks of 1024; 352 row groups, each a partial row of the bias
    assert g.launch(8192, 3072) == launch.Launch((3, 352), (128,), 0, 352)
    assert g.launch(5, 3072) == launch.Launch((3, 5), (128,), 0, 5)   # a group a row at most
    assert g.launch(0, 1) == launch.Launch((1, 1), (128,), 0, 1)


def test_a_warp_per_row_launch_writes_a_partial_row_a_warp():
    g = launch.WarpPerRow(threads=128, rows_per_block=4, grid_max=528, max_cols=768,
                          aligned=True, wgrad=True)
    assert g.launch(100, 768) == launch.Launch((25,), (128,), 0, 100)
    assert g.launch(10 ** 6, 768) == launch.Launch((528,), (128,), 0, 528 * 4)


def test_a_block_per_row_takes_warps_for_its_row_within_its_bounds():
    g = launch.BlockPerRow(threads=1024, threads_min=64, cols_per_thread=40, grid_max=2112,
                           min_cols=769, aligned=True, uncapped_cols=40960)
    assert g.launch(5000, 769).block == (64,)            # 20 threads' worth: the minimum
    assert g.launch(5000, 40 * 32 * 5 + 1).block == (192,)
    assert g.launch(5000, 50257).block == (1024,)
    assert g.launch(5000, 40960).grid == (5000,)         # held in registers: a block a row
    assert g.launch(5000, 40961).grid == (2112,)         # re-read: capped


def test_wgrad_cols_spreads_its_blocks_over_rows_and_writes_a_partial_row_each():
    g = launch.WgradCols(threads=128, vec=8, row_stats=2, blocks=1056, aligned=True)
    at = g.launch(8192, 8192)
    assert at.grid == (8, 132) and at.partials == 132
    assert g.launch(3, 8192).grid == (8, 3)


def test_attention_grids_take_kv_heads_only_for_the_dkv_kernel():
    dkv = launch.AttentionTiles(64, 128, 64, 64, 74240, "causal", role="backward_dkv")
    dq = dataclasses.replace(dkv, role="backward_dq")
    assert dkv.launch(2, 1000, 12, 4) == launch.Launch((16, 4, 2), (128,), 74240)
    assert dq.launch(2, 1000, 12, 4).grid == (16, 12, 2)
    decode = launch.AttentionDecode(64, 128, 2, 64, 1296, "causal")
    assert decode.launch(3, 1, 12, 4, splits=5).grid == (2 * 5, 4, 3)   # a group of 3 rows


def test_embedding_dwte_counts_column_units_of_a_vector_only_when_vectorized():
    g = planner.embedding_launch("wte", "f32")
    assert g.launch(300, 768, True).grid == (-(-300 // g.rows), 768 // 4 // 32)
    assert g.launch(300, 768, False).grid == (-(-300 // g.rows), 768 // 32)


def test_the_runtime_kernels_blocks_take_their_units_and_stride_past_a_capped_grid():
    assert planner.STEP_LAUNCH.launch(1) == launch.Launch((1,), (1,))
    assert planner.DRAW_LAUNCH.launch(7) == launch.Launch((7,), (1024,))      # a block a row
    assert planner.ELEMENTWISE_LAUNCH.launch(0).grid == (1,)
    assert planner.ELEMENTWISE_LAUNCH.launch(257).grid == (2,)                # a thread an element
    rows = launch.Blocks(threads=256, per_block=8, grid_max=100)              # a warp a row
    assert rows.launch(17).grid == (3,)
    assert rows.launch(10 ** 6).grid == (100,)
    for gemv in planner.GEMV_LAUNCHES:                            # a block `cols` columns
        assert gemv.launch(50304) == launch.Launch((50304,), (128,))
        assert gemv.launch(50303, 4) == launch.Launch((12576,), (128,))
