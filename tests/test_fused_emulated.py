"""The fused variants' kernels (generator/fuse.py), run on the CPU through the g++ emulator
of tests/test_cuda_emulated.py and checked against the generated numpy modules' fused
functions in float64, with that file's tolerances:

- a norm's `add` fusion: forward_add writes x + branch and the op of it, in place over x
  (as the decoder runs it); backward_add adds the op's dx to the stream's incoming
  gradient, in place over it (as training runs it), in every row layout and in the split
  backward of long rows, which shares the op's wgrad_cols kernel;
- a pointwise op's `bias` fusion: forward_bias and backward_bias over [rows, cols] with
  biases over rows, the 16-byte entry points and the `_unaligned` ones, rows looping over a
  grid of few row groups; the bias gradients' partial rows and the reduce that sums them."""
from __future__ import annotations

import numpy as np
import pytest

from eulergen.runtime.engine.manifest import load_numpy_module
from test_cuda_emulated import (ENTRIES, OPS, SUFFIX, TOL, _params, _row_geometry,
                                _runtime_variant, as_tuple, close, f32, geometry,
                                has_kernel, inputs_as_stored, launch, stored, value)

pytestmark = pytest.mark.slow

# The grid is cut to the distinct code paths (every op's fused kernels come from one
# template; each op more costs a g++ build): the add fusion of layernorm (two weights) in
# every row layout, of softmax (no weights) in a warp; the bias fusion of gelu (one input)
# and swiglu (gated: two inputs, two biases). tests/test_fused_runtime_emulated.py runs
# rmsnorm's and swiglu's through the runtime's calls.
ADD_OPS = ["layernorm", "softmax"]
BIAS_OPS = ["gelu", "swiglu"]
assert all(f in OPS[n].get("fusions", {}) for ops, f in ((ADD_OPS, "add"), (BIAS_OPS, "bias"))
           for n in ops)
# a warp's registers (17: scalar edges), a block re-reading its row with warps no power of
# two (1250), a bf16 block holding it (3001), a long row past a block's registers (8800)
ADD_CASES = [(17, "warp"), (1250, "block"), (3001, "held"), (8800, "block")]


def _module(name: str):
    return load_numpy_module(ENTRIES[name])


def _add_params():
    cases = {"layernorm": ADD_CASES, "softmax": ADD_CASES[:1]}
    return [pytest.param(name, cols, layout, dt, id=f"{name}-{cols}-{layout}-{dt}")
            for name in ADD_OPS for cols, layout in cases[name] for dt in ("f32", "bf16")
            if f"{name}_forward_add{SUFFIX[layout]}_{dt}" in OPS[name]["kernels"]]


