"""Launch geometry: one frozen value per kernel shape, made by the planner
(generator/plan.py), written to the manifest (`to_json`), read back by the runtime
(`from_json`) and turned into a launch there by its one method, `launch(...)`.

A leaf: it imports only the standard library, so the generator and the runtime share it
without importing each other. Every value holds the most threads a block of it launches
(`threads`, its __launch_bounds__) and the facts that choose between a stage's kernels (a
row kernel's layout and column range, `aligned`, an attention kernel's head dim); `launch`
takes the call's sizes and gives the grid, the block and, where a kernel has them, its
dynamic shared memory and the rows of weight-gradient partials it writes. `grid_max`: the
grid is min(the count, grid_max) where the kernel loops over the rest (None: uncapped).
"""
from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields
from typing import ClassVar, NamedTuple


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def capped(count: int, grid_max: int | None) -> int:
    """`count` blocks, at most grid_max (None: any), at least one."""
    return max(1, min(count, grid_max) if grid_max else count)


class Launch(NamedTuple):
    """One launch's grid and block (a tuple: made at every launch, where a frozen dataclass
    would cost a microsecond more)."""
    grid: tuple[int, ...]
    block: tuple[int, ...]
    shared_mem: int = 0
    partials: int = 0      # rows of the weight-gradient workspace the launch writes (row ops)


class Geometry:
    """What every shape has: its tag in the manifest and the JSON of its fields."""
    shape: ClassVar[str]

    def to_json(self) -> dict:
        return {"shape": self.shape, **asdict(self)}


# ---- pointwise, update, blocks, pair --------------------------------------------------

@dataclass(frozen=True)
class Pointwise(Geometry):
    """A block of `threads` streams one tile of threads · unroll vectors of `vec` elements;
    the grid covers the tiles once, uncapped: short blocks that each stream one tile keep
    the resident blocks on one window of memory and leave no tail wave. Any n and any
    alignment work (a scalar path takes unaligned pointers and the tail); outputs may alias
    inputs."""
    shape: ClassVar[str] = "pointwise"
    threads: int
    vec: int
    unroll: int
    min_blocks: int = 0    # the __launch_bounds__ minimum of blocks an SM (0: none)
    grid_max: int | None = None

    def launch(self, n: int) -> Launch:
        return Launch((capped(cdiv(n, self.vec * self.unroll * self.threads), self.grid_max),),
                      (self.threads,))


@dataclass(frozen=True)
class Update(Geometry):
    """An optimizer step over n elements, `vec` a thread a step; state is float32, grads
    the storage dtype."""
    shape: ClassVar[str] = "update"
    threads: int
    vec: int
    grid_max: int | None

    def launch(self, n: int) -> Launch:
        return Launch((capped(cdiv(n, self.vec * self.threads), self.grid_max),), (self.threads,))


@dataclass(frozen=True)
class Blocks(Geometry):
    """Blocks of `threads`, each `per_block` units of the work (the runtime's own kernels: the
    step's scalars, the loss mean: one block; the draw: a row a block; bf16 row norms: a row a
    warp; casts, copies: an element a thread); grid_max caps the grid where they stride on."""
    shape: ClassVar[str] = "blocks"
    threads: int
    per_block: int = 1
    grid_max: int | None = None

    def launch(self, units: int) -> Launch:
        return Launch((capped(cdiv(units, self.per_block), self.grid_max),), (self.threads,))


