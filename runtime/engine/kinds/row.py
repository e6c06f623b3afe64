"""Row ops on a GPU: rows [..., cols], weights [cols], one index or scalar a row. Which of
a stage's kernels a call takes (`row_kernel`: by layout, as the row length and the operands'
alignment say; `wgrad_split`); weight gradients go through a float32 workspace of
per-worker partial sums and the op's reduce kernel (deterministic: fixed order, no
atomics); over long rows the backward is split (its `rows` part writes dx and per-row
values, its `cols` part sums the weight terms by columns: generator/plan.py
WGRAD_SPLIT_COLS); an op whose outputs are all per row has a one-pass `fwdbwd` kernel.
A norm-shaped op's calls take `precision="autocast"`: its kernels whose stream (the row
input, the add fusion's sum), their gradients and the weights are float32 and the other
operands bf16, the backward also writing dx rounded to bf16 into `copy` (None: not)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import prod

from eulergen.errors import EulerError
from eulergen.launch import BlockHeld, BlockPerRow, WarpPerRow
from eulergen.runtime.engine.kernels import NULL, storage_dtype_name
from eulergen.runtime.engine.kinds.base import OpKind
from eulergen.runtime.engine.launch_args import carve, elements, outputs
from eulergen.runtime.engine.manifest import OpEntry
from eulergen.signature import AUTOCAST, KernelSig, bf16_copy, select


class Row(OpKind):
    name = "row"
    precisions = (AUTOCAST,)

    def forward(self, cuda, op, inputs, out, params, fusion="", precision="", **keywords):
        return _call(cuda, op, "forward", inputs, out, params, fusion=fusion,
                     precision=precision)

    def backward(self, cuda, op, args, out, params, workspace=None, accumulate=(), fusion="",
                 precision="", copy=None, **keywords):
        return _call(cuda, op, "backward", args, out, params, workspace, fusion, precision,
                     copy)

    def fused(self, cuda, op, args, out, params):
        """The one-pass fwdbwd kernel where the op has one (dlogits may alias logits)."""
        if select(op.kernels.values(), "fwdbwd"):
            return _call(cuda, op, "fwdbwd", args, out, params)
        return super().fused(cuda, op, args, out, params)

    def workspace_elements(self, op, stage, shape, dtype, *, table_rows=0, fusion="",
                           precision=""):
        return elements(_layout(op, stage, None if precision else dtype, prod(shape[:-1]),
                                shape[-1], fusion, precision)[1])

    def export_launch(self, op, fn, sizes):
        rows, cols = sizes["rows"], sizes["cols"]
        weights = [0] if _sig(op, "forward", fn.fusion).weight_ptrs else []
        aligned = row_aligned([0], weights, cols * 4, False)
        kernel = row_kernel(op, "forward", "f32", cols, aligned, fusion=fn.fusion)
        return kernel, kernel.geometry.launch(rows, cols), {}


KIND = Row()


@dataclass(frozen=True)
class RowSig:
    """What one stage of a row op reads and writes, by name and role (computed once)."""
    names: tuple[str, ...]        # the call's arrays in order: inputs, then output grads
    roles: tuple[str, ...]        # 'row' | 'weight' | 'index' | 'scalar' for each
    x: int                        # position of the first row input (it sets the shape)
    writes: tuple[str, ...]       # forward outputs, then input grads, in GRADS order
    write_roles: tuple[str, ...]
    wgrads: tuple[str, ...]       # the weight grads among `writes` (workspace + reduce)
    row_ptrs: tuple[str, ...]     # the row operands among names and writes, and the weights
    weight_ptrs: tuple[str, ...]  # among names: what row_aligned checks


@lru_cache(maxsize=None)
def _sig(op: OpEntry, stage: str, fusion: str = "") -> RowSig:
    """`fusion`: of the op's fused variant (manifest.Fusion) of that name."""
    side = op if not fusion else getattr(op.fusions[fusion],
                                         "backward" if stage == "backward" else "forward")
    douts = [o for o in side.outputs if stage == "backward" or
             (stage == "fwdbwd" and o.role == "scalar")]
    names = tuple(o.name for o in side.inputs) + tuple(f"d{o.name}" for o in douts)
    roles = tuple(o.role for o in side.inputs) + tuple(o.role for o in douts)
    fwd = [o for o in side.outputs] if stage in ("forward", "fwdbwd") else []
    grads = [o for o in side.inputs if o.differentiable] if stage != "forward" else []
    writes = tuple(o.name for o in fwd) + tuple(f"d{o.name}" for o in grads)
    write_roles = tuple(o.role for o in fwd) + tuple(o.role for o in grads)
    return RowSig(names, roles, roles.index("row"), writes, write_roles,
                  tuple(f"d{o.name}" for o in grads if o.role == "weight"),
                  tuple(n for n, r in zip(names + writes, roles + write_roles) if r == "row"),
                  tuple(n for n, r in zip(names, roles) if r == "weight"))