@pytest.mark.parametrize("name,cols,layout,dtype", _add_params())
def test_add_fusion_writes_the_sum_and_its_norm_and_adds_into_the_stream_gradient(
        name, cols, layout, dtype):
    fusion = OPS[name]["fusions"]["add"]
    mod = _module(name)
    params = _params(name)
    rows = 3 if cols > 5000 else 11
    rng = np.random.default_rng(cols + 1)
    weights = [o["name"] for o in fusion["backward"]["inputs"] if o["role"] == "weight"]
    x, branch = inputs_as_stored([rng.uniform(-2, 2, (rows, cols)) for _ in range(2)], dtype)
    w = inputs_as_stored([rng.uniform(-2, 2, cols) for _ in weights], dtype)
    wargs = {n: stored(a, dtype) for n, a in zip(weights, w)}
    (row_in,) = [o["name"] for o in fusion["backward"]["inputs"] if o["role"] == "row"]
    (out,) = [o["name"] for o in fusion["backward"]["outputs"] if o["name"] != "_stream"]
    suffix = SUFFIX[layout]

    xs, ys = stored(x, dtype), stored(np.full((rows, cols), np.nan), dtype)
    k = _runtime_variant(f"{name}_forward_add{suffix}_{dtype}", dtype, [xs, stored(branch, dtype), ys],
                         list(wargs.values()), False)
    grid, threads, _ = _row_geometry(name, k, rows, cols)
    got = launch(name, k, grid, threads, **{row_in: xs, "_branch": stored(branch, dtype),
                                             "_stream": row_in, out: ys}, **wargs, **params,
                 rows=rows, cols=cols)
    want = as_tuple(mod.forward_add(x, branch, *w, **params))
    want32 = as_tuple(mod.forward_add(*f32([x, branch, *w]), **params))
    for n, g, ref, ref32 in zip(("_stream", out), (got["_stream"], got[out]), want, want32):
        close(value(g, dtype), ref, TOL[dtype], f"{k} {n} (in place over {row_in})", ref32)

    h = value(got["_stream"], dtype)           # the stream, as the forward stored it
    dy, dh = inputs_as_stored([rng.uniform(-1, 1, (rows, cols)) for _ in range(2)], dtype)
    k = f"{name}_backward_add{suffix}_{dtype}"
    if k not in OPS[name]["kernels"]:          # a held layout's op with weight gradients
        k = f"{name}_backward_add_block_{dtype}"
    grid, threads, partials = _row_geometry(name, k, rows, cols)
    parts = {f"d{n}_partials": np.full((partials, cols), np.nan, np.float32) for n in weights}
    args = {row_in: stored(h, dtype), f"d{out}": stored(dy, dtype), "d_stream": stored(dh, dtype)}
    k = _runtime_variant(k, dtype, list(args.values()), list(wargs.values()), bool(weights))
    got = launch(name, k, grid, threads, **args, **{f"d{row_in}": "d_stream"}, **parts, **wargs,
                 **params, rows=rows, cols=cols)
    want = dict(zip([row_in, *weights], as_tuple(mod.backward_add(h, *w, dy, dh, **params))))
    want32 = dict(zip([row_in, *weights], as_tuple(mod.backward_add(*f32([h, *w, dy, dh]),
                                                                    **params))))
    close(value(got[f"d{row_in}"], dtype), want[row_in], TOL[dtype],
          f"{k} d{row_in} (in place over d_stream)", want32[row_in])
    for n in weights:
        close(got[f"d{n}_partials"].astype(np.float64).sum(0), want[n], TOL["f32"], f"{k} d{n}",
              want32[n])


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("cols", [17, 1250])
@pytest.mark.parametrize("name", [n for n in ADD_OPS if has_kernel(n, "backward", "rows", "add")])
def test_add_fusion_split_backward_shares_the_op_s_column_kernel(name, cols, dtype):
    """backward_rows_add writes dx (added to d_stream) and the row values the op's own
    wgrad_cols reads: the weight gradients of the fused backward are the op's."""
    fusion = OPS[name]["fusions"]["add"]
    mod = _module(name)
    params = _params(name)
    rows, groups = 29, 3
    rng = np.random.default_rng(cols + 5)
    weights = [o["name"] for o in fusion["backward"]["inputs"] if o["role"] == "weight"]
    (row_in,) = [o["name"] for o in fusion["backward"]["inputs"] if o["role"] == "row"]
    (out,) = [o["name"] for o in fusion["backward"]["outputs"] if o["name"] != "_stream"]
    h, dy, dh = inputs_as_stored([rng.uniform(-2, 2, (rows, cols)) for _ in range(3)], dtype)
    w = inputs_as_stored([rng.uniform(-2, 2, cols) for _ in weights], dtype)
    wargs = {n: stored(a, dtype) for n, a in zip(weights, w)}
    args = {row_in: stored(h, dtype), f"d{out}": stored(dy, dtype), "d_stream": stored(dh, dtype)}
    want = dict(zip([row_in, *weights], as_tuple(mod.backward_add(h, *w, dy, dh, **params))))
    want32 = dict(zip([row_in, *weights], as_tuple(mod.backward_add(*f32([h, *w, dy, dh]),
                                                                    **params))))
    k = _runtime_variant(f"{name}_backward_rows_add_block_{dtype}", dtype,
                         list(args.values()), list(wargs.values()), True)
    aligned = not k.endswith(f"unaligned_{dtype}")
    cols_k = f"{name}_wgrad_cols{'' if aligned else '_unaligned'}_{dtype}"
    nstats = geometry(name, cols_k).row_stats
    grid, threads, _ = _row_geometry(name, k, rows, cols)
    got = launch(name, k, grid, threads, **args, **{f"d{row_in}": "d_stream"}, **wargs,
                 rowstats=np.full((rows, nstats), np.nan, np.float32), **params, rows=rows,
                 cols=cols)
    close(value(got[f"d{row_in}"], dtype), want[row_in], TOL[dtype], f"{k} d{row_in}",
          want32[row_in])
    by_cols = geometry(name, cols_k)
    parts = {f"d{n}_partials": np.full((groups, cols), np.nan, np.float32) for n in weights}
    got = launch(name, cols_k, (by_cols.launch(rows, cols).grid[0], groups), by_cols.threads,
                 **args, **wargs, rowstats=got["rowstats"], **parts, **params, rows=rows, cols=cols)
    for n in weights:
        close(got[f"d{n}_partials"].astype(np.float64).sum(0), want[n], TOL["f32"],
              f"{cols_k} d{n}", want32[n])


