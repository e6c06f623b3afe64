"""The autocast row kernels (generator/plan_row.py: a norm-shaped op's kernels again, each
pointer of its own storage type: the stream, its gradient and the weights float32, the
branch, the outputs and their gradients bf16, and the backward's bf16 copy of dx), run on
the CPU through the g++ emulator of tests/test_cuda_emulated.py and checked against the
generated numpy modules in float64 on the values as stored, with that file's tolerances
(each output's its own dtype's): the op's forward and backward, the add fusion's, in every
row layout, and the split backward of long rows with its own column kernel. The bf16 copy
is dx as written, rounded once; a null copy is not written."""
from __future__ import annotations

import numpy as np
import pytest

from eulergen.runtime.engine.bf16 import to_bf16
from eulergen.runtime.engine.kinds.row import row_aligned
from eulergen.runtime.engine.manifest import load_numpy_module
from test_cuda_emulated import (ENTRIES, OPS, SUFFIX, TOL, _params, _row_geometry, as_tuple,
                                close, f32, geometry, launch, stored, value)

pytestmark = pytest.mark.slow

# layernorm: two weights; rmsnorm: one (its held forward); softmax: none, and an online sum
# in the block layout's impl
NORMS = ["layernorm", "rmsnorm", "softmax"]
# a warp's row off 16-byte boundaries (17: the scalar path) and on them (768); a block's
# (1250: warps no power of two; 8800: past its registers, whole 16-byte groups); a held one
CASES = [(17, "warp"), (768, "warp"), (1250, "block"), (3001, "held"), (8800, "block")]
WIDE, NARROW = "f32", "bf16"


def _module(name: str):
    return load_numpy_module(ENTRIES[name])


def _as_stored(rng, shape, dtype: str) -> np.ndarray:
    """float64 values the dtype holds exactly."""
    return value(stored(rng.uniform(-2, 2, shape), dtype), dtype)


def _kernel(name: str, stage: str, layout: str, rows: list, weights: list) -> str:
    """The entry point the runtime takes for these arrays: operands of two storage types
    take 16-byte access where every row of each is on a boundary (row_aligned's test with
    bf16's row bytes), else `_unaligned`."""
    k = f"{name}_{stage}_autocast{SUFFIX[layout]}_bf16"
    if k not in OPS[name]["kernels"]:   # a held layout's stage with weight gradients
        k = f"{name}_{stage}_autocast_block_bf16"
    aligned = row_aligned([a.ctypes.data for a in rows], [a.ctypes.data for a in weights],
                          rows[0].shape[-1] * 2, True)
    return k if aligned else f"{k[:-len('_bf16')]}_unaligned_bf16"


def _names(name: str):
    fusion = OPS[name]["fusions"]["add"]
    weights = [o["name"] for o in fusion["backward"]["inputs"] if o["role"] == "weight"]
    (x,) = [o["name"] for o in fusion["backward"]["inputs"] if o["role"] == "row"]
    (y,) = [o["name"] for o in fusion["backward"]["outputs"] if o["name"] != "_stream"]
    return x, y, weights


def _backward_case(name: str, rows: int, cols: int, seed: int):
    """A backward's float64 inputs as stored (h and d_stream float32, dy bf16, the weights
    float32), its stored arguments by name (the weights apart) and a NaN-filled copy."""
    x, y, weights = _names(name)
    rng = np.random.default_rng(seed)
    h, dh = _as_stored(rng, (rows, cols), WIDE), _as_stored(rng, (rows, cols), WIDE)
    dy = _as_stored(rng, (rows, cols), NARROW)
    w = [_as_stored(rng, cols, WIDE) for _ in weights]
    args = {x: stored(h, WIDE), f"d{y}": stored(dy, NARROW)}
    blank = {f"d{x}_bf16": stored(np.full((rows, cols), np.nan), NARROW)}
    return h, dh, dy, w, {n: stored(a, WIDE) for n, a in zip(weights, w)}, args, blank


def _cases():
    return [pytest.param(name, cols, layout, id=f"{name}-{cols}-{layout}")
            for name in NORMS for cols, layout in CASES
            if f"{name}_forward_autocast{SUFFIX[layout]}_bf16" in OPS[name]["kernels"]]


@pytest.mark.parametrize("name,cols,layout", _cases())
def test_autocast_forward_reads_a_float32_stream_and_writes_the_sum_in_float32(name, cols,
                                                                               layout):
    """The op's forward (the stem's norm: the embedding's float32 output) and the add
    fusion's (the sum of the float32 stream and a bf16 branch, kept in float32, in place
    over the stream), the normed row in bf16."""
    mod, params = _module(name), _params(name)
    x_name, y_name, weights = _names(name)
    rows = 3 if cols > 5000 else 11
    rng = np.random.default_rng(cols)
    x, branch = _as_stored(rng, (rows, cols), WIDE), _as_stored(rng, (rows, cols), NARROW)
    w = [_as_stored(rng, cols, WIDE) for _ in weights]
    wargs = {n: stored(a, WIDE) for n, a in zip(weights, w)}
    xs, ys = stored(x, WIDE), stored(np.full((rows, cols), np.nan), NARROW)

    k = _kernel(name, "forward", layout, [xs, ys], list(wargs.values()))
    grid, threads, _ = _row_geometry(name, k, rows, cols)
    got = launch(name, k, grid, threads, **{x_name: xs, y_name: ys}, **wargs, **params,
                 rows=rows, cols=cols)
    close(value(got[y_name], NARROW), mod.forward(x, *w, **params), TOL[NARROW], f"{k} {y_name}",
          mod.forward(*f32([x, *w]), **params))

    bs = stored(branch, NARROW)
    k = _kernel(name, "forward_add", layout, [xs, bs, ys], list(wargs.values()))
    grid, threads, _ = _row_geometry(name, k, rows, cols)
    got = launch(name, k, grid, threads, **{x_name: xs, "_branch": bs, "_stream": x_name,
                                             y_name: ys}, **wargs, **params, rows=rows, cols=cols)
    want = as_tuple(mod.forward_add(x, branch, *w, **params))
    want32 = as_tuple(mod.forward_add(*f32([x, branch, *w]), **params))
    close(value(got["_stream"], WIDE), want[0], TOL[WIDE], f"{k} _stream (in place)", want32[0])
    close(value(got[y_name], NARROW), want[1], TOL[NARROW], f"{k} {y_name}", want32[1])


