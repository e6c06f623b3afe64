"""The planner's numbers: storage dtypes, pointwise tiles, row block shapes, grid caps and
the embedding's constants, and the launch geometry (eulergen/launch.py) each kernel gets.

Every choice is made from a DerivedOp alone (sizes such as the row length arrive at
launch) and is a frozen value: the geometry travels in `KernelSig.geometry` to the
manifest, and the runtime launches with its `launch(sizes)`. A row stage has a kernel per
layout (warp_per_row, block_held, block_per_row), each correct for any row length, its
max_cols / min_cols saying where it is the fast one, and each twice: `aligned` for operands
that take 16-byte access throughout, `_unaligned` for any (the runtime's row kind,
runtime/engine/kinds/row.row_aligned). The kinds (generator/kinds/) make their plans from
these. What the constants were measured against: benchmarks/RESULTS.md, "Why the planner's
constants are what they are".
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import sympy as sp

from eulergen import launch, signature
from eulergen.generator import ir

DTYPES = signature.DTYPES             # every storage dtype, planned in this order
VEC = {"f32": 4, "bf16": 8}           # elements in one 16-byte access
CTYPE = {"f32": "float", "bf16": "__nv_bfloat16"}

# H200: 132 SMs. grid_max bounds the grid where a kernel loops over its work anyway;
# for row backward kernels with weights it also bounds the workspace of partial sums.
_SMS = 132
_GRID_MAX = _SMS * 16
# warp_per_row: 4 partial rows per block, 4 blocks an SM (or the shape's min_blocks)
_GRID_MAX_WGRAD = _SMS * 4
# block_per_row: one per block (blocks may be small); BLOCK_WGRAD_SLOTS says why four an SM
_GRID_MAX_WGRAD_BLOCK = _SMS * 4

# The row kernels' blocks. Each constant's measurements: benchmarks/RESULTS.md, "Why the row
# planner's constants are what they are", under its name.
WARP_ROWS_PER_BLOCK = 8
# fp32 forwards: 4 rows a block, the same 32 warps an SM at their registers, ran faster.
WARP_ROWS_PER_BLOCK_OF = {("f32", "forward"): 4}
# With weight gradients a warp keeps its partial rows in shared memory: 4 warps a block
# keep two 768-wide fp32 rows each (layernorm's w and b) within the 48 KB of static smem.
WARP_ROWS_PER_BLOCK_WGRAD = 4
WARP_SLOTS = {"f32": 6, "bf16": 3}    # 16-byte chunks cached per lane: rows ≤ 768 in registers
# Load the next row's cached groups before computing this one: bf16's are too few bytes in
# flight to hide a row's latency; fp32's registers already hold twice the bytes.
PREFETCH_DTYPES = ("bf16",)
# Held to 64 registers (4 blocks of 256 threads an SM: the warps the kernels had without
# the prefetch) the bf16 warp-per-row forward kernels do not spill; backward ones would, so
# they are not held (but for WARP_DEEP_WGRAD_BLOCKS, which has no prefetch).
WARP_MIN_BLOCKS = {("bf16", "forward"): 4}
# A bf16 warp backward with weight gradients over two reduction levels waits on two
# butterflies a row, which more warps hide and a prefetch does not: no prefetch, 7 blocks an SM.
WARP_DEEP_WGRAD_BLOCKS = 7
# row_launch caps a warp kernel's grid only where it prefetches, or has weight gradients,
# whose workspace the grid sizes ("The warp-per-row grid").
BLOCK_SLOTS = {"f32": 2, "bf16": 1}   # per thread of a block: rows ≤ 8192 in registers
BLOCK_THREADS_MAX = 1024
# A block per row with weight gradients holds their partials in registers as well: 512
# threads leave 128 registers a thread, where 1024 (64 registers) spill.
BLOCK_THREADS_MAX_WGRAD = 512
# They take twice a plain block's groups a thread and a grid of four blocks an SM: fewer
# partial rows to write and reduce.
BLOCK_WGRAD_SLOTS = {"f32": 4, "bf16": 2}
BLOCK_THREADS_MIN = 128
# A block per row forward without weights fits 32 registers a thread: two 1024-thread blocks
# an SM hide each other's row latency (with weights it would spill).
BLOCK_MIN_BLOCKS_FORWARD = 2
# A kernel that reads its row in one sweep keeps nothing for later: short blocks, eight an
# SM, more rows in flight and a cheaper merge of the block's warps.
BLOCK_THREADS_ONE_SWEEP = 256
BLOCK_MIN_BLOCKS_ONE_SWEEP = 8
# fp32 kernels without weights that sweep again cache 10 groups a thread (shared among the
# cached operands) in one block an SM, so that the rows in flight re-read from L2, not memory.
BLOCK_REREAD_GROUPS = {"f32": 10}
# from 64 threads: at 128, 2048 columns filled 4 of a thread's 10 groups
BLOCK_REREAD_THREADS_MIN = 64
# row_launch gives such a kernel (no prefetch) a block a row where its registers hold the
# row, and over longer ones a capped grid that keeps the re-read rows within L2
# ("The block-per-row grid").
# Their first sweep, which reads from memory, loads its re-read groups two at a time where
# they read one row operand: two loads in flight rather than load, compute, load.
BLOCK_REREAD_BATCH = 2
# Block rows without weights sweep their re-read groups whole (no bounds test) before the
# last group, in the aligned entry points only; with weights it cost registers.
BLOCK_WHOLE_GROUPS = True
# Two blocks of 512 an SM where one of 1024 would hold the row: two rows in flight an SM,
# and each row's reductions merge half the warps (the split backward's rows kernel, bf16
# forwards with weights, bf16 backwards without); at least 64 threads a block.
BLOCK_PAIR_THREADS, BLOCK_PAIR_MIN_BLOCKS, BLOCK_PAIR_THREADS_MIN = 512, 2, 64
BLOCK_PAIR_SLOTS = {"f32": 4, "bf16": 2}
# block_held: a bf16 row past a warp's 768 columns and up to 8192 in a block's registers,
# four groups a thread, no prefetch, a block a row and the two-pass impl.
HELD_SLOTS = {"bf16": 4}
HELD_THREADS, HELD_MIN_BLOCKS, HELD_THREADS_MIN = 256, 4, 32


@dataclass(frozen=True)
class RowShape:
    """A row kernel's block: its threads (warp_per_row: 32 a row; block_per_row: the most it
    takes), its __launch_bounds__ minimum of blocks an SM (0: none), the 16-byte groups of
    each cached row operand a lane keeps in registers, whether it prefetches the next
    row's (PREFETCH_DTYPES), how many re-read groups its first sweep loads at a time, and
    whether it sweeps its re-read groups whole before the last (BLOCK_WHOLE_GROUPS), and the
    fewest threads a block per row launches."""
    threads: int
    min_blocks: int
    slots: int
    prefetch: bool
    batch: int = 1
    whole: bool = False
    threads_min: int = BLOCK_THREADS_MIN


def _held(stage: str, cached: int) -> bool:
    """Whether a kernel takes its stage's register bounds: not a forward that caches more
    row operands than the one a plain forward reads (an `add` fusion's x and branch
    spilled 190-220 bytes a thread in the bf16 warp forwards held to 64 registers)."""
    return stage != "forward" or cached <= 1


def warp_shape(dtype: str, *, stage: str, wgrad: bool, levels: int = 1,
               cached: int = 1) -> RowShape:
    """The block of a warp-per-row kernel of `stage` whose row takes `levels` reduction
    levels (sweeps that end in a reduction), caching `cached` row operands."""
    rows = (WARP_ROWS_PER_BLOCK_WGRAD if wgrad else
            WARP_ROWS_PER_BLOCK_OF.get((dtype, stage), WARP_ROWS_PER_BLOCK))
    if wgrad and levels >= 2 and dtype in PREFETCH_DTYPES:
        return RowShape(32 * rows, WARP_DEEP_WGRAD_BLOCKS, WARP_SLOTS[dtype], False)
    return RowShape(32 * rows, WARP_MIN_BLOCKS.get((dtype, stage), 0) if _held(stage, cached)
                    else 0, WARP_SLOTS[dtype], dtype in PREFETCH_DTYPES)


def block_shape(dtype: str, *, stage: str, sweeps: int, cached: int, weights: bool,
                wgrad: bool) -> RowShape:
    """The block of a block-per-row kernel of `stage` that sweeps its row `sweeps` times,
    holding `cached` row operands in registers."""
    prefetch = dtype in PREFETCH_DTYPES
    pair = RowShape(BLOCK_PAIR_THREADS, BLOCK_PAIR_MIN_BLOCKS, BLOCK_PAIR_SLOTS[dtype],
                    prefetch, threads_min=BLOCK_PAIR_THREADS_MIN)
    if stage == "backward_rows":
        return pair
    if wgrad:
        return RowShape(BLOCK_THREADS_MAX_WGRAD, 0, BLOCK_WGRAD_SLOTS[dtype], prefetch)
    if weights:
        if stage == "forward" and dtype == "bf16":
            return pair
        return RowShape(BLOCK_THREADS_MAX, 0, BLOCK_SLOTS[dtype], prefetch)
    whole = BLOCK_WHOLE_GROUPS
    if sweeps == 1:
        return RowShape(BLOCK_THREADS_ONE_SWEEP,
                        BLOCK_MIN_BLOCKS_ONE_SWEEP if _held(stage, cached) else 0,
                        BLOCK_SLOTS[dtype], prefetch, whole=whole)
    if dtype in BLOCK_REREAD_GROUPS:
        return RowShape(BLOCK_THREADS_MAX, 1, BLOCK_REREAD_GROUPS[dtype] // max(cached, 1),
                        False, BLOCK_REREAD_BATCH if cached <= 1 else 1, whole,
                        threads_min=BLOCK_REREAD_THREADS_MIN)
    if stage == "backward":
        return replace(pair, whole=whole)
    return RowShape(BLOCK_THREADS_MAX, BLOCK_MIN_BLOCKS_FORWARD if stage == "forward" else 0,
                    BLOCK_SLOTS[dtype], prefetch, whole=whole)


def held_shape(dtype: str, *, stage: str, wgrad: bool, cached: int = 1) -> RowShape | None:
    """The block of a block_held kernel (a block per row, the row in registers), or None
    where `dtype` or a stage with weight gradients takes none (HELD_SLOTS)."""
    if wgrad or stage == "backward_rows" or dtype not in HELD_SLOTS:
        return None
    return RowShape(HELD_THREADS, HELD_MIN_BLOCKS if _held(stage, cached) else 0,
                    HELD_SLOTS[dtype], False, threads_min=HELD_THREADS_MIN)


@dataclass(frozen=True)
class KernelPlan:
    """A row op's plan: its dtypes and whether it has a fused forward+backward."""
    dtypes: tuple[str, ...]
    fwdbwd: bool = False             # row op whose outputs are all per-row scalars