def _layout(op: OpEntry, stage: str, dtype: str | None, rows: int, cols: int,
            fusion: str = "", precision: str = "") -> tuple[bool, list[tuple]]:
    """Whether a row op's `stage` call (of its `fusion` variant, in `precision`) over `rows`
    rows of `cols` takes the split backward (wgrad_split), and its workspace as carve lays
    it out: a [partials, cols] float32 row of partial sums per weight gradient, after the
    split backward's [rows, row_stats] per-row values where it takes that. A fused
    variant's split backward shares the op's wgrad_cols kernel. `dtype` None: the
    precision's one."""
    sig = _sig(op, stage, fusion)
    if not sig.wgrads:
        return False, []
    if wgrad_split(op, dtype, cols, fusion, precision):
        by_cols = op.kernel("backward", dtype, part="cols", precision=precision).geometry
        groups = by_cols.launch(rows, cols).partials
        return True, [(rows, by_cols.row_stats)] + [(groups, cols)] * len(sig.wgrads)
    kernel = row_kernel(op, stage, dtype, cols, fusion=fusion, precision=precision)
    partials = kernel.geometry.launch(rows, cols).partials
    return False, [(partials, cols)] * len(sig.wgrads)


def _call(cuda, op: OpEntry, stage: str, args: tuple, out, params: dict, workspace=None,
          fusion: str = "", precision: str = "", copy=None) -> tuple:
    sig = _sig(op, stage, fusion)
    x = args[sig.x]
    if x.ndim < 1 or x.shape[-1] == 0:
        raise EulerError(f"{op.name}.{stage}: row input has shape {tuple(x.shape)}; rows "
                         "need a last axis of length ≥ 1", file=op.spec, key="shape")
    shape = tuple(x.shape)
    cols, lead = shape[-1], shape[:-1]
    by_role = {"row": shape, "weight": (cols,), "index": lead, "scalar": lead}
    for n, r, a in zip(sig.names, sig.roles, args):
        if tuple(a.shape) != by_role[r]:
            raise EulerError(f"{op.name}.{stage}: {n} has shape {tuple(a.shape)}, expected "
                             f"{by_role[r]} for rows of shape {shape}", file=op.spec, key=n)
    rows = x.size // cols
    # an autocast call's kernels are of the one dtype the precision has
    dtype = None if precision else storage_dtype_name(x)
    split, layout = _layout(op, stage, dtype, rows, cols, fusion, precision)
    part = "rows" if split else ""
    kernel = row_kernel(op, stage, dtype, cols, part=part, fusion=fusion, precision=precision)
    results = outputs(kernel, sig.writes, [by_role[r] for r in sig.write_roles], out, op, stage)
    values = dict(zip(sig.names, args))
    values.update(zip(sig.writes, results))
    values.update(params)
    values["rows"], values["cols"] = rows, cols
    copies = _copies(op, kernel, sig, copy, shape)
    values.update(copies)
    rows_at = [values[n].data.ptr for n in sig.row_ptrs] + [c.data.ptr for c in copies.values()
                                                             if c is not NULL]
    # operands of two storage types split a row at other columns: every row on a boundary
    itemsize = min(values[n].itemsize for n in sig.row_ptrs)
    aligned = row_aligned(rows_at, [values[n].data.ptr for n in sig.weight_ptrs],
                          cols * itemsize, bool(sig.wgrads or precision))
    if not aligned:
        kernel = row_kernel(op, stage, dtype, cols, aligned=False, part=part, fusion=fusion,
                            precision=precision)
    if not rows:
        for g in sig.wgrads:
            values[g].fill(0)
        return results
    if workspace is not None:
        views = carve(op, workspace, layout)
    else:
        views = [cuda.own_workspace(op, n, shape) for n, shape in
                 zip((["rowstats"] if split else []) + list(sig.wgrads), layout)]
    if split:
        values["rowstats"] = views.pop(0)
    for g, view in zip(sig.wgrads, views):
        values[f"{g}_partials"] = view
    launcher = cuda.launcher(op)
    at = kernel.geometry.launch(rows, cols)
    launcher.launch(kernel, at, values)
    if split:
        cols_kernel = row_kernel(op, "backward", dtype, cols, aligned, part="cols",
                                 precision=precision)
        at = cols_kernel.geometry.launch(rows, cols)
        launcher.launch(cols_kernel, at, values)
    partials = at.partials
    for g in sig.wgrads:   # the reduce of the gradient's own dtype (autocast: float32)
        red = op.kernel("backward", storage_dtype_name(values[g]), part="reduce")
        launcher.launch(red, red.geometry.launch(cols), {
            "partials": values[f"{g}_partials"], "dw": values[g],
            "num_partials": partials, "cols": cols, "accumulate": 0})
    return results


