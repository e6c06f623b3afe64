"""Kernel plans: which template renders an op, and how its kernels are launched.

A KernelPlan is chosen from a DerivedOp alone (sizes such as the row length arrive at
launch), so it is a frozen value that the render step and the manifest share. The facts
the runtime needs to launch a kernel travel in `KernelSig.plan` as (key, value) pairs;
the keys, per template (every kernel also has `threads`, the block size, and
`grid_max`: the grid is min(the formula below, grid_max), kernels loop over the rest;
None: no cap):

pointwise  vec (elements per 16-byte access), unroll (vectors per thread per operand: a
           block's tile is threads · unroll vectors; pointwise_tile gives both, per kernel,
           from its dtype, the operands it reads and the weight of its arithmetic):
           grid = cdiv(n, vec · unroll · threads), uncapped (grid_max None: short blocks
           that each stream one tile keep the resident blocks on one contiguous window of
           memory and leave no tail wave). Any n and any alignment work (a scalar path
           takes unaligned pointers and the tail); in_place_ok = True.
row        layout 'warp_per_row', 'block_held' or 'block_per_row'; each kernel is correct
           for any row length, `max_cols` / `min_cols` say where each is the fast one.
           `aligned`: each (stage, layout, dtype) has two kernels: True for operands that
           take 16-byte access throughout (runtime/kernels.row_aligned), False
           (`_unaligned`) for any. Each kernel's block is a RowShape (warp_shape,
           held_shape, block_shape): threads, the __launch_bounds__ minimum of blocks,
           the 16-byte groups a lane caches, whether it prefetches the next row
           (PREFETCH_DTYPES) and how many re-read groups its first sweep loads at a time
           (BLOCK_REREAD_BATCH); the last three are template arguments of the kernel's
           impl.
           warp_per_row: rows_per_block (one warp per row), grid = cdiv(rows, rows_per_block),
           capped only where a warp loops over several rows: the prefetching kernels, and
           those with weight gradients.
           block_per_row: threads is the most a block takes (block_shape: 1024; 512 with
           weight gradients; 256 for a kernel that reads its row once); launch
           clamp(round_up(cdiv(cols, cols_per_thread), 32), threads_min, threads) threads,
           grid = rows (capped but for rows of at most `uncapped_cols` columns: a kernel
           that does not prefetch, over rows its registers hold, takes a block a row). The
           first cols_per_thread elements a thread owns stay in registers; longer rows are
           re-read (from L2) once per pass.
           block_held (HELD_SLOTS' dtypes, stages without weight gradients): a block per row
           for rows of min_cols to max_cols columns, which its registers hold; grid = rows,
           uncapped. Where a stage has an online sum it takes the two-pass impl, as the warp
           does.
           wgrad_partials: for backward kernels of ops with weights, each row worker (a warp,
           or a block) writes its partial weight gradient to a float32 workspace
           [partials, cols] per weight: partials = grid · rows_per_block (warp) or grid
           (block). `<op>_wgrad_reduce_<dt>` then sums them in a fixed order: block
           (threads_x, threads_y), grid = cdiv(cols, threads_x).
           fwdbwd kernels: dx_may_alias_x = True (the row is read before it is written).
           The split backward of an op with weights (rows of split_cols columns or more,
           wgrad_split_cols): `backward_rows` (block_per_row, as above, no partials) writes
           the input grads and row_stats float32 values a row to a workspace [rows,
           row_stats]; `wgrad_cols` (threads, vec, aligned as for the row kernels) reads
           them with the rows, grid (cdiv(cols, vec · threads), G), G = clamp(cdiv(blocks,
           grid x), 1, rows), and writes partials = G rows, which wgrad_reduce sums.
pair       blocks loop over the tokens in (b, t) order, each taking every grid-th one:
           grid = min(B · T, grid_max · threads / launched threads). Strides are arguments
           (views of a fused qkv buffer work); in_place_ok = True (y may be x, dx may be
           dy). vec: pairs a thread takes in the 16-byte path (all pointers 16-byte
           aligned, b/t/h strides and D/2 multiples of vec; checked in the kernel, which
           takes one pair a thread otherwise). table_pairs: the per-(token, k) terms
           (cos θ, sin θ) go to a shared table of that many pairs, built once per token
           for all its heads, a block sweeping its token's heads once per table_pairs pairs
           (any D). Launch min(round_up(H · cdiv(min(D/2, table_pairs), vec), 32), threads)
           threads: no more than a token has vectors (GPT-2 small's 12 heads of 64 are 48
           in bf16), so that small tokens still put many blocks on an SM (and the grid
           grows as they shrink); any block size and any grid are correct.
update     vec, grid = cdiv(n, vec · threads); state is float32 whatever the dtype, grads
           are the storage dtype; launch once per weight-decay range.
embedding  forward: a warp a row, grid = cdiv(BT, threads / 32) (any grid is correct: warps
           stride over the rows), ids checked on the device.
           backward (n = BT ids, V table rows; a planned workspace of int64 `tiled` and
           `keys`, n each, int32 `first`, V, and int32 `runs`, 1 + n / (long_run + 1)):
           backward_sort: tile, grid = cdiv(n, tile) (a block sorts one tile of keys id <<
           32 | position; the blocks clear first and runs[0]); backward_merge: grid =
           cdiv(n, threads) (each key to its rank; first[id] = n - the rank of the id's
           first key, 0 where it does not occur); backward_wte: a block takes `rows` rows
           of dwte, a warp (lanes threads) rows / (threads / lanes) of them, grid =
           (cdiv(V, rows), cdiv(C / w, lanes)) with w = vec when the `vec` argument is 1 (C
           % vec == 0 and dout, dwte 16-byte aligned), else 1; it lists the rows whose id
           has more than long_run keys in runs and leaves them to backward_wte_long: a block
           a listed run, grid = (min(runs' capacity, grid_max), cdiv(C / w, lanes));
           backward_wpe: vec, grid = cdiv(T · C, vec · threads). The backward_w* add into
           their output when `accumulate` is 1, else write all of it. The sort kernels
           read no floats; each dtype has its copy, so that every stage is looked up by
           (stage, dtype).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import sympy as sp

from eulergen.errors import EulerError
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
    """How one op is rendered: the template and the launch facts for each storage dtype."""
    template: str                    # file under templates/
    dtypes: tuple[str, ...]
    threads: int
    vec: tuple[tuple[str, int], ...]  # dtype -> elements per 16-byte access
    fwdbwd: bool = False             # row op whose outputs are all per-row scalars

    def vec_of(self, dtype: str) -> int:
        return dict(self.vec)[dtype]


_TEMPLATES = {"pointwise": "pointwise.cu.j2", "row": "row.cu.j2", "pair": "pair.cu.j2",
              "update": "update.cu.j2"}


def plan_op(op: ir.DerivedOp) -> KernelPlan:
    """The plan for an op of kind pointwise, row, pair or update."""
    if op.kind not in _TEMPLATES:
        raise EulerError(f"no CUDA template for kind {op.kind!r}", file=op.where.file,
                         line=op.where.line, key="kind")
    vec = tuple(VEC.items())
    if op.kind == "pointwise":
        return KernelPlan("pointwise.cu.j2", DTYPES, threads=256, vec=vec)
    if op.kind == "row":
        scalar_only = all(o.role == "scalar" for o in op.outputs)
        return KernelPlan("row.cu.j2", DTYPES, threads=32 * WARP_ROWS_PER_BLOCK, vec=vec,
                          fwdbwd=scalar_only)
    if op.kind == "pair":
        return KernelPlan("pair.cu.j2", DTYPES, threads=256, vec=vec)
    # update: state is float32, so one vector is 4 state floats (two for bf16 grads' 8).
    return KernelPlan("update.cu.j2", DTYPES, threads=256, vec=(("f32", 4), ("bf16", 8)))


# Pointwise tiles (threads, vectors a thread). Measured on the H200 (2^28 elements, PyTorch
# eager in the same run):
# - arithmetic-light kernels (relu, relu2: compares, selects, products) stream best in
#   short blocks of one vector a thread: relu bf16 forward 0.264 -> 0.253 ms (PyTorch
#   0.253), backward 0.372 -> 0.370 (against 256 x 8); fp32 relu forward 0.522 -> 0.501;
# - fp32 kernels with special functions, two vectors a thread in 128: gelu_erf forward
#   0.515-0.523 ms at one (PyTorch 0.507), 0.503-0.506 at two, 0.511 at three; with two or
#   three operands too (forward+backward or forward, timed in turns with PyTorch's, 256 x 4
#   -> 128 x 2): gelu 1.2494 -> 1.2439 ms (PyTorch 1.2454), gelu_erf 1.2440 -> 1.2423
#   (1.2434), silu 1.2481 -> 1.2447 (1.2441), swiglu 1.0072 -> 0.9988, geglu 1.0074 ->
#   0.9973, their forwards 0.3744 -> 0.3714 and 0.3743 -> 0.3718; 512 x 2 and 128 x 4
#   were no better;
# - bf16 kernels with special functions want four vectors a thread: silu forward 0.278 ->
#   0.275 ms (PyTorch 0.276); one vector ran 0.290; those reading one operand, eight in
#   128 threads (timed in turns with PyTorch's, against 256 x 4): gelu_erf forward 0.3121
#   -> 0.2995 ms (PyTorch 0.3435), gelu 0.2647 -> 0.2634, silu 0.2643 -> 0.2633; with two
#   operands 256 x 4 stays: swiglu forward 0.1897 (0.1915 at 128 x 8), geglu 0.1899
#   (0.1911), silu forward+backward 0.6376 (0.6384).
POINTWISE_LIGHT_TILE = (128, 1)
POINTWISE_TILE = {"f32": (128, 2), "bf16": (256, 4)}
POINTWISE_ONE_LOAD_TILE = {"f32": (128, 2), "bf16": (128, 8)}
# An fp32 one-operand kernel with special functions is held to a full SM of its blocks (16
# of 128 threads: 32 registers), as PyTorch's gelu kernel is (31). gelu_erf forward took 39
# registers, 12 blocks an SM; timed in turns with PyTorch's after geglu and gelu's cases
# (as in benchmarks/kernels.py), where both kernels run slower than alone, it ran 1.08x-1.11x
# PyTorch, held 1.01x-1.05x; alone 0.5039-0.5045 ms against 0.5047-0.5049 (PyTorch 0.504).
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


def pointwise_launch(plan: KernelPlan, dtype: str, threads: int,
                     unroll: int) -> tuple[tuple[str, object], ...]:
    return (("threads", threads), ("vec", plan.vec_of(dtype)), ("unroll", unroll),
            ("grid_max", None), ("in_place_ok", True))


def row_launch(plan: KernelPlan, dtype: str, layout: str, *, wgrad: bool, shape: RowShape,
               fwdbwd: bool = False, split_cols: int = 0) -> tuple[tuple[str, object], ...]:
    v = plan.vec_of(dtype)
    if not wgrad:
        grid_max = _GRID_MAX
    elif layout != "warp_per_row":
        grid_max = _GRID_MAX_WGRAD_BLOCK
    else:   # as many blocks as the launch bounds keep on an SM
        grid_max = _SMS * shape.min_blocks if shape.min_blocks else _GRID_MAX_WGRAD
    extra: tuple[tuple[str, object], ...] = (("dx_may_alias_x", True),) if fwdbwd else ()

    def partials(rule: str) -> tuple[tuple[str, object], ...]:
        return (("wgrad_partials", rule),) if wgrad else ()
    if layout == "warp_per_row":
        rpb = shape.threads // 32
        if not wgrad and not shape.prefetch:
            grid_max = None
        return (("layout", layout), ("threads", shape.threads),
                ("rows_per_block", rpb), ("grid_max", grid_max),
                ("max_cols", 32 * v * shape.slots)) + partials("grid*rows_per_block") + extra
    per_thread = v * shape.slots
    if layout == "block_held":
        return (("layout", layout), ("threads", shape.threads),
                ("threads_min", shape.threads_min), ("cols_per_thread", per_thread),
                ("rows_per_block", 1), ("grid_max", None),
                ("min_cols", 32 * v * WARP_SLOTS[dtype] + 1),
                ("max_cols", shape.threads * per_thread)) + extra
    if split_cols:
        extra += (("split_cols", split_cols),)
    if not wgrad and not shape.prefetch:
        extra += (("uncapped_cols", shape.threads * per_thread),)
    return (("layout", layout), ("threads", shape.threads),
            ("threads_min", shape.threads_min), ("cols_per_thread", per_thread),
            ("rows_per_block", 1), ("grid_max", grid_max),
            ("min_cols", 32 * v * WARP_SLOTS[dtype] + 1)) + partials("grid") + extra


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


def wgrad_cols_launch(plan: KernelPlan, dtype: str, stats: int) -> tuple[tuple[str, object], ...]:
    return (("threads", WGRAD_COLS_THREADS), ("vec", plan.vec_of(dtype)), ("row_stats", stats),
            ("blocks", WGRAD_COLS_BLOCKS), ("grid_max", None))


# The fixed-order reduce of weight partials: 8 columns (a 32-byte sector) by 128 partial
# groups per block, so that even a 768-wide weight spreads over 96 blocks.
REDUCE_X, REDUCE_Y = 8, 128
WGRAD_REDUCE_LAUNCH = (("threads", REDUCE_X * REDUCE_Y), ("threads_x", REDUCE_X),
                       ("threads_y", REDUCE_Y), ("grid_max", None))


# Pairs of one token whose index-only terms a pair block tables at a time (D ≤ 512 in one
# go); a multiple of every vec, so that the vector path's chunks stay 16-byte aligned.
PAIR_TABLE = 256
# Full (256-thread) pair blocks held to 40 registers, six an SM (sm_90, no spills; unbounded
# they took 44-48, five an SM): more 16-byte loads in flight. At 32 (eight) they spill.
PAIR_MIN_BLOCKS = 6


# Pair blocks loop over tokens; grid_max counts blocks of `threads` (smaller blocks get
# proportionally more: runtime/kernels.pair_grid). Measured on the H200, B=8 T=1024 H=32
# D=128, forward fp32 / bf16: a block a token (8192) 69.5 / 65.1 us; 3168 blocks (four
# times what fits at once) 70.8 / 39.7; 1584: 74.2 / 57.4; 792: 75.7 / 58.6.
_PAIR_GRID_MAX = 132 * PAIR_MIN_BLOCKS * 4


def pair_launch(plan: KernelPlan, dtype: str) -> tuple[tuple[str, object], ...]:
    return (("threads", plan.threads), ("vec", plan.vec_of(dtype)), ("table_pairs", PAIR_TABLE),
            ("grid_max", _PAIR_GRID_MAX), ("in_place_ok", True))


def update_launch(plan: KernelPlan, dtype: str) -> tuple[tuple[str, object], ...]:
    return (("threads", plan.threads), ("vec", plan.vec_of(dtype)), ("grid_max", _GRID_MAX))


EMBEDDING_THREADS = 256
# The forward's 16-byte vectors a lane loads before it stores (a warp a row). H200, 65536
# ids into 50304 x 768, in us, bf16 / fp32: a thread a vector (an id load and two 64-bit
# divisions each) 61.7 / 105.0 (ncu); a warp a row fetching 2, 3, 4: 57.0 / 102.8, 52.8 /
# 102.0, 57.2 / 102.2 (events; 3 is a 768-wide row's bf16 vectors a lane, half its fp32).
# Loading the next row's id ahead: slower (60.3 / 107.0 at 4).
EMBEDDING_FETCH = 3
EMBEDDING_WTE_THREADS = 256           # the dwte kernel: 8 warps a block,
EMBEDDING_WTE_WARP_ROWS = 16          # a warp 16 rows (one after another; at most 32)
# dwte kernel, H200 (ncu), 50304 x 768, 8192 / 65536 ids, f32 and bf16, in us, by rows a
# warp: 4: 58.7 / 135.5, 34.5 / 72.4; 8: 53.5 / 123.1, 30.0 / 65.8; 16: 52.4 / 117.1,
# 29.3 / 61.8; 32: 54.2 / 114.8, 30.7 / 68.4.
# Runs longer than EMBEDDING_LONG_RUN keys (frequent tokens) go to their own kernel, a block
# of EMBEDDING_LONG_THREADS a run, each warp staging EMBEDDING_LONG_ROWS of its rows a round;
# at most EMBEDDING_LONG_GRID blocks a chunk, looping over the runs. In the dwte kernel a run
# is one warp's chain of loads, RUN_BATCH rows a memory latency: H200, 64 x 1024 ids drawn
# 1/rank over 50257 (the top id 8.8% of them), forward+backward fp32 1.066 ms, bf16 1.037
# (PyTorch 0.846, 0.754); with this kernel 0.378 and 0.296 (ncu: 105 and 115 us of it),
# uniform ids unchanged (0.322, 0.208). Long runs from 16 or 64 keys: within 2% of these;
# blocks of 256 x 8 or 1024 x 2 rows: fp32 0.391, 0.430 ms, bf16 0.296, 0.333.
EMBEDDING_LONG_RUN = 32
EMBEDDING_LONG_THREADS = 512
EMBEDDING_LONG_ROWS = 4
EMBEDDING_LONG_GRID = 64
EMBEDDING_SORT_THREADS = 1024
EMBEDDING_TILE = 2 * EMBEDDING_SORT_THREADS   # keys a block sorts: one compare-exchange a thread
EMBEDDING_MERGE_GROUP = 8             # tiles whose lower bounds a merge thread runs in lockstep
# Blocks an SM the merge kernel's launch bounds ask for: 4 of 256 threads leave it 64
# registers, room for a group's probes in flight. Bounded by threads alone, ptxas (sm_90)
# kept it at 32 registers and issued each probe's load after the last one's compare.
EMBEDDING_MERGE_MIN_BLOCKS = 4


def embedding_launch(stage: str, dtype: str) -> tuple[tuple[str, object], ...]:
    if stage == "forward":
        return (("threads", EMBEDDING_THREADS), ("grid_max", _GRID_MAX))
    if stage == "backward_wpe":
        return (("threads", EMBEDDING_THREADS), ("vec", VEC[dtype]), ("grid_max", _GRID_MAX))
    if stage == "backward_sort":
        return (("threads", EMBEDDING_SORT_THREADS), ("tile", EMBEDDING_TILE),
                ("grid_max", None))
    if stage == "backward_merge":
        return (("threads", EMBEDDING_THREADS), ("tile", EMBEDDING_TILE), ("grid_max", None))
    if stage == "backward_wte_long":
        return (("threads", EMBEDDING_LONG_THREADS), ("lanes", 32),
                ("long_run", EMBEDDING_LONG_RUN), ("vec", VEC[dtype]),
                ("grid_max", EMBEDDING_LONG_GRID))
    return (("threads", EMBEDDING_WTE_THREADS), ("lanes", 32),
            ("rows", EMBEDDING_WTE_THREADS // 32 * EMBEDDING_WTE_WARP_ROWS), ("vec", VEC[dtype]),
            ("grid_max", None))
