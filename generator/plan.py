"""The planner's numbers: storage dtypes, pointwise tiles, row block shapes, grid caps and
the embedding's constants, and the launch geometry (eulergen/launch.py) each kernel gets.

Every choice is made from a DerivedOp alone (sizes such as the row length arrive at
launch) and is a frozen value: the geometry travels in `KernelSig.geometry` to the
manifest, and the runtime launches with its `launch(sizes)`. A row stage has a kernel per
layout (warp_per_row, block_held, block_per_row), each correct for any row length, its
max_cols / min_cols saying where it is the fast one, and each twice: `aligned` for operands
that take 16-byte access throughout, `_unaligned` for any (runtime/kernels.row_aligned).
generator/plan_ops.py makes the plans of pointwise, pair, update and embedding ops from
these. What the constants were measured against: benchmarks/RESULTS.md, "Why the planner's
constants are what they are".
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import sympy as sp

from eulergen import launch
from eulergen.generator import ir

DTYPES = ("f32", "bf16")
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

WARP_ROWS_PER_BLOCK = 8
# fp32 forwards take 4 rows a block (128 threads; the same 32 warps an SM at their 58-62
# registers): H200, softmax / log-softmax 262144 x 768, best of three rounds, 0.3858 /
# 0.3858 ms against 0.3875 / 0.3872 at 8 rows (PyTorch 0.3863 / 0.3866).
WARP_ROWS_PER_BLOCK_OF = {("f32", "forward"): 4}
# With weight gradients a warp keeps its partial rows in shared memory: 4 warps a block
# keep two 768-wide fp32 rows each (layernorm's w and b) within the 48 KB of static smem.
WARP_ROWS_PER_BLOCK_WGRAD = 4
WARP_SLOTS = {"f32": 6, "bf16": 3}    # 16-byte chunks cached per lane: rows ≤ 768 in registers
# Row kernels of these dtypes load the next row's cached groups (raw, 4 registers a group)
# before they compute the current row: a bf16 row's cached groups are half the bytes of
# fp32's, too few in flight to hide the latency of one row at a time. fp32 keeps one row at
# a time: its registers already hold twice the bytes, and a prefetch would double them
# (half the occupancy; the block re-read kernels' 10 groups a thread would spill).
PREFETCH_DTYPES = ("bf16",)
# Held to 64 registers (4 blocks of 256 threads an SM: the warps the kernels had without
# the prefetch) the bf16 warp-per-row forward kernels do not spill; backward ones would, so
# they are not held (but for WARP_DEEP_WGRAD_BLOCKS, which has no prefetch).
WARP_MIN_BLOCKS = {("bf16", "forward"): 4}
# A bf16 warp-per-row backward with weight gradients whose row takes two reduction levels
# (LayerNorm's mean, then its variance and adjoint sums) waits on two butterflies a row,
# which the next row's prefetch does not hide and more warps do: it takes no prefetch and
# 7 blocks an SM (72 registers, no spills), its grid 7 blocks an SM too (H200, layernorm
# 262144 x 768 forward+backward 0.603 -> 0.570 ms; at 6 blocks 0.575, at 8 0.602). RMSNorm
# (one level) keeps its prefetch: 0.513 ms, 0.523 this way.
WARP_DEEP_WGRAD_BLOCKS = 7
# A warp-per-row kernel that prefetches needs several rows per warp, so it loops over a
# capped grid. The others (one row at a time) take an uncapped grid of short blocks, a row
# per warp: a capped grid runs more blocks than fit at once, and its last wave runs
# part-empty (H200, softmax fp32 262144 x 768: forward 0.407 ms capped at 2112 blocks,
# 0.387 uncapped, the copy's speed; bf16 uncapped lost: forward+backward 0.541 -> 0.633
# ms). Kernels with weight gradients stay capped: the grid sizes their workspace.
BLOCK_SLOTS = {"f32": 2, "bf16": 1}   # per thread of a block: rows ≤ 8192 in registers
BLOCK_THREADS_MAX = 1024
# A block per row with weight gradients holds their partials in registers as well: 512
# threads leave 128 registers a thread, where 1024 (64 registers) spill.
BLOCK_THREADS_MAX_WGRAD = 512
# They take twice the groups a thread of a block without (bf16 two, fp32 four: 8192 columns
# in registers at 512 threads; at 2048 columns 128 threads, 98-127 registers, four blocks an
# SM) and a grid of four blocks an SM (fewer partial rows to write and reduce). H200,
# backward and its reduce, ms, BLOCK_SLOTS groups and 1056 blocks -> these and 528:
#   bf16: LayerNorm 32768 x 2048 0.1908 -> 0.1352, 16384 x 4096 0.2279 -> 0.1490; RMSNorm
#     32768 x 2048 0.1166 -> 0.1124, 8192 x 8192 0.1618 -> 0.1319 (two groups at 1056
#     blocks: 0.1395, 0.1619, 0.1156, 0.1486; at 2112 slower still; without the prefetch
#     slower: LayerNorm 2048 0.1851);
#   fp32: LayerNorm 8192 x 8192 0.3364 -> 0.2764, RMSNorm 0.2452 -> 0.2180; at 2048 columns
#     no change (LayerNorm 0.2320 -> 0.2329, RMSNorm 0.2074 -> 0.2086; 264 blocks lost there,
#     0.3116 and 0.2453).
BLOCK_WGRAD_SLOTS = {"f32": 4, "bf16": 2}
BLOCK_THREADS_MIN = 128
# A block per row forward of an op without weights fits 32 registers a thread: held there,
# two 1024-thread blocks share an SM, and a long row's latency is hidden by the other
# (H200, cross-entropy over 50257 columns: f32 at 31 registers ran 0.63 ms, at 42 0.82, when
# that forward still took this shape; it now takes the one-sweep one below, and this bound
# serves the bf16 softmax and log-softmax forwards). With weights (norms) it would spill.
BLOCK_MIN_BLOCKS_FORWARD = 2
# A kernel that reads its row in one sweep (cross-entropy's forward: the max and the online
# sum in one pass, the target's logit read at its column) keeps nothing for later, so it
# takes short blocks, eight an SM at 32 registers: more rows in flight, and the per-row
# merge of the block's warps costs a quarter as much a column. H200, 8192 x 50257: bf16
# 0.248 ms at 1024 threads, 0.206 at 256 (0.96 of copy); f32 0.390, 0.384.
BLOCK_THREADS_ONE_SWEEP = 256
BLOCK_MIN_BLOCKS_ONE_SWEEP = 8
# A kernel that sweeps its row again re-reads what its registers do not hold from L2, if
# the rows in flight still fit there. fp32 rows are long in bytes: at two groups a thread,
# 132 x 2 rows of 200 KB overflow the 50 MB L2, and the re-read comes from memory. So fp32
# kernels without weights cache 10 groups a thread (40 registers, shared among the cached
# operands: 40960 of a 50257-wide row) in one 1024-thread block an SM (64 registers). H200,
# cross-entropy forward+backward fused, 8192 x 50257 fp32: 1.122 -> 0.947 ms (0.83 of
# copy). bf16 kept its one group and the next row's prefetch: cached this way it ran
# 0.577 ms against 0.532. Measured at 50257 columns only; the rule holds from 769 up.
BLOCK_REREAD_GROUPS = {"f32": 10}
# Its blocks start at 64 threads: at 128, 2048 columns filled 4 of a thread's 10 groups.
# H200, 32768 x 2048 fp32: softmax forward 0.162 -> 0.147 ms (PyTorch 0.144), log-softmax
# 0.150 -> 0.144 (0.134), forward+backward 0.367 -> 0.352 and 0.355 -> 0.349 (0.323);
# unchanged at 8192 and 50257 columns.
BLOCK_REREAD_THREADS_MIN = 64
# A block per row without weight gradients that does not prefetch (fp32) takes a block a row
# where its registers hold the row (row_launch, uncapped_cols); over longer rows its capped
# grid keeps the rows in flight, re-read from L2, within L2. H200, fp32, capped -> a block
# a row, ms (PyTorch): 32768 x 2048 log-softmax forward 0.144 -> 0.133 (0.134), forward+
# backward 0.349 -> 0.323 (0.324), softmax forward 0.146 -> 0.134 (0.144), LayerNorm forward
# 0.146 -> 0.135; 8192 x 8192 softmax forward 0.140 -> 0.134, forward+backward 0.333 ->
# 0.323, log-softmax 0.139 -> 0.134 and 0.335 -> 0.341, LayerNorm forward 0.140 -> 0.146;
# 8192 x 50257 (re-read) uncapped lost: softmax forward+backward 2.488 -> 2.586. bf16, which
# prefetches the next row of its loop, lost uncapped at every width (log-softmax forward
# 2048 0.103 -> 0.114).
# Where they read one row operand, their first sweep, which reads the row from memory (the
# later ones re-read it from L2), takes its re-read groups two at a time, both loads in
# flight before either is computed: the loop otherwise loads, computes, loads (a kernel
# that reads two operands has two loads in flight already, and batched it would spill).
# H200, cross-entropy fused 8192 x 50257 fp32: 0.935 -> 0.879 ms (0.90 of copy); batching
# every sweep, 0.893. Not bf16: its kernel (one cached group and the next row's prefetch)
# ran 0.506 -> 0.604 with the first sweep batched, 0.528 with the last.
BLOCK_REREAD_BATCH = 2
# A block per row of an op without weights sweeps its re-read groups whole (every lane's in
# the row's body) with no bounds test, then the one group that may end in the body: the
# tests, the zeros of the lanes past the body and the predicated loads, arithmetic and
# stores were 11 of 75 instructions a group in cross-entropy bf16's first sweep, 21 of 101
# in its last (nvcc sm_90). H200, 8192 x 50257: cross-entropy fused bf16 0.502 -> 0.486 ms
# (0.81 of copy), fp32 0.879 -> 0.856; softmax and log-softmax forwards 4-7% faster; the
# log-softmax bf16 forward+backward 1.400 -> 1.434. With weights (the norms) the kernels
# took more registers for it (RMSNorm's bf16 backward 85 for 64, its 8192 x 50257
# forward+backward 4.770 -> 4.909 ms), so they keep the test. Only the aligned entry point
# takes it (row.cu.j2): in the `_unaligned` ones it cost registers too (cross-entropy bf16
# 32 -> 44-57, one block an SM rather than two).
BLOCK_WHOLE_GROUPS = True


# Two blocks of 512 an SM where one of 1024 would hold the row: a thread caches twice the
# groups, so an SM has two rows in flight and each row's reductions merge half the warps.
# Rows of 2048-16384 columns wait on their reductions and on the memory latency of one
# row at a time in a block of 1024. Taken by (H200, ms, 1024-thread block -> this one):
# - the split backward's rows kernel (WGRAD_SPLIT_COLS): LayerNorm bf16 8192 columns
#   fwd+bwd 0.408 -> 0.347, fp32 16384 1.165 -> 1.078 (at 50257: 3.185 -> 3.195, fp32
#   4.220 -> 4.629, where two rows in flight an SM re-read more from memory);
# - bf16 forwards with weights (the norms; fp32 ran 0.142 -> 0.161 at 1024 columns, 0.289
#   -> 0.321 at 16384): LayerNorm 1024 0.100 -> 0.076, 2048 0.101 -> 0.077, 4096 0.107 ->
#   0.077, 8192 0.123 -> 0.082 (PyTorch 0.119), 16384 0.244 -> 0.183, 50257 1.005 -> 0.897;
#   RMSNorm 8192 0.094 -> 0.075;
# - bf16 backwards without weights (softmax, log-softmax, cross-entropy's unfused one; the
#   forwards ran faster at 8192 columns, 0.119 -> 0.100, and slower at 50257, 0.546 ->
#   0.607; cross-entropy's fused fwdbwd 0.490 -> 0.556): fwd+bwd softmax 8192 0.303 ->
#   0.250, 50257 1.654 -> 1.595; log-softmax 0.281 -> 0.227, 1.446 -> 1.315 (PyTorch 1.318);
#   held to 64 registers, softmax's spills 8 bytes (nvcc sm_90).
# At 64 threads a block at least (at 128, 1024 bf16 columns left half of each thread's
# groups empty: LayerNorm forward 0.100 -> 0.112 ms, and 0.076 at 64).
BLOCK_PAIR_THREADS, BLOCK_PAIR_MIN_BLOCKS, BLOCK_PAIR_THREADS_MIN = 512, 2, 64
BLOCK_PAIR_SLOTS = {"f32": 4, "bf16": 2}

# A block per row of a stage without weight gradients whose row its registers hold
# (block_held): bf16 rows past a warp's 768 columns, up to 8192. Four groups a thread (one
# warp up to 1024 columns, 64 threads to 2048, 256 at 8192; 64 registers, four blocks an
# SM: the backwards spill 24-32 bytes), no prefetch, a block a row (uncapped grid), and the
# two-pass impl: from registers a second sweep costs no traffic, and softmax's reuses the
# first's exponentials. The block_per_row kernel (one group a thread, the next row's
# prefetched, online sums) keeps the longer rows, whose tail it re-reads from L2. H200, bf16, 2^26 elements, the
# generated kernels as the runtime launches them, ms, block_per_row -> block_held:
#   2048 columns: softmax forward 0.1153 -> 0.0706, backward 0.1227 -> 0.1036; log-softmax
#     0.1032 -> 0.0730, 0.1117 -> 0.1016; cross-entropy forward 0.0750 -> 0.0392, backward
#     0.0806 -> 0.0698, fused 0.1096 -> 0.0697;
#   4096 and 8192: the same gains (softmax forward 8192 0.1194 -> 0.0732, 0.88 of copy);
#   1024, where a block of 64 threads left half its groups empty (softmax forward 0.1209
#     -> 0.1059, log-softmax backward 0.1175 -> 0.1252), one warp fills them: softmax
#     0.0694 forward, 0.1036 backward (was 0.1287); log-softmax 0.0719 and 0.1016 (0.1082,
#     0.1175); cross-entropy fused 0.1161 -> 0.0701; LayerNorm forward 0.0764 -> 0.0699
#     (0.0918 at 64 threads); at 1536 columns 64 threads beat one warp (softmax forward
#     0.0820 against 0.0878; block_per_row 0.1192);
#   16384 (the row past the block's registers): log-softmax forward 0.0912 -> 0.1008,
#     cross-entropy 0.0396 -> 0.0484, hence max_cols 8192;
#   the norms' forwards (hand-instantiated, against their block_per_row shape, BLOCK_PAIR):
#     LayerNorm 2048 0.0771 -> 0.0701, 4096 0.0772 -> 0.0716; RMSNorm 2048 0.0746 ->
#     0.0689, 8192 0.0738 -> 0.0711.
# In this shape (hand-instantiated, softmax forward 2048, 0.0711 ms) online sums ran 0.0834,
# two or three groups a thread 0.0843 / 0.0874, eight (spilling) 0.1325, the next row's
# prefetch 0.0764 and a capped grid 0.0732. fp32's block_per_row kernel already holds
# 40960 columns (its REREAD groups), at 0.92-1.00 of copy from 2048 to 8192 columns.
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


def warp_shape(dtype: str, *, stage: str, wgrad: bool, levels: int = 1) -> RowShape:
    """The block of a warp-per-row kernel of `stage` whose row takes `levels` reduction
    levels (sweeps that end in a reduction)."""
    rows = (WARP_ROWS_PER_BLOCK_WGRAD if wgrad else
            WARP_ROWS_PER_BLOCK_OF.get((dtype, stage), WARP_ROWS_PER_BLOCK))
    if wgrad and levels >= 2 and dtype in PREFETCH_DTYPES:
        return RowShape(32 * rows, WARP_DEEP_WGRAD_BLOCKS, WARP_SLOTS[dtype], False)
    return RowShape(32 * rows, WARP_MIN_BLOCKS.get((dtype, stage), 0),
                    WARP_SLOTS[dtype], dtype in PREFETCH_DTYPES)


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
        return RowShape(BLOCK_THREADS_ONE_SWEEP, BLOCK_MIN_BLOCKS_ONE_SWEEP,
                        BLOCK_SLOTS[dtype], prefetch, whole=whole)
    if dtype in BLOCK_REREAD_GROUPS:
        return RowShape(BLOCK_THREADS_MAX, 1, BLOCK_REREAD_GROUPS[dtype] // max(cached, 1),
                        False, BLOCK_REREAD_BATCH if cached <= 1 else 1, whole,
                        threads_min=BLOCK_REREAD_THREADS_MIN)
    if stage == "backward":
        return replace(pair, whole=whole)
    return RowShape(BLOCK_THREADS_MAX, BLOCK_MIN_BLOCKS_FORWARD if stage == "forward" else 0,
                    BLOCK_SLOTS[dtype], prefetch, whole=whole)


def held_shape(dtype: str, *, stage: str, wgrad: bool) -> RowShape | None:
    """The block of a block_held kernel (a block per row, the row in registers), or None
    where `dtype` or a stage with weight gradients takes none (HELD_SLOTS)."""
    if wgrad or stage == "backward_rows" or dtype not in HELD_SLOTS:
        return None
    return RowShape(HELD_THREADS, HELD_MIN_BLOCKS, HELD_SLOTS[dtype], False,
                    threads_min=HELD_THREADS_MIN)


@dataclass(frozen=True)
class KernelPlan:
    """A row op's plan: its template and whether it has a fused forward+backward."""
    template: str                    # file under templates/
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