# ---- which of a stage's kernels a call takes -----------------------------------------

def row_aligned(rows: list[int], weights: list[int], row_bytes: int, wgrads: bool) -> bool:
    """Whether the `aligned` variant of a row kernel (generator/plan.py) serves operands at
    these addresses: its row operands all at one offset from a 16-byte boundary (each row
    then splits at the same columns), and where it reads weights or sums weight gradients,
    every row on a boundary (row_bytes, a row's bytes, a multiple of 16), weights too."""
    if len({a % 16 for a in rows}) > 1:
        return False
    if weights or wgrads:
        return row_bytes % 16 == 0 and all(a % 16 == 0 for a in rows + weights)
    return True


def _copies(op: OpEntry, kernel: KernelSig, sig: RowSig, copy, shape) -> dict:
    """The bf16 copy of dx an autocast backward writes (signature.bf16_copy): `copy`, or
    NULL (not written); none for other kernels, which refuse one."""
    names = [bf16_copy(g) for g in sig.writes if bf16_copy(g) in dict(kernel.args)]
    if copy is not None and (not names or tuple(copy.shape) != shape):
        raise EulerError(f"{op.name}: copy= is the autocast backward's bf16 dx {shape}; "
                         f"{kernel.name} takes {'none' if not names else names[0]}, got "
                         f"{tuple(copy.shape)}", file=op.spec, key="copy")
    return {n: NULL if copy is None else copy for n in names}


def row_kernel(op: OpEntry, stage: str, dtype: str | None, cols: int, aligned: bool = True, *,
               part: str = "", fusion: str = "", precision: str = "") -> KernelSig:
    """The warp-per-row kernel for rows it holds in registers, else the block_held one for
    rows a block holds (where the dtype has one), else the block-per-row one (a part of one
    layout, or none, such as the split backward's cols: its kernel); of each, the `aligned`
    variant (row_aligned) or the one for any operands. The two variants launch alike: a
    memory planner may ask for either."""
    candidates = select(op.kernels.values(), stage, dtype, part=part, fusion=fusion,
                        precision=precision, aligned=aligned)
    if not candidates:   # none: raises, naming those there are
        return op.kernel(stage, dtype, part=part, fusion=fusion, precision=precision,
                         aligned=aligned)
    warp = [k for k in candidates if isinstance(k.geometry, WarpPerRow)]
    held = [k for k in candidates if isinstance(k.geometry, BlockHeld)]
    block = [k for k in candidates if isinstance(k.geometry, BlockPerRow)]
    if warp and (not block or cols <= warp[0].geometry.max_cols):
        return warp[0]
    if held and cols <= held[0].geometry.max_cols:
        return held[0]
    return (block or candidates)[0]


def wgrad_split(op: OpEntry, dtype: str | None, cols: int, fusion: str = "",
                precision: str = "") -> bool:
    """Whether a backward (of the op's `fusion` variant, in `precision`) with weight
    gradients over rows of `cols` takes the split kernels (its `rows` part, then `cols`:
    generator/plan.py WGRAD_SPLIT_COLS)."""
    rows = select(op.kernels.values(), "backward", dtype, part="rows", fusion=fusion,
                  precision=precision)
    return any(cols >= k.geometry.split_cols for k in rows)