# Pointwise tiles (threads, vectors a thread), by what streamed fastest on the H200
# (benchmarks/RESULTS.md, "POINTWISE_LIGHT_TILE…"): arithmetic-light code one vector a
# thread in short blocks; special functions more vectors, bf16 one-operand kernels most.
POINTWISE_LIGHT_TILE = (128, 1)
POINTWISE_TILE = {"f32": (128, 2), "bf16": (256, 4)}
POINTWISE_ONE_LOAD_TILE = {"f32": (128, 2), "bf16": (128, 8)}
# An fp32 one-operand kernel with special functions is held to 16 blocks of 128 an SM (32
# registers), as PyTorch's gelu is (RESULTS.md, POINTWISE_ONE_LOAD_MIN_BLOCKS).
POINTWISE_ONE_LOAD_MIN_BLOCKS = {"f32": 2048 // POINTWISE_ONE_LOAD_TILE["f32"][0]}
# Functions that print as a compare, a select or fabsf: no costlier than a multiply-add.
_CHEAP_FUNCTIONS = (sp.Heaviside, sp.Abs, sp.sign, sp.Piecewise)


def arithmetic_light(code: ir.Code) -> bool:
    """Whether `code` is only adds, multiplies, compares and selects: no special function,
    and no division or root of a variable (a constant's root is a literal)."""
    for a in code.temps + code.results:
        for node in sp.preorder_traversal(a.expr):
            if isinstance(node, sp.Function) and not isinstance(node, _CHEAP_FUNCTIONS):
                return False
            if (isinstance(node, sp.Pow) and node.free_symbols
                    and not (node.exp.is_Integer and node.exp > 0)):
                return False
    return True


def pointwise_tile(dtype: str, loads: int, light: bool) -> tuple[int, int]:
    """(threads, vectors per thread per operand) for a kernel reading `loads` operands:
    POINTWISE_LIGHT_TILE for arithmetic-light code, else the dtype's POINTWISE_ONE_LOAD_TILE
    for one operand and POINTWISE_TILE for more."""
    if light:
        return POINTWISE_LIGHT_TILE
    return (POINTWISE_ONE_LOAD_TILE if loads == 1 else POINTWISE_TILE)[dtype]


def pointwise_min_blocks(dtype: str, loads: int, light: bool) -> int:
    """The __launch_bounds__ minimum of blocks an SM (0: none)."""
    return 0 if light or loads != 1 else POINTWISE_ONE_LOAD_MIN_BLOCKS.get(dtype, 0)


def pointwise_launch(dtype: str, loads: int, light: bool) -> launch.Pointwise:
    threads, unroll = pointwise_tile(dtype, loads, light)
    return launch.Pointwise(threads, VEC[dtype], unroll, pointwise_min_blocks(dtype, loads, light))


def row_launch(dtype: str, layout: str, *, wgrad: bool, shape: RowShape, aligned: bool,
               fwdbwd: bool = False, split_cols: int = 0) -> launch.Geometry:
    v = VEC[dtype]
    if not wgrad:
        grid_max = _GRID_MAX
    elif layout != "warp_per_row":
        grid_max = _GRID_MAX_WGRAD_BLOCK
    else:   # as many blocks as the launch bounds keep on an SM
        grid_max = _SMS * shape.min_blocks if shape.min_blocks else _GRID_MAX_WGRAD
    if layout == "warp_per_row":
        if not wgrad and not shape.prefetch:
            grid_max = None
        return launch.WarpPerRow(shape.threads, shape.threads // 32, grid_max,
                                 32 * v * shape.slots, aligned, wgrad, fwdbwd)
    per_thread = v * shape.slots
    min_cols = 32 * v * WARP_SLOTS[dtype] + 1
    if layout == "block_held":
        return launch.BlockHeld(shape.threads, shape.threads_min, per_thread, min_cols,
                                shape.threads * per_thread, aligned, fwdbwd)
    uncapped = shape.threads * per_thread if not wgrad and not shape.prefetch else 0
    return launch.BlockPerRow(shape.threads, shape.threads_min, per_thread, grid_max, min_cols,
                              aligned, wgrad, uncapped, split_cols, fwdbwd)


# Weight gradients of long rows: from these columns the backward is split (a block per row
# for the input grads and row stats, then wgrad_cols by columns): a fused block per row
# adds its partials through L2 with little to hide the latency. Two reduction levels split
# sooner; keyed (dtype, levels ≥ 2).
WGRAD_SPLIT_COLS = {("f32", False): 16385, ("bf16", False): 16385,
                    ("f32", True): 8193, ("bf16", True): 8193}
WGRAD_COLS_THREADS = 128
WGRAD_COLS_ROWS = 4
WGRAD_COLS_BLOCKS = _SMS * 8


def wgrad_split_cols(dtype: str, levels: int) -> int:
    """The row length from which a backward with weight gradients over rows whose sweeps
    end in `levels` reductions takes the split kernels."""
    return WGRAD_SPLIT_COLS[(dtype, levels >= 2)]


def wgrad_cols_launch(dtype: str, stats: int, aligned: bool) -> launch.WgradCols:
    return launch.WgradCols(WGRAD_COLS_THREADS, VEC[dtype], stats, WGRAD_COLS_BLOCKS, aligned)


# The fixed-order reduce of weight partials: 8 columns (a 32-byte sector) by 128 partial
# groups per block, so that even a 768-wide weight spreads over 96 blocks.
REDUCE_X, REDUCE_Y = 8, 128
WGRAD_REDUCE_LAUNCH = launch.WgradReduce(REDUCE_X, REDUCE_Y)


def reduce_args(dtype: str) -> tuple[tuple[str, str], ...]:
    """The reduce's parameters (the row ops' weight gradients, the bias variants' biases):
    partial rows in, the gradient in the storage dtype written or added to."""
    return (("partials", "const float*"), ("dw", f"{CTYPE[dtype]}*"), ("num_partials", "int"),
            ("cols", "int"), ("accumulate", "int"))


# The bias variants of pointwise ops (generator/fuse.py): blocks of BIAS_THREADS, a thread
# a 16-byte vector of columns and BIAS_ROWS rows' loads in flight; BIAS_BLOCKS blocks for a
# forward (16 an SM: 2048 threads, the SM full), half as many for a backward, whose row
# groups each write (and the reduce reads) a partial row of every bias gradient.
BIAS_THREADS = 128
BIAS_ROWS = 4
BIAS_BLOCKS = {"forward": _SMS * 16, "backward": _SMS * 8}


def bias_launch(dtype: str, stage: str, aligned: bool) -> launch.BiasRows:
    return launch.BiasRows(BIAS_THREADS, VEC[dtype], BIAS_ROWS, BIAS_BLOCKS[stage], aligned)


# Pairs of one token whose index-only terms a pair block tables at a time (D ≤ 512 in one
# go); a multiple of every vec, so that the vector path's chunks stay 16-byte aligned.
PAIR_TABLE = 256
PAIR_THREADS = 256
# Pair blocks held to 40 registers, six an SM: more 16-byte loads in flight, no spills
# (RESULTS.md, PAIR_MIN_BLOCKS).
PAIR_MIN_BLOCKS = 6


# Pair blocks loop over tokens: four times the blocks that fit at once ran fastest in
# bf16, within 2% of a block a token in fp32 (RESULTS.md, _PAIR_GRID_MAX).
_PAIR_GRID_MAX = _SMS * PAIR_MIN_BLOCKS * 4


def pair_launch(dtype: str) -> launch.Pair:
    return launch.Pair(PAIR_THREADS, VEC[dtype], PAIR_TABLE, PAIR_MIN_BLOCKS, _PAIR_GRID_MAX)


UPDATE_THREADS = 256


def update_launch(dtype: str) -> launch.Update:
    return launch.Update(UPDATE_THREADS, VEC[dtype], _GRID_MAX)


EMBEDDING_THREADS = 256
# The forward's 16-byte vectors a lane loads before it stores (a warp a row): 3, a 768-wide
# bf16 row's vectors a lane, ran fastest (RESULTS.md, EMBEDDING_FETCH).
EMBEDDING_FETCH = 3
EMBEDDING_WTE_THREADS = 256           # the dwte kernel: 8 warps a block,
EMBEDDING_WTE_WARP_ROWS = 16          # a warp 16 rows (one after another; at most 32)
# 16 rows a warp: the fastest of 4-32 (RESULTS.md, EMBEDDING_WTE_WARP_ROWS).
# Runs longer than EMBEDDING_LONG_RUN keys (frequent tokens) go to their own kernel, a block
# of EMBEDDING_LONG_THREADS a run, each warp staging EMBEDDING_LONG_ROWS rows a round, at
# most EMBEDDING_LONG_GRID blocks: in the dwte kernel a run is one warp's chain of loads
# (RESULTS.md, EMBEDDING_LONG_RUN…: Zipf-drawn ids 2.8-3.5x faster, uniform ones unchanged).
EMBEDDING_LONG_RUN = 32
EMBEDDING_LONG_THREADS = 512
EMBEDDING_LONG_ROWS = 4
EMBEDDING_LONG_GRID = 64
EMBEDDING_SORT_THREADS = 1024
EMBEDDING_TILE = 2 * EMBEDDING_SORT_THREADS   # keys a block sorts: one compare-exchange a thread
EMBEDDING_MERGE_GROUP = 8             # tiles whose lower bounds a merge thread runs in lockstep
# 4 blocks an SM leave the merge kernel 64 registers, room for a group's probes in flight;
# bounded by threads alone ptxas kept 32 and serialised them (RESULTS.md).
EMBEDDING_MERGE_MIN_BLOCKS = 4


def embedding_launch(part: str, dtype: str) -> launch.Geometry:
    """The forward's launch (part '') or that of one part of the backward."""
    if not part:
        return launch.EmbeddingForward(EMBEDDING_THREADS, _GRID_MAX)
    if part == "wpe":
        return launch.EmbeddingWpe(EMBEDDING_THREADS, VEC[dtype], _GRID_MAX)
    if part == "sort":
        return launch.EmbeddingSort(EMBEDDING_SORT_THREADS, EMBEDDING_TILE)
    if part == "merge":
        return launch.EmbeddingMerge(EMBEDDING_THREADS)
    if part == "wte_long":
        return launch.EmbeddingWteLong(EMBEDDING_LONG_THREADS, 32, EMBEDDING_LONG_RUN, VEC[dtype],
                                       EMBEDDING_LONG_GRID)
    return launch.EmbeddingWte(EMBEDDING_WTE_THREADS, 32,
                               EMBEDDING_WTE_THREADS // 32 * EMBEDDING_WTE_WARP_ROWS, VEC[dtype])



# The runtime's own kernels (generator/kinds/step_control.py, draw.py, bf16.py, moves.py,
# gemv.py).
STEP_LAUNCH = launch.Blocks(1)                 # a step's scalars: one thread, in order
LOSS_MEAN_LAUNCH = launch.Blocks(256)          # the loss mean: one block's fixed-order sum
DRAW_LAUNCH = launch.Blocks(1024)              # the draw: a block a row of logits
ELEMENTWISE_LAUNCH = launch.Blocks(256, 256)   # bf16 casts and adds, row moves: a thread an element
ROW_NORMS_LAUNCH = launch.Blocks(256, 256 // 32, _GRID_MAX)   # bf16 row norms: a warp a row
# the decoder's few-row GEMMs: blocks of 4 warps, for up to each of these many rows (a kernel
# each: its accumulators are registers); from 4 rows on, the x reads that every w vector
# takes make cuBLASLt's tensor-core tiles as fast or faster (benchmarks/decode_step.py)
GEMV_LAUNCHES = tuple(launch.Gemv(128, rows) for rows in (1, 2))
# their body (eg_gemv, in templates/), which the gemv kind's kernels and each pointwise op's
# `gemv` variant (its forward as their epilogue) include
GEMV_BODY = "gemv_common.cuh.j2"


def gemv_args(dtype: str, out: str = "") -> tuple[tuple[str, str], ...]:
    """What every gemv kernel takes first: x [rows, k] (row stride ldx), w [n, k] (ldw), b
    [n] or null, y [rows, n] (ldy), `cols` output columns a block; y of C type `out` where
    it is not the storage's (bf16 writing float32)."""
    c = CTYPE[dtype]
    return (("x", f"const {c}*"), ("ldx", "long long"), ("w", f"const {c}*"),
            ("ldw", "long long"), ("b", f"const {c}*"), ("y", f"{out or c}*"),
            ("ldy", "long long"), ("rows", "int"), ("n", "int"), ("k", "int"), ("cols", "int"))