@dataclass(frozen=True)
class Pair(Geometry):
    """Pair kernels (RoPE) over [B, T, H, D]: blocks loop over the tokens. A block launches
    one thread a 16-byte vector of a token's table chunk (table_pairs pairs), in whole warps,
    at most `threads`: no more than a token has vectors (GPT-2 small's 12 heads of 64 are 48
    in bf16), so that small tokens still put many blocks on an SM. grid_max counts blocks of
    `threads`, smaller blocks get more. Any block size and grid are correct; outputs may
    alias inputs."""
    shape: ClassVar[str] = "pair"
    threads: int
    vec: int
    table_pairs: int
    min_blocks: int
    grid_max: int

    def launch(self, tokens: int, heads: int, head_dim: int) -> Launch:
        vectors = heads * cdiv(min(head_dim // 2, self.table_pairs), self.vec)
        threads = min(cdiv(vectors, 32) * 32, self.threads)
        return Launch((max(1, min(tokens, self.grid_max * self.threads // threads)),),
                      (threads,))


@dataclass(frozen=True)
class Gemv(Geometry):
    """y [rows, n] = x [rows, k] · wᵀ for a few rows (at most `rows`, the kernel's
    registers): a block of `threads` takes `cols` output columns (a launch's choice, dividing
    the block's warps), a column's warps splitting k."""
    shape: ClassVar[str] = "gemv"
    threads: int
    rows: int

    def launch(self, n: int, cols: int = 1) -> Launch:
        return Launch((max(1, cdiv(n, cols)),), (self.threads,))


# ---- row ops --------------------------------------------------------------------------

@dataclass(frozen=True)
class WarpPerRow(Geometry):
    """A warp a row, rows_per_block rows a block; fast for rows of at most max_cols (its
    registers hold them), correct for any. `wgrad`: a backward whose row workers (warps)
    each write a row of weight-gradient partials. `dx_may_alias_x`: a fused forward and
    backward that reads its row before it writes it. `aligned`: the variant for operands
    that take 16-byte access throughout (runtime/engine/kinds/row.row_aligned)."""
    shape: ClassVar[str] = "warp_per_row"
    threads: int
    rows_per_block: int
    grid_max: int | None
    max_cols: int
    aligned: bool
    wgrad: bool = False
    dx_may_alias_x: bool = False

    def launch(self, rows: int, cols: int) -> Launch:
        grid = capped(cdiv(rows, self.rows_per_block), self.grid_max)
        return Launch((grid,), (self.threads,), partials=grid * self.rows_per_block)


def _block_threads(cols: int, cols_per_thread: int, threads_min: int, threads: int) -> int:
    """A block per row's threads: enough whole warps for its first cols_per_thread elements
    a thread, within [threads_min, threads]."""
    return min(max(cdiv(cdiv(cols, cols_per_thread), 32) * 32, threads_min), threads)


@dataclass(frozen=True)
class BlockHeld(Geometry):
    """A block a row, the row (min_cols to max_cols columns) in its registers; grid = rows."""
    shape: ClassVar[str] = "block_held"
    threads: int
    threads_min: int
    cols_per_thread: int
    min_cols: int
    max_cols: int
    aligned: bool
    dx_may_alias_x: bool = False

    def launch(self, rows: int, cols: int) -> Launch:
        grid = max(1, rows)
        return Launch((grid,), (_block_threads(cols, self.cols_per_thread, self.threads_min,
                                               self.threads),), partials=grid)


@dataclass(frozen=True)
class BlockPerRow(Geometry):
    """A block a row for rows past min_cols: the first cols_per_thread elements a thread in
    registers, the rest re-read; a capped grid, but uncapped (a block a row) over rows of at
    most uncapped_cols (0: never). `split_cols`: a split backward's rows kernel, taken from
    that many columns (runtime/engine/kinds/row.wgrad_split)."""
    shape: ClassVar[str] = "block_per_row"
    threads: int
    threads_min: int
    cols_per_thread: int
    grid_max: int | None
    min_cols: int
    aligned: bool
    wgrad: bool = False
    uncapped_cols: int = 0
    split_cols: int = 0
    dx_may_alias_x: bool = False

    def launch(self, rows: int, cols: int) -> Launch:
        grid = max(1, rows) if cols <= self.uncapped_cols else capped(rows, self.grid_max)
        return Launch((grid,), (_block_threads(cols, self.cols_per_thread, self.threads_min,
                                               self.threads),), partials=grid)


ROW_LAYOUTS = (WarpPerRow, BlockHeld, BlockPerRow)


def column_launch(rows: int, cols: int, cols_per_block: int, threads: int,
                  blocks: int) -> Launch:
    """A grid of column blocks by G row groups, G = clamp(cdiv(blocks, column blocks), 1,
    rows): group y takes rows y, y + G, …, and writes partial row y."""
    x = cdiv(cols, cols_per_block)
    y = max(1, min(rows, cdiv(blocks, x)))
    return Launch((x, y), (threads,), partials=y)


@dataclass(frozen=True)
class WgradCols(Geometry):
    """The split backward's column kernel: a thread sums `vec` columns over rows y, y + G, …
    into partial row y; grid (cdiv(cols, vec · threads), G), G = clamp(cdiv(blocks, grid x),
    1, rows). It reads row_stats float32 values a row."""
    shape: ClassVar[str] = "wgrad_cols"
    threads: int
    vec: int
    row_stats: int
    blocks: int
    aligned: bool

    def launch(self, rows: int, cols: int) -> Launch:
        return column_launch(rows, cols, self.vec * self.threads, self.threads, self.blocks)


@dataclass(frozen=True)
class WgradReduce(Geometry):
    """The fixed-order sum of weight-gradient partials: block (threads_x, threads_y),
    a block threads_x columns."""
    shape: ClassVar[str] = "wgrad_reduce"
    threads_x: int
    threads_y: int

    @property
    def threads(self) -> int:
        return self.threads_x * self.threads_y

    def launch(self, cols: int) -> Launch:
        return Launch((cdiv(cols, self.threads_x),), (self.threads_x, self.threads_y))


@dataclass(frozen=True)
class BiasRows(Geometry):
    """A pointwise op's bias variant over [rows, cols] operands and [cols] biases: a thread
    owns `vec` adjacent columns (its biases in registers) and loops over the rows of its
    group, `rows` of them loaded at a time; grid (cdiv(cols, vec · threads), G) as
    column_launch makes it. A backward writes each bias gradient's sums over its group's
    rows to partial row y of a [G, cols] float32 workspace. `aligned`: the variant for
    16-byte access throughout (cols a multiple of vec, every pointer on a 16-byte boundary);
    the other takes any shape and alignment. Outputs may alias inputs."""
    shape: ClassVar[str] = "bias_rows"
    threads: int
    vec: int
    rows: int
    blocks: int
    aligned: bool

    def launch(self, rows: int, cols: int) -> Launch:
        return column_launch(rows, cols, self.vec * self.threads, self.threads, self.blocks)


# ---- embedding ------------------------------------------------------------------------

@dataclass(frozen=True)
class EmbeddingForward(Geometry):
    """A warp a row (any grid is correct: warps stride over the rows)."""
    shape: ClassVar[str] = "embedding_forward"
    threads: int
    grid_max: int | None

    def launch(self, rows: int) -> Launch:
        return Launch((capped(cdiv(rows, self.threads // 32), self.grid_max),), (self.threads,))


@dataclass(frozen=True)
class EmbeddingSort(Geometry):
    """A block sorts one tile of keys (id << 32 | position)."""
    shape: ClassVar[str] = "embedding_sort"
    threads: int
    tile: int

    def launch(self, n: int) -> Launch:
        return Launch((cdiv(n, self.tile),), (self.threads,))


@dataclass(frozen=True)
class EmbeddingMerge(Geometry):
    """A thread puts one key at its rank."""
    shape: ClassVar[str] = "embedding_merge"
    threads: int

    def launch(self, n: int) -> Launch:
        return Launch((cdiv(n, self.threads),), (self.threads,))


def _units(cols: int, vec: int, vectorized: bool) -> int:
    return cols // vec if vectorized else cols


@dataclass(frozen=True)
class EmbeddingWte(Geometry):
    """dwte: a block `rows` table rows, a warp (`lanes` threads) its share of them, one lane
    a column unit (`vec` columns when vectorized, else one)."""
    shape: ClassVar[str] = "embedding_wte"
    threads: int
    lanes: int
    rows: int
    vec: int

    def launch(self, table_rows: int, cols: int, vectorized: bool) -> Launch:
        return Launch((cdiv(table_rows, self.rows),
                       cdiv(_units(cols, self.vec, vectorized), self.lanes)), (self.threads,))


@dataclass(frozen=True)
class EmbeddingWteLong(Geometry):
    """A block a run of more than long_run keys (the dwte kernel lists them); grid x at most
    grid_max, looping over the runs."""
    shape: ClassVar[str] = "embedding_wte_long"
    threads: int
    lanes: int
    long_run: int
    vec: int
    grid_max: int | None

    def launch(self, runs: int, cols: int, vectorized: bool) -> Launch:
        return Launch((capped(runs, self.grid_max),
                       cdiv(_units(cols, self.vec, vectorized), self.lanes)), (self.threads,))


class EmbeddingWpe(Update):
    """dwpe: `vec` elements a thread over T · C, an update's loop."""
    shape: ClassVar[str] = "embedding_wpe"


# ---- attention ------------------------------------------------------------------------

@dataclass(frozen=True)
class FlashKernel(Geometry):
    """What a flash kernel of one head dim has: rows a block owns, the tile it streams, its
    dynamic shared memory and the mask mode ('causal' | 'generic' | 'none')."""
    head_dim: int
    threads: int
    block_rows: int
    tile: int
    smem_bytes: int
    mask: str


@dataclass(frozen=True)
class AttentionTiles(FlashKernel):
    """A flash kernel (role forward, backward_dkv or backward_dq): a block owns block_rows
    query rows (dkv: key rows) of one head (dkv: kv head) and streams `tile` rows of the
    other side; grid (cdiv(T, block_rows), heads, B). isa: 'mma' (mma.sync, any GPU the
    build takes) or 'wgmma' (sm_90a only)."""
    shape: ClassVar[str] = "attention"
    role: str
    isa: str = "mma"

    def launch(self, batch: int, seq: int, heads: int, kv_heads: int) -> Launch:
        across = kv_heads if self.role == "backward_dkv" else heads
        return Launch((cdiv(seq, self.block_rows), across, batch), (self.threads,),
                      shared_mem=self.smem_bytes)


@dataclass(frozen=True)
class AttentionDecode(FlashKernel):
    """New queries over a KV cache: a block owns block_rows query rows of one kv head's
    group and one of `splits` ranges of the cache, `tile` keys a step; grid (chunks ·
    splits, KVH, B)."""
    shape: ClassVar[str] = "attention_decode"
    role: ClassVar[str] = "decode"

    def launch(self, batch: int, queries: int, heads: int, kv_heads: int,
               splits: int = 1) -> Launch:
        chunks = cdiv(queries * (heads // kv_heads), self.block_rows)
        return Launch((chunks * splits, kv_heads, batch), (self.threads,),
                      shared_mem=self.smem_bytes)


@dataclass(frozen=True)
class AttentionRowdot(Geometry):
    """delta = rowsum(dO ∘ O): a warp a (batch, head, row), rows_per_block a block."""
    shape: ClassVar[str] = "attention_rowdot"
    threads: int
    rows_per_block: int
    role: ClassVar[str] = "rowdot"

    def launch(self, rows: int) -> Launch:
        return Launch((cdiv(rows, self.rows_per_block),), (self.threads,))


SHAPES = {cls.shape: cls for cls in (
    Pointwise, Update, Pair, *ROW_LAYOUTS, WgradCols, WgradReduce, BiasRows, EmbeddingForward,
    EmbeddingSort, EmbeddingMerge, EmbeddingWte, EmbeddingWteLong, EmbeddingWpe, Blocks, Gemv,
    AttentionTiles, AttentionDecode, AttentionRowdot)}


def from_json(data: dict) -> Geometry:
    """The value `to_json` wrote. ValueError names what is wrong (the manifest reader adds
    the file and key)."""
    if not isinstance(data, dict) or "shape" not in data:
        raise ValueError("should be an object with a 'shape'")
    cls = SHAPES.get(data["shape"])
    if cls is None:
        raise ValueError(f"unknown shape {data['shape']!r} (expected one of {', '.join(SHAPES)})")
    names = {f.name for f in fields(cls)}
    given = set(data) - {"shape"}
    if given - names:
        raise ValueError(f"{cls.shape}: unknown field {sorted(given - names)[0]!r}")
    missing = [f.name for f in fields(cls) if f.name not in given and f.default is MISSING]
    if missing:
        raise ValueError(f"{cls.shape}: missing field {missing[0]!r}")
    return cls(**{k: v for k, v in data.items() if k != "shape"})