# Weight gradients of long rows. A block per row that sums them keeps its partials in
# registers for the columns it caches and adds the rest into its workspace row in L2, a
# read and a write a column a row; with 64-100 registers at 512 threads it holds one or two
# blocks an SM, so each row's reductions wait on the memory latency with little else to
# hide it, and past 25 MB of partial rows in flight the workspace spills L2 to memory. The
# backward is split instead from wgrad_split_cols columns: `backward_rows` (a block per row
# without weight gradients, two of 512 an SM: BLOCK_PAIR_THREADS) writes the input grads and
# the per-row values the weight-gradient terms read (`row_stats` of them a row, float32), and `wgrad_cols`
# reads the rows again by columns: a thread owns vec adjacent columns and sums their terms
# over the rows y, y + G, ... (G = grid.y), WGRAD_COLS_ROWS rows' loads in flight, into
# partial row y, which `wgrad_reduce` sums. Launch: WGRAD_COLS_THREADS threads, grid
# (cdiv(cols, vec · threads), G), G = clamp(cdiv(blocks, grid.x), 1, rows).
# H200, forward+backward, 2^26 elements (8192 rows from 8192 columns), ms, fused -> split,
# PyTorch in the same run:
#   LayerNorm bf16: 4096 0.334 -> 0.320 (0.333), 8192 0.494 -> 0.347 (0.376), 16384 1.015
#     -> 0.705 (0.744), 50257 7.145 -> 3.195 (3.681); fp32: 4096 0.400 -> 0.528, 8192
#     0.472 -> 0.520, 16384 1.299 -> 1.078 (1.316), 50257 7.947 -> 4.629 (6.598);
#   RMSNorm bf16: 4096 0.212 -> 0.289, 8192 0.257 -> 0.300, 16384 0.549 -> 0.583, 50257
#     4.830 -> 2.424 (3.596); fp32: 16384 0.934 -> 0.942, 50257 4.629 -> 3.903 (6.749).
# So a row of two reduction levels (LayerNorm: 93 registers, one block an SM) splits sooner
# than one of one (RMSNorm: 64, two); keyed (dtype, levels ≥ 2). bf16 LayerNorm split from
# 4097 columns until its fused backward took two groups a thread (BLOCK_WGRAD_SLOTS: 8192
# columns in registers); since, fused -> split, timed as benchmarks/kernels.py times it:
# 4096 0.219 -> 0.282 ms, 6144 0.252 -> 0.295, 8192 0.255 -> 0.299, 12288 0.392 -> 0.343
# (PyTorch 0.337, 0.380, 0.375, 0.392).
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