@pytest.mark.parametrize("name,cols,layout", _cases())
def test_autocast_backward_writes_dx_in_float32_and_its_bf16_copy(name, cols, layout):
    """The op's backward (dx written: the stream gradient's first writer) and the add
    fusion's (dx added into the float32 d_stream, in place), from bf16 dy; the weights'
    partial sums; the copy is dx as written, rounded once, and a null copy is skipped."""
    mod, params = _module(name), _params(name)
    x_name, _, weights = _names(name)
    rows = 3 if cols > 5000 else 11
    h, dh, dy, w, wargs, args, blank = _backward_case(name, rows, cols, cols + 7)
    dx, copy = f"d{x_name}", f"d{x_name}_bf16"

    for stage, extra in (("backward", {}), ("backward_add", {"d_stream": dh})):
        arrays = {**args, **{n: stored(a, WIDE) for n, a in extra.items()}}
        k = _kernel(name, stage, layout, list(arrays.values()) + list(blank.values()),
                    list(wargs.values()))
        grid, threads, partials = _row_geometry(name, k, rows, cols)
        parts = {f"d{n}_partials": np.full((partials, cols), np.nan, np.float32)
                 for n in weights}
        into = {dx: "d_stream"} if extra else {dx: stored(np.full((rows, cols), np.nan), WIDE)}
        got = launch(name, k, grid, threads, **arrays, **into, **blank, **parts, **wargs,
                     **params, rows=rows, cols=cols)
        ins = [h, *w, dy, *extra.values()]
        want = dict(zip([x_name, *weights], as_tuple(getattr(mod, stage)(*ins, **params))))
        want32 = dict(zip([x_name, *weights],
                          as_tuple(getattr(mod, stage)(*f32(ins), **params))))
        close(value(got[dx], WIDE), want[x_name], TOL[WIDE], f"{k} {dx}", want32[x_name])
        np.testing.assert_array_equal(got[copy], to_bf16(got[dx]), err_msg=f"{k} {copy}")
        for n in weights:
            close(got[f"d{n}_partials"].astype(np.float64).sum(0), want[n], TOL[WIDE],
                  f"{k} d{n}", want32[n])
        again = launch(name, k, grid, threads, **arrays, **into, **{copy: None}, **parts,
                       **wargs, **params, rows=rows, cols=cols)
        np.testing.assert_array_equal(again[dx], got[dx], err_msg=f"{k}: a null copy")


@pytest.mark.parametrize("cols", [17, 1000])
@pytest.mark.parametrize("name", ["layernorm", "rmsnorm"])
def test_autocast_split_backward_takes_its_own_column_kernel(name, cols):
    """backward_rows_add writes dx (added to the float32 d_stream) and its copy, and the
    row values the autocast wgrad_cols reads with the float32 rows and weights."""
    mod, params = _module(name), _params(name)
    x_name, _, weights = _names(name)
    rows, groups = 29, 3
    h, dh, dy, w, wargs, args, blank = _backward_case(name, rows, cols, cols + 5)
    args["d_stream"] = stored(dh, WIDE)
    dx, copy = f"d{x_name}", f"d{x_name}_bf16"
    want = dict(zip([x_name, *weights], as_tuple(mod.backward_add(h, *w, dy, dh, **params))))
    want32 = dict(zip([x_name, *weights], as_tuple(mod.backward_add(*f32([h, *w, dy, dh]),
                                                                    **params))))
    k = _kernel(name, "backward_rows_add", "block", list(args.values()) + list(blank.values()),
                list(wargs.values()))
    aligned = "_unaligned_" not in k
    cols_k = f"{name}_wgrad_cols_autocast{'' if aligned else '_unaligned'}_bf16"
    nstats = geometry(name, cols_k).row_stats
    grid, threads, _ = _row_geometry(name, k, rows, cols)
    got = launch(name, k, grid, threads, **args, **{dx: "d_stream"}, **blank, **wargs,
                 rowstats=np.full((rows, nstats), np.nan, np.float32), **params, rows=rows,
                 cols=cols)
    close(value(got[dx], WIDE), want[x_name], TOL[WIDE], f"{k} {dx}", want32[x_name])
    np.testing.assert_array_equal(got[copy], to_bf16(got[dx]), err_msg=f"{k} {copy}")
    by_cols = geometry(name, cols_k)
    parts = {f"d{n}_partials": np.full((groups, cols), np.nan, np.float32) for n in weights}
    got = launch(name, cols_k, (by_cols.launch(rows, cols).grid[0], groups), by_cols.threads,
                 **args, **wargs, rowstats=got["rowstats"], **parts, **params, rows=rows,
                 cols=cols)
    for n in weights:
        close(got[f"d{n}_partials"].astype(np.float64).sum(0), want[n], TOL[WIDE],
              f"{cols_k} d{n}", want32[n])