# (rows, cols): 37 columns take the `_unaligned` kernels, 1000 the 16-byte ones (several
# column blocks in fp32); 3 row groups over 29 rows take a thread through three batches of
# 4 rows, the last part-filled
BIAS_SHAPES = [(29, 37), (29, 1000)]


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("rows,cols", BIAS_SHAPES)
@pytest.mark.parametrize("name", BIAS_OPS)
def test_bias_fusion_is_the_op_of_x_plus_bias_and_sums_the_bias_gradient(name, rows, cols,
                                                                         dtype):
    fusion = OPS[name]["fusions"]["bias"]
    mod = _module(name)
    params = _params(name)
    rng = np.random.default_rng(rows * cols)
    names = [o["name"] for o in fusion["forward"]["inputs"]]
    arrays = inputs_as_stored([rng.uniform(-1, 1, cols) if o["role"] == "bias"
                               else rng.uniform(-3, 3, (rows, cols))
                               for o in fusion["forward"]["inputs"]], dtype)
    ins = {n: stored(a, dtype) for n, a in zip(names, arrays)}
    outs = [o["name"] for o in fusion["forward"]["outputs"]]
    groups = min(rows, 3)
    # the runtime's choice: 16-byte access where whole vectors make every row
    variant = "" if cols % geometry(name, f"{name}_forward_bias_{dtype}").vec == 0 else "_unaligned"
    k = f"{name}_forward_bias{variant}_{dtype}"
    g = geometry(name, k)
    grid = (g.launch(rows, cols).grid[0], groups)
    got = launch(name, k, grid, g.threads, **ins,
                 **{o: stored(np.full((rows, cols), np.nan), dtype) for o in outs}, **params,
                 rows=rows, cols=cols)
    for o, ref, ref32 in zip(outs, as_tuple(mod.forward_bias(*arrays, **params)),
                             as_tuple(mod.forward_bias(*f32(arrays), **params))):
        close(value(got[o], dtype), ref, TOL[dtype], f"{k} {o}", ref32)

    douts = inputs_as_stored([rng.uniform(-1, 1, (rows, cols)) for _ in outs], dtype)
    dargs = {f"d{o}": stored(d, dtype) for o, d in zip(outs, douts)}
    grads = [f"d{o['name']}" for o in fusion["backward"]["inputs"] if o["differentiable"]]
    row_grads = [d for d in grads if not d.startswith("d_bias_")]
    k = f"{name}_backward_bias{variant}_{dtype}"
    # the first input's gradient in place over the first output's (an elementwise kernel)
    bufs = {row_grads[0]: f"d{outs[0]}"}
    bufs |= {d: stored(np.full((rows, cols), np.nan), dtype) for d in row_grads[1:]}
    bufs |= {f"{d}_partials": np.full((groups, cols), np.nan, np.float32)
             for d in grads if d not in row_grads}
    got = launch(name, k, grid, geometry(name, k).threads, **ins, **dargs, **bufs, **params,
                 rows=rows, cols=cols)
    want = as_tuple(mod.backward_bias(*arrays, *douts, **params))
    want32 = as_tuple(mod.backward_bias(*f32(arrays), *f32(douts), **params))
    for d, ref, ref32 in zip(grads, want, want32):
        if d in row_grads:
            close(value(got[d], dtype), ref, TOL[dtype], f"{k} {d}", ref32)
        else:
            close(got[f"{d}_partials"].astype(np.float64).sum(0), ref, TOL["f32"], f"{k} {d}",
                  ref32)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("name", BIAS_OPS[:1])
def test_bias_reduce_sums_partial_rows_in_order_and_may_accumulate(name, dtype):
    k = f"{name}_reduce_bias_{dtype}"
    partials, cols = 300, 20
    rng = np.random.default_rng(6)
    ws = rng.uniform(-1, 1, (partials, cols)).astype(np.float32)
    base = inputs_as_stored([rng.uniform(-1, 1, cols)], dtype)[0]
    for accumulate in (0, 1):
        at = geometry(name, k).launch(cols)
        got = launch(name, k, at.grid, at.block, partials=ws, dw=stored(base, dtype),
                     num_partials=partials, cols=cols, accumulate=accumulate)
        want = ws.astype(np.float64).sum(0) + (base if accumulate else 0)
        close(value(got["dw"], dtype), want, TOL[dtype], f"{k} accumulate={accumulate}")