# Pairs of one token whose index-only terms a pair block tables at a time (D ≤ 512 in one
# go); a multiple of every vec, so that the vector path's chunks stay 16-byte aligned.
PAIR_TABLE = 256
PAIR_THREADS = 256
# Pair blocks held to 40 registers, six an SM: more 16-byte loads in flight, no spills
# (RESULTS.md, PAIR_MIN_BLOCKS).
PAIR_MIN_BLOCKS = 6


# Pair blocks loop over tokens: four times the blocks that fit at once ran fastest in
# bf16, within 2% of a block a token in fp32 (RESULTS.md, _PAIR_GRID_MAX).
_PAIR_GRID_MAX = 132 * PAIR_MIN_BLOCKS * 4


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


def embedding_launch(stage: str, dtype: str) -> launch.Geometry:
    if stage == "forward":
        return launch.EmbeddingForward(EMBEDDING_THREADS, _GRID_MAX)
    if stage == "backward_wpe":
        return launch.EmbeddingWpe(EMBEDDING_THREADS, VEC[dtype], _GRID_MAX)
    if stage == "backward_sort":
        return launch.EmbeddingSort(EMBEDDING_SORT_THREADS, EMBEDDING_TILE)
    if stage == "backward_merge":
        return launch.EmbeddingMerge(EMBEDDING_THREADS)
    if stage == "backward_wte_long":
        return launch.EmbeddingWteLong(EMBEDDING_LONG_THREADS, 32, EMBEDDING_LONG_RUN, VEC[dtype],
                                       EMBEDDING_LONG_GRID)
    return launch.EmbeddingWte(EMBEDDING_WTE_THREADS, 32,
                               EMBEDDING_WTE_THREADS // 32 * EMBEDDING_WTE_WARP_ROWS, VEC[dtype])

