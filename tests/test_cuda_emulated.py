"""The generated pointwise, row, pair, update and embedding kernels, run on the CPU: each
.cu in generated/cuda is compiled by g++ against tests/cudagen_emulator (CUDA threads as
fibers, warp shuffles and __syncthreads as barriers), launched with the block its manifest
geometry gives (eulergen/launch.py), and checked against the generated numpy module evaluated in
float64 on the same inputs. Small grids make every grid-stride loop, both row layouts, the
registers-then-global row split and the scalar tails run. Speed and the real PTX are for
tests/gpu/.

Tolerances: fp32 outputs within 1e-5 of the largest reference value (∞-norm relative);
bf16 outputs within 2^-8 of it (one rounding of the fp32 result to bf16). Where an output
is a difference of nearly equal terms (a norm's gradient over rows of length 1 is 0,
computed as a - a), the same formula in float32 numpy is as far off, so the error may
also reach 16x that float32 error (as tests/gpu/test_kernels.py allows)."""
from __future__ import annotations

import functools
import json
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from eulergen import GENERATED_DIR
from eulergen import launch as geometry_of
from eulergen.runtime.engine.kinds.row import row_aligned
from eulergen.runtime.engine.manifest import load_manifest, load_numpy_module
from eulergen.runtime.engine.bf16 import from_bf16, to_bf16

from masked_logits import masked_rows

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")]

MANIFEST = GENERATED_DIR / "manifest.json"
OPS = json.loads(MANIFEST.read_text())["ops"] if MANIFEST.exists() else {}
# the same ops as the runtime reads them (a frozen value, read once: 50 ms a read)
ENTRIES = load_manifest(MANIFEST).ops if MANIFEST.exists() else {}
EMULATOR = Path(__file__).resolve().parent / "cudagen_emulator"
_FOLDER = Path(tempfile.mkdtemp(prefix="eg-cudagen-emu-"))
TOL = {"f32": 1e-5, "bf16": 2.0 ** -8}
_ELEM = {"float": ("float", np.float32), "__nv_bfloat16": ("__nv_bfloat16", np.uint16),
         "int": ("int", np.int32), "long long": ("long long", np.int64)}
_SCALAR = {"float": "(float)std::atof", "int": "std::atoi", "long long": "std::atoll"}


def geometry(op: str, kernel: str):
    """A kernel's launch geometry, as the runtime reads it from the manifest."""
    return geometry_of.from_json(OPS[op]["kernels"][kernel]["geometry"])


def _ops(*kinds) -> list[str]:
    return sorted(n for n, o in OPS.items() if o["kind"] in kinds)


def has_kernel(op: str, stage: str, part: str = "", fusion: str = "") -> bool:
    """Whether an op has a kernel of that stage, part and fusion (the manifest's JSON)."""
    return any((k["stage"], k.get("part", ""), k.get("fusion", "")) == (stage, part, fusion)
               for k in OPS[op]["kernels"].values())


_RUNNER = """\
#include "{op}.cu"
#include <string>

static char** args;
static void* p[{slots}];  // the pointer arguments, by their place in argv
static std::vector<std::string> paths;
static std::vector<std::vector<char>> buffers;

// The buffer of a file argument, read once: arguments naming one file share it.
static void* buffer(const char* path) {{
  if (std::string(path) == "-") return nullptr;
  for (size_t i = 0; i < paths.size(); ++i)
    if (paths[i] == path) return buffers[i].data();
  FILE* f = std::fopen(path, "rb");
  std::fseek(f, 0, SEEK_END);
  std::vector<char> v(std::ftell(f));
  std::fseek(f, 0, SEEK_SET);
  if (std::fread(v.data(), 1, v.size(), f) != v.size()) std::exit(2);
  std::fclose(f);
  paths.push_back(path);
  buffers.push_back(std::move(v));
  return buffers.back().data();
}}

static void save(const char* path) {{
  for (size_t i = 0; i < paths.size(); ++i)
    if (paths[i] == path) {{
      FILE* f = std::fopen(path, "wb");
      std::fwrite(buffers[i].data(), 1, buffers[i].size(), f);
      std::fclose(f);
    }}
}}

{calls}

int main(int argc, char** argv) {{
  const std::string kernel = argv[1];
  args = argv;
  const dim3 grid(std::atoi(argv[2]), std::atoi(argv[3])), block(std::atoi(argv[4]), std::atoi(argv[5]));
{cases}
  return 3;
}}
"""


def _runner(op: str) -> str:
    """C++ main: `run KERNEL GX GY BX BY ARGS…`; a pointer argument is a file (or '-' for
    null) read before and, when not const, written back after the launch. Pointer arguments
    naming the same file share one buffer (an output aliasing an input: in place). Each
    kernel is launched through a plain function of its own (`call_<kernel>`, reading its
    arguments from `p` and `args`): one lambda a kernel, each its own std::function, took
    half of the build."""
    calls, cases = [], []
    for name, k in OPS[op]["kernels"].items():
        reads, values, saves = [], [], []
        for n, (_, ctype) in enumerate(k["args"], start=6):
            if ctype.endswith("*"):
                reads.append(f"p[{n}] = buffer(argv[{n}]);")
                values.append(f"({ctype})p[{n}]")
                if not ctype.startswith("const"):
                    saves.append(f"save(argv[{n}]);")
            else:
                values.append(f"{_SCALAR[ctype]}(args[{n}])")
        calls.append(f"static void call_{name}() {{ {name}({', '.join(values)}); }}")
        cases.append(f'  if (kernel == "{name}") {{\n    {" ".join(reads)}\n'
                     f"    emu_launch_2d(grid, block, call_{name});\n"
                     f"    {' '.join(saves)}\n    return 0;\n  }}")
    slots = 6 + max(len(k["args"]) for k in OPS[op]["kernels"].values())
    return _RUNNER.format(op=op, slots=slots, calls="\n".join(calls), cases="\n".join(cases))


@functools.lru_cache(maxsize=None)
def _binary(op: str) -> Path:
    """The op's runner, built at -O0: a third of -O1's build time, and the launches, small
    grids, run about as fast (the same bits out)."""
    folder = _FOLDER / op
    folder.mkdir(parents=True, exist_ok=True)
    for f in ("eulergen_common.cuh", f"{op}.cu"):
        shutil.copy(GENERATED_DIR / "cuda" / f, folder / f)
    (folder / "run.cpp").write_text(_runner(op))
    done = subprocess.run(["g++", "-std=c++17", "-O0", f"-I{EMULATOR}", "-o", "run", "run.cpp"],
                          cwd=folder, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[:4000]
    return folder / "run"


def launch(op: str, kernel: str, grid, block, **args) -> dict[str, np.ndarray]:
    """Run one kernel; arrays go in by argument name and the written ones come back. A
    pointer argument given as another's name (`y="x"`) is that argument's buffer."""
    sig = OPS[op]["kernels"][kernel]["args"]
    work = Path(tempfile.mkdtemp(dir=_FOLDER))
    argv, outs, paths = [], {}, {}
    for name, ctype in sig:
        value = args[name]
        if ctype.endswith("*"):
            if value is None:
                argv.append("-")
                continue
            if isinstance(value, str):
                paths[name] = paths[value]
            else:
                elem = _ELEM[ctype.replace("const ", "").rstrip("*").strip()][1]
                paths[name] = (work / f"{name}.bin", elem, np.shape(value))
                np.ascontiguousarray(value, elem).tofile(paths[name][0])
            argv.append(str(paths[name][0]))
            if not ctype.startswith("const"):
                outs[name] = paths[name]
        else:
            argv.append(repr(value))
    gx, gy = ((*grid, 1) if isinstance(grid, tuple) else (grid, 1))[:2]
    bx, by = ((*block, 1) if isinstance(block, tuple) else (block, 1))[:2]
    done = subprocess.run([str(_binary(op)), kernel, str(gx), str(gy), str(bx), str(by), *argv],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (f"{kernel}: exit {done.returncode}\n{done.stdout[-2000:]}"
                                  f"{done.stderr[:2000]}")
    return {n: np.fromfile(p, e).reshape(s) for n, (p, e, s) in outs.items()}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def stored(x: np.ndarray, dtype: str) -> np.ndarray:
    """x as the kernel stores it (bf16 bits or float32)."""
    return to_bf16(x.astype(np.float32)) if dtype == "bf16" else x.astype(np.float32)


def value(a: np.ndarray, dtype: str) -> np.ndarray:
    return from_bf16(a).astype(np.float64) if dtype == "bf16" else a.astype(np.float64)


def inputs_as_stored(arrays: list[np.ndarray], dtype: str) -> list[np.ndarray]:
    """Inputs rounded to the storage dtype, so the float64 reference sees what the kernel reads."""
    return [value(stored(a, dtype), dtype) if a.dtype.kind == "f" else a for a in arrays]


def close(got: np.ndarray, want: np.ndarray, tol: float, what: str, want32=None) -> None:
    want = np.broadcast_to(np.asarray(want, np.float64), got.shape)
    assert np.isfinite(got).all(), f"{what}: non-finite output"
    scale = max(float(np.max(np.abs(want))), 1e-30)
    err = float(np.max(np.abs(got - want)))
    noise = 0.0 if want32 is None else 16 * float(np.max(np.abs(np.broadcast_to(want32, got.shape) - want)))
    assert err <= max(tol * scale, noise), \
        f"{what}: error {err / scale:.2e} of max |ref| {scale:.3g} (tol {tol:.1e}, f32 noise {noise:.1e})"


def f32(arrays: list) -> list:
    return [a.astype(np.float32) if a.dtype.kind == "f" else a for a in arrays]


def as_tuple(r) -> tuple:
    return r if isinstance(r, tuple) else (r,)


def _params(op: str) -> dict:
    return {k: v for k, v in OPS[op]["params"].items() if v is not None}


# ---- pointwise --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("name", _ops("pointwise"))
def test_pointwise_forward_and_backward_match_numpy(name, dtype):
    op = OPS[name]
    mod = load_numpy_module(ENTRIES[name])
    n = 5003                       # not a multiple of any vector width: the scalar tail runs
    rng = np.random.default_rng(1)
    xs = inputs_as_stored([rng.uniform(-4, 4, n) for _ in op["inputs"]], dtype)
    ins = {o["name"]: stored(x, dtype) for o, x in zip(op["inputs"], xs)}
    threads = {stage: geometry(name, f"{name}_{stage}_{dtype}").threads
               for stage in ("forward", "backward")}
    outs = {o["name"]: stored(np.full(n, np.nan), dtype) for o in op["outputs"]}
    got = launch(name, f"{name}_forward_{dtype}", 2, threads["forward"], **ins, **outs, n=n)
    for o, w, w32 in zip(op["outputs"], as_tuple(mod.forward(*xs)), as_tuple(mod.forward(*f32(xs)))):
        close(value(got[o["name"]], dtype), w, TOL[dtype], f"{name} {o['name']}", w32)

    dys = inputs_as_stored([rng.uniform(-1, 1, n) for _ in op["outputs"]], dtype)
    grads = [o["name"] for o in op["inputs"] if o["differentiable"]]
    bwd = {f"d{o['name']}": stored(d, dtype) for o, d in zip(op["outputs"], dys)}
    bwd |= {f"d{g}": stored(np.full(n, np.nan), dtype) for g in grads}
    got = launch(name, f"{name}_backward_{dtype}", 3, threads["backward"], **ins, **bwd, n=n)
    want32 = as_tuple(mod.backward(*f32(xs), *f32(dys)))
    for g, w, w32 in zip(grads, as_tuple(mod.backward(*xs, *dys)), want32):
        close(value(got[f"d{g}"], dtype), w, TOL[dtype], f"{name} d{g}", w32)


# ---- row --------------------------------------------------------------------------------

def _row_geometry(op: str, kernel: str, rows: int, cols: int) -> tuple[int, int, int]:
    """(grid, threads, partials): the runtime's block (the geometry's launch), the grid kept
    small so that workers loop over rows."""
    g = geometry(op, kernel)
    (threads,) = g.launch(rows, cols).block
    if not isinstance(g, geometry_of.WarpPerRow):
        grid = min(rows, 2)
        return grid, threads, grid
    return 1, threads, g.rows_per_block


def _runtime_variant(kernel: str, dtype: str, rows: list, weights: list, wgrads: bool) -> str:
    """The variant of a row kernel the runtime launches for these arrays (row_aligned): the
    one compiled for 16-byte access throughout, else `_unaligned`. The cases' row lengths
    take both."""
    if row_aligned([a.ctypes.data for a in rows], [a.ctypes.data for a in weights],
                   rows[0].shape[-1] * rows[0].itemsize, wgrads):
        return kernel
    return f"{kernel[:-len(dtype)]}unaligned_{dtype}"


# 1250 and 8800 columns launch every block kernel with a warp count that is no power of two
# (5 warps at 8 columns a thread; 7 or 14 at fp32's 40 or 20): the block's merge is a
# butterfly over a lane per warp, the lanes past the last warp holding the identity. 50257
# columns is the one case past the cached groups of a full block in both dtypes (8192 bf16
# columns, 40960 fp32): whole re-read groups, then a last one that ends in the body.
ROW_CASES = [(1, "warp"), (17, "warp"), (768, "warp"), (3001, "warp"),
             (17, "block"), (1000, "block"), (1250, "block"), (8800, "block"), (50257, "block"),
             (17, "held"), (1250, "held"), (3001, "held"), (8800, "held")]
# The entry points' suffixes by layout (warp_per_row, block_per_row, block_held).
SUFFIX = {"warp": "", "block": "_block", "held": "_held"}


def layout_params(name: str, cases, dtypes=("f32", "bf16")) -> list:
    """(name, cols, layout, dtype) for each case whose forward kernel the op has: block_held
    ones only in the dtypes generator/plan.py HELD_SLOTS gives them (bf16)."""
    kernels = OPS[name]["kernels"]
    return [pytest.param(name, cols, layout, dt, id=f"{name}-{cols}-{layout}-{dt}")
            for cols, layout in cases for dt in dtypes
            if f"{name}_forward{SUFFIX[layout]}_{dt}" in kernels]
# The split backward's kernels (test_split_backward_rows_then_columns_match_numpy): 17 and
# 1250 columns are no multiple of the vector; 2500 launch 5 warps of 16 columns a thread.
SPLIT_CASES = [17, 1000, 1250, 2500]


def powers_of_two_only(op: str, cols_list) -> dict[str, list[int]]:
    """The block kernels of `op` that launch only blocks of 2^k warps over these row lengths
    (kernel -> its warp counts)."""
    out = {}
    for k in OPS[op]["kernels"]:
        g = geometry(op, k)
        if isinstance(g, (geometry_of.BlockPerRow, geometry_of.BlockHeld)):
            warps = [g.launch(1, cols).block[0] // 32 for cols in cols_list]
            if all(w & (w - 1) == 0 for w in warps):
                out[k] = warps
    return out


@pytest.mark.parametrize("name,cols,layout,dtype",
                         [p for n in _ops("row") for p in layout_params(n, ROW_CASES)])
def test_row_kernels_match_numpy(name, cols, layout, dtype):
    op = OPS[name]
    entry = ENTRIES[name]
    mod = load_numpy_module(entry)
    rows = 3 if cols > 5000 else 11
    rng = np.random.default_rng(cols)
    xs = []
    for o in op["inputs"]:
        if o["role"] == "index":
            xs.append(rng.integers(0, cols, rows).astype(np.int32))
        else:
            xs.append(rng.uniform(-2, 2, (cols,) if o["role"] == "weight" else (rows, cols)))
    xs = inputs_as_stored(xs, dtype)
    ins = {o["name"]: (x if o["role"] == "index" else stored(x, dtype))
           for o, x in zip(op["inputs"], xs)}
    params = _params(name)
    suffix = SUFFIX[layout]
    scalar_out = {o["name"] for o in op["outputs"] if o["role"] == "scalar"}

    def out_buf(o, shape):
        return np.full(shape, np.nan, np.float32) if o in scalar_out else stored(np.full(shape, np.nan), dtype)

    outs = {o["name"]: out_buf(o["name"], (rows,) if o["role"] == "scalar" else (rows, cols))
            for o in op["outputs"]}
    row_ins = [ins[o["name"]] for o in op["inputs"] if o["role"] == "row"]
    weight_ins = [ins[o["name"]] for o in op["inputs"] if o["role"] == "weight"]
    k = _runtime_variant(f"{name}_forward{suffix}_{dtype}", dtype,
                         row_ins + [outs[o] for o in outs if o not in scalar_out], weight_ins, False)
    grid, threads, partials = _row_geometry(name, k, rows, cols)
    got = launch(name, k, grid, threads, **ins, **outs, **params, rows=rows, cols=cols)
    want = as_tuple(mod.forward(*xs, **params))
    want32 = as_tuple(mod.forward(*f32(xs), **params))
    for o, w, w32 in zip(op["outputs"], want, want32):
        g = got[o["name"]]
        close(g.astype(np.float64) if o["name"] in scalar_out else value(g, dtype), w,
              TOL["f32"] if o["name"] in scalar_out else TOL[dtype], f"{k} {o['name']}", w32)

    douts = [rng.uniform(-1, 1, (rows,) if o["role"] == "scalar" else (rows, cols))
             for o in op["outputs"]]
    douts = [d.astype(np.float32).astype(np.float64) if o["name"] in scalar_out
             else inputs_as_stored([d], dtype)[0] for o, d in zip(op["outputs"], douts)]
    dargs = {f"d{o['name']}": (d.astype(np.float32) if o["name"] in scalar_out else stored(d, dtype))
             for o, d in zip(op["outputs"], douts)}
    want = dict(zip(entry.grads, as_tuple(mod.backward(*xs, *douts, **params))))
    want32 = dict(zip(entry.grads, as_tuple(mod.backward(*f32(xs), *f32(douts), **params))))
    weights = {o["name"] for o in op["inputs"] if o["role"] == "weight"}
    stages = ["backward"] + (["fwdbwd"] if f"{name}_fwdbwd_{dtype}" in op["kernels"] else [])
    for stage in stages:
        k = f"{name}_{stage}{suffix}_{dtype}"
        if k not in op["kernels"]:   # a held layout's op with weight gradients: the block's
            k = f"{name}_{stage}_block_{dtype}"
        grid, threads, partials = _row_geometry(name, k, rows, cols)
        bufs = {}
        for g in entry.grads:
            if g in weights:
                bufs[f"d{g}_partials"] = np.full((partials, cols), np.nan, np.float32)
            else:
                bufs[f"d{g}"] = stored(np.full((rows, cols), np.nan), dtype)
        wgrads = any(n.endswith("_partials") for n in bufs)
        k = _runtime_variant(k, dtype, row_ins + [d for d in dargs.values() if d.ndim == 2]
                             + [b for n, b in bufs.items() if not n.endswith("_partials")],
                             weight_ins, wgrads)
        if stage == "fwdbwd":
            bufs |= {o: np.full(rows, np.nan, np.float32) for o in scalar_out}
        got = launch(name, k, grid, threads, **ins, **dargs, **bufs, **params, rows=rows, cols=cols)
        for g, w in want.items():
            if g in weights:  # summed here; the reduce kernel has its own test below
                close(got[f"d{g}_partials"].astype(np.float64).sum(0), w, TOL["f32"],
                      f"{k} d{g}", want32[g])
            else:
                close(value(got[f"d{g}"], dtype), w, TOL[dtype], f"{k} d{g}", want32[g])
        if stage == "fwdbwd":
            for o in scalar_out:
                close(got[o].astype(np.float64), mod.forward(*xs, **params), TOL["f32"], f"{k} {o}")


@pytest.mark.parametrize("name", _ops("row"))
def test_row_cases_launch_every_block_kernel_with_warps_no_power_of_two(name):
    """The split backward's rows kernels by SPLIT_CASES, the others by ROW_CASES."""
    split = {k for k, v in OPS[name]["kernels"].items()
             if (v["stage"], v.get("part"), v.get("fusion")) == ("backward", "rows", None)}
    row = powers_of_two_only(name, [c for c, layout in ROW_CASES if layout != "warp"])
    assert not set(row) - split and not set(powers_of_two_only(name, SPLIT_CASES)) & split


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("name", [n for n in _ops("row") if has_kernel(n, "backward", "reduce")])
def test_weight_gradient_reduce_sums_partials_and_may_accumulate(name, dtype):
    k = f"{name}_wgrad_reduce_{dtype}"
    reduce = geometry(name, k)
    partials, cols = 300, 20              # 3 blocks of columns, uneven partial groups
    rng = np.random.default_rng(4)
    ws = rng.uniform(-1, 1, (partials, cols)).astype(np.float32)
    base = inputs_as_stored([rng.uniform(-1, 1, cols)], dtype)[0]
    for accumulate in (0, 1):
        at = reduce.launch(cols)
        got = launch(name, k, at.grid, at.block, partials=ws, dw=stored(base, dtype), num_partials=partials, cols=cols,
                     accumulate=accumulate)
        want = ws.astype(np.float64).sum(0) + (base if accumulate else 0)
        close(value(got["dw"], dtype), want, TOL[dtype], f"{k} accumulate={accumulate}")


def _split_ops() -> list[str]:
    return [n for n in _ops("row") if has_kernel(n, "backward", "cols")]


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("cols", SPLIT_CASES)
@pytest.mark.parametrize("name", _split_ops())
def test_split_backward_rows_then_columns_match_numpy(name, cols, dtype):
    """The split backward of long rows (plan.WGRAD_SPLIT_COLS): backward_rows writes the
    input grads and the per-row values, wgrad_cols sums the weight terms by columns. 29 rows
    over 3 partial rows take three batches of 4 rows each, the last part-filled; 17 and 1250 columns, no multiple of
    the vector, the `_unaligned` kernels and a part-filled last vector; 1250 bf16 columns, a
    second block of columns."""
    op = OPS[name]
    entry = ENTRIES[name]
    mod = load_numpy_module(entry)
    rows, groups = 29, 3
    rng = np.random.default_rng(cols + 7)
    xs = inputs_as_stored([rng.uniform(-2, 2, (cols,) if o["role"] == "weight" else (rows, cols))
                           for o in op["inputs"]], dtype)
    ins = {o["name"]: stored(x, dtype) for o, x in zip(op["inputs"], xs)}
    douts = inputs_as_stored([rng.uniform(-1, 1, (rows, cols)) for _ in op["outputs"]], dtype)
    dargs = {f"d{o['name']}": stored(d, dtype) for o, d in zip(op["outputs"], douts)}
    params = _params(name)
    want = dict(zip(entry.grads, as_tuple(mod.backward(*xs, *douts, **params))))
    want32 = dict(zip(entry.grads, as_tuple(mod.backward(*f32(xs), *f32(douts), **params))))
    weights = {o["name"] for o in op["inputs"] if o["role"] == "weight"}
    row_grads = [g for g in entry.grads if g not in weights]
    weight_ins = [ins[o["name"]] for o in op["inputs"] if o["role"] == "weight"]
    dx = {f"d{g}": stored(np.full((rows, cols), np.nan), dtype) for g in row_grads}
    k = _runtime_variant(f"{name}_backward_rows_block_{dtype}", dtype,
                         [ins[o["name"]] for o in op["inputs"] if o["role"] == "row"]
                         + list(dargs.values()) + list(dx.values()), weight_ins, True)
    aligned = not k.endswith(f"unaligned_{dtype}")
    cols_k = f"{name}_wgrad_cols{'' if aligned else '_unaligned'}_{dtype}"
    nstats = geometry(name, cols_k).row_stats
    grid, threads, _ = _row_geometry(name, k, rows, cols)
    got = launch(name, k, grid, threads, **ins, **dargs, **dx,
                 rowstats=np.full((rows, nstats), np.nan, np.float32), **params, rows=rows, cols=cols)
    for g in row_grads:
        close(value(got[f"d{g}"], dtype), want[g], TOL[dtype], f"{k} d{g}", want32[g])
    stats = got["rowstats"]
    assert np.isfinite(stats).all(), f"{k}: a row's values were not all stored"

    by_cols = geometry(name, cols_k)
    parts = {f"d{g}_partials": np.full((groups, cols), np.nan, np.float32) for g in weights}
    got = launch(name, cols_k, (by_cols.launch(rows, cols).grid[0], groups), by_cols.threads,
                 **ins, **dargs, rowstats=stats, **parts, **params, rows=rows, cols=cols)
    for g in weights:
        close(got[f"d{g}_partials"].astype(np.float64).sum(0), want[g], TOL["f32"],
              f"{cols_k} d{g}", want32[g])


# ---- pair, update, embedding --------------------------------------------------------------

@dataclass(frozen=True)
class PairCase:
    """A pair-kernel launch: each operand is the [B, T, H, D] view at the start of a buffer
    [B, T, H · heads, D + pad] (pad 2 makes the head stride no multiple of any vector)."""
    shape: tuple[int, int, int, int]
    pos0: int = 0
    in_pad: int = 0
    in_heads: int = 1
    out_heads: int = 1
    in_place: bool = False


# 16-byte vectors are 4 fp32 or 8 bf16 pairs; the kernels table 256 pairs at a time.
PAIR_CASES = {
    "vector path, output heads of a wider buffer": PairCase((2, 5, 3, 16), out_heads=2),
    "vector path at pos0 > 0": PairCase((2, 5, 3, 16), pos0=9, out_heads=2),
    "D/2 = 6, no multiple of the vector: scalar path": PairCase((2, 3, 3, 12), pos0=2),
    "head stride D + 2, no multiple of the vector: scalar path": PairCase((2, 3, 3, 16), in_pad=2,
                                                                         out_heads=2),
    "vector path in place": PairCase((2, 5, 3, 16), pos0=1, in_place=True),
    # training's rope: q and k, the first heads of qkv, rotated where they lie
    "vector path in place on heads of a wider buffer": PairCase((2, 5, 3, 16), in_heads=2,
                                                                in_place=True),
    "scalar path in place": PairCase((2, 3, 3, 12), in_place=True),
    "more vectors than threads": PairCase((1, 2, 40, 128), pos0=3),
    # 6 (fp32) or 3 (bf16) vectors a head, 256 threads: a thread's steps cross heads mid-way
    "more vectors than threads, D/2 = 24": PairCase((1, 2, 100, 48), pos0=3),
    "D/2 = 264, two table chunks": PairCase((1, 2, 2, 528), pos0=5, out_heads=2),
    "D/2 = 261, two table chunks, scalar path": PairCase((1, 2, 2, 522), pos0=5),
}


def _pair_buffer(view: np.ndarray, heads: int, pad: int, fill: float) -> np.ndarray:
    B, T, H, D = view.shape
    buf = np.full((B, T, H * heads, D + pad), fill)
    buf[:, :, :H, :D] = view
    return buf


def _pair_strides(name: str, buf: np.ndarray) -> dict:
    _, T, Hs, Ds = buf.shape
    return {f"{name}_sb": T * Hs * Ds, f"{name}_st": Hs * Ds, f"{name}_sh": Ds}


@pytest.mark.parametrize("case", PAIR_CASES)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("name", _ops("pair"))
def test_pair_kernels_on_strided_views_match_numpy(name, dtype, case):
    """Outputs match numpy inside the view, and the rest of the output buffer is untouched.
    Blocks of the runtime's size, three of them over B·T tokens: blocks loop over tokens."""
    c = PAIR_CASES[case]
    op = OPS[name]
    mod = load_numpy_module(ENTRIES[name])
    B, T, H, D = c.shape
    rng = np.random.default_rng(2)
    params = _params(name)
    x, dy = inputs_as_stored([rng.uniform(-1, 1, c.shape) for _ in range(2)], dtype)
    stages = (("forward", {"x": x}, "y", mod.forward(x, pos0=c.pos0, **params)),
              ("backward", {"dy": dy}, "dx", mod.backward(x, dy, pos0=c.pos0, **params)))
    for stage, ins, out, want in stages:
        k = f"{name}_{stage}_{dtype}"
        sig = [a for a, _ in op["kernels"][k]["args"]]
        bufs = {n: _pair_buffer(v, c.in_heads, c.in_pad, 0.5) for n, v in ({"x": x} | ins).items()
                if n in sig}
        args = {n: stored(b, dtype) for n, b in bufs.items()}
        for n, b in bufs.items():
            args |= _pair_strides(n, b)
        first = next(iter(ins))
        if c.in_place:
            before = bufs[first]
            args |= {out: first} | {k_.replace(first, out, 1): v
                                    for k_, v in _pair_strides(first, before).items()}
        else:
            before = _pair_buffer(np.full(c.shape, np.nan), c.out_heads, 0, np.nan)
            args |= {out: stored(before, dtype)} | _pair_strides(out, before)
        (threads,) = geometry(name, k).launch(B * T, H, D).block
        got = value(launch(name, k, 3, threads, **args, **params, B=B, T=T, H=H, D=D,
                           pos0=c.pos0)[out], dtype)
        close(got[:, :, :H, :D], want, TOL[dtype], f"{k} {case}")
        outside = np.ones(got.shape, bool)
        outside[:, :, :H, :D] = False
        assert np.array_equal(got[outside], value(stored(before, dtype), dtype)[outside],
                              equal_nan=True), f"{k} {case}: wrote outside the view"


def _update_case(name: str, kernel: str, control: dict):
    """A launch of update kernel `kernel` (a phase of the step: its part, '' the step; a
    matrix op's normalize or apply) over 2051 elements (two blocks: every grid-stride loop
    and the scalar tail run; a matrix op's 7 x 293) with the control slots `control` (the
    rest: not skipped, grads unscaled), grads in the kernel's dtype (the autocast kernel's
    float32): (the kernel's written buffers, the float64 reference arrays after the numpy
    module's phase, the buffers as they went in)."""
    op, k = OPS[name], OPS[name]["kernels"][kernel]
    mod = load_numpy_module(ENTRIES[name])
    n, dtype, part = 2051, k["dtype"], k.get("part", "")
    shape = {"rows": 7.0, "cols": 293.0} if "matrix" in op else {}
    rng = np.random.default_rng(3)
    arrays = {}
    for o in op["inputs"]:
        a = rng.uniform(0, 1, n) if o["name"] == "v" else rng.uniform(-1, 1, n)
        arrays[o["name"]] = (inputs_as_stored([a], dtype)[0] if o["role"] == "grad"
                             else a.astype(np.float32).astype(np.float64))
    slots = {"skip": 0.0, "grad_scale": 1.0, "lr": 1e-2, "step": 3.0, **control}
    ctl = np.array([slots[c] for c in mod.CONTROL], np.float32)   # as the device holds it
    assert tuple(k["control"]) == mod.CONTROL
    bufs = {o["name"]: stored(arrays[o["name"]], dtype) if o["role"] == "grad"
            else arrays[o["name"]].astype(np.float32) for o in op["inputs"]}
    extra = {a: np.full(n, 0x7FC0, np.uint16) for a, t in k["args"] if t == "__nv_bfloat16*"}
    ref = {n_: a.copy() for n_, a in arrays.items()}
    if part == "normalize":   # the norm the runtime's GEMM writes, as the device holds it
        x = op["matrix"]["orthogonalize"]
        extra["_sumsq"] = np.array([np.sum(arrays[x] ** 2)], np.float32)
        mod.normalize(ref[x], extra["_sumsq"].astype(np.float64), ctl)
    else:
        getattr(mod, part or "step")(*(ref[o["name"]] for o in op["inputs"]), ctl,
                                     **_params(name), **shape)
    got = launch(name, kernel, 2, geometry(name, kernel).threads, **bufs, **extra, control=ctl,
                 **_params(name), **shape, n=n)
    return got, ref, {**bufs, **extra}


UPDATE_KERNELS = [(n, k) for n in _ops("update") for k in OPS[n]["kernels"]]


@pytest.mark.parametrize("name,kernel", UPDATE_KERNELS, ids=[k for _, k in UPDATE_KERNELS])
def test_update_kernels_match_numpy_with_scaled_grads_and_write_the_bf16_copy(name, kernel):
    """Each kernel of each phase; the bf16 and autocast kernels of the phase that writes
    the weight also write its copy: the updated weight as written, rounded once."""
    got, ref, _ = _update_case(name, kernel, {"grad_scale": 0.37})
    k = OPS[name]["kernels"][kernel]
    weight = next(o["name"] for o in OPS[name]["inputs"] if o["role"] == "state")
    copies = [a for a, t in k["args"] if t == "__nv_bfloat16*"]
    for s in (a for a in got if a not in copies):
        close(got[s].astype(np.float64), ref[s], TOL["f32"], f"{kernel} {s}")
    writes = weight in got
    assert copies == ([f"{weight}_bf16"] if writes and (k["dtype"] == "bf16" or
                                                       k.get("precision")) else [])
    for c in copies:
        np.testing.assert_array_equal(got[c], to_bf16(got[weight]))


@pytest.mark.parametrize("name,kernel", UPDATE_KERNELS, ids=[k for _, k in UPDATE_KERNELS])
def test_a_skipped_update_kernel_writes_nothing(name, kernel):
    got, ref, before = _update_case(name, kernel, {"skip": 1.0})
    for n, a in got.items():
        np.testing.assert_array_equal(a, before[n], err_msg=f"{kernel}: wrote {n}")
        if n in ref:
            np.testing.assert_array_equal(ref[n], before[n].astype(np.float64))


def _embedding_keys(ids: np.ndarray, dtype: str, V: int) -> tuple[np.ndarray, np.ndarray]:
    """The backward's device sort: tiles sorted in shared memory, then merged by rank. The
    sorted keys, and first[V] (n - the rank of each id's first key; 0: absent)."""
    n = ids.size
    k = f"embedding_backward_sort_{dtype}"
    at = geometry("embedding", k).launch(n)
    got = launch("embedding", k, at.grid, at.block, ids=ids,
                 tiled=np.full(n, -1, np.int64), first=np.full(V, -1, np.int32),
                 runs=np.full(1, -1, np.int32), n=n, V=V)
    assert got["runs"][0] == 0, "the sort clears the count of long runs"
    k = f"embedding_backward_merge_{dtype}"
    at = geometry("embedding", k).launch(n)
    got = launch("embedding", k, at.grid, at.block, tiled=got["tiled"],
                 keys=np.full(n, -1, np.int64), first=got["first"], n=n)
    return got["keys"], got["first"]


def _embedding_dwte(ids, dout, base, dtype: str, accumulate: int) -> tuple[np.ndarray, list]:
    """dwte from the device sort, the run sums and the long-run sums, onto `base` (stored
    values); and the ids the run sums listed as long runs, in the order listed."""
    V, C = base.shape
    n = ids.size
    keys, first = _embedding_keys(ids, dtype, V)
    k = f"embedding_backward_wte_{dtype}"
    wte = geometry("embedding", k)
    long_k = f"embedding_backward_wte_long_{dtype}"
    long = geometry("embedding", long_k)
    runs = np.full(1 + n // (long.long_run + 1), -1, np.int32)
    runs[0] = 0                                      # as the sort leaves it
    vec = int(C % wte.vec == 0)
    args = dict(dout=stored(dout, dtype), keys=keys, first=first, n=n, C=C, vec=vec,
                accumulate=accumulate)
    at = wte.launch(V, C, bool(vec))
    got = launch("embedding", k, at.grid, at.block, runs=runs, dwte=base, V=V, **args)
    listed = list(got["runs"][1:1 + got["runs"][0]])
    at = long.launch(runs.size - 1, C, bool(vec))
    got = launch("embedding", long_k, at.grid, at.block, runs=got["runs"], dwte=got["dwte"],
                 **args)
    return value(got["dwte"], dtype), listed


@pytest.mark.parametrize("n,vocab", [(5000, 7), (5000, 100000), (20000, 50), (2048, 3), (1, 1)])
def test_embedding_sort_orders_ids_and_keeps_token_order_within_an_id(n, vocab):
    """Keys id << 32 | position come out sorted: by id, and equal ids in token order, over
    several tiles (5000 > 2 · 2048; 20000 takes two lockstep groups of tiles), exactly one
    tile, and one id. first[id] = n - the rank of the id's first key, 0 for absent ids."""
    ids = np.random.default_rng(n + vocab).integers(0, vocab, n).astype(np.int32)
    V = vocab + 3                                    # ids V-3 .. V-1 never occur
    keys, first = _embedding_keys(ids, "f32", V)
    want = np.sort((ids.astype(np.int64) << 32) | np.arange(n))
    assert (keys == want).all()
    present, rank = np.unique(want >> 32, return_index=True)
    want_first = np.zeros(V, np.int32)
    want_first[present] = n - rank
    assert (first == want_first).all()


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
# 1096: 274 fp32 / 137 bf16 vectors, more than a warp fetches a pass (32 lanes x FETCH)
@pytest.mark.parametrize("C,with_wpe", [(64, True), (64, False), (50, True), (1096, True)])
def test_embedding_gather_and_deterministic_scatter(C, with_wpe, dtype):
    rng = np.random.default_rng(C)
    B, T, V = 2, 9, 70                               # dwte: three warps of rows, one part-filled
    ids = rng.integers(0, V, (B, T)).astype(np.int32)
    ids[0, :6] = 4                                   # a run longer than a fetch batch
    ids[1, :8] = V - 1                               # the last run: it ends at the last key
    wte, wpe = inputs_as_stored([rng.uniform(-1, 1, (V, C)), rng.uniform(-1, 1, (T, C))], dtype)
    wte[ids[1, 8], ::3] = -0.0                       # a gather copies bits: -0 stays -0
    k = f"embedding_forward_{dtype}"
    got = launch("embedding", k, 2, 64, ids=ids, wte=stored(wte, dtype),
                 wpe=stored(wpe, dtype) if with_wpe else None,
                 out=stored(np.full((B, T, C), np.nan), dtype), BT=B * T, T=T, C=C, V=V)
    close(value(got["out"], dtype), wte[ids] + (wpe[None] if with_wpe else 0), TOL[dtype], k)
    if not with_wpe:
        assert (got["out"].view(np.uint8) == stored(wte, dtype)[ids].view(np.uint8)).all(), k

    dout = inputs_as_stored([rng.uniform(-1, 1, (B, T, C))], dtype)[0]
    flat = ids.reshape(-1)
    absent = np.setdiff1d(np.arange(V), flat)
    assert absent.size and V % 32, "absent rows, and a part-filled last warp"
    for accumulate in (0, 1):
        base = np.full((V, C), np.nan)
        base[flat] = 1.0 if accumulate else np.nan
        dwte, listed = _embedding_dwte(ids, dout, stored(base, dtype), dtype, accumulate)
        assert listed == []
        want = np.zeros((V, C))
        want[flat] = float(accumulate)
        np.add.at(want, flat, dout.reshape(-1, C))
        if accumulate:   # absent rows are left as they were (NaN here): nothing adds to them
            assert np.isnan(dwte[absent]).all()
            dwte[absent] = want[absent]
        close(dwte, want, TOL[dtype], f"{k} accumulate={accumulate}")
    k = f"embedding_backward_wpe_{dtype}"
    for accumulate in (0, 1):
        got = launch("embedding", k, 2, 64, dout=stored(dout, dtype),
                     dwpe=stored(np.ones((T, C)), dtype), B=B, T=T, C=C, accumulate=accumulate)
        close(value(got["dwpe"], dtype), dout.sum(0) + accumulate, TOL[dtype], k)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_embedding_long_runs_are_listed_and_summed_in_token_order(dtype):
    """Runs longer than long_run keys go to the second kernel, which stages a round of
    rows in shared memory and adds them in token order: in float32, np.add.at's bits.
    Here a run over four rounds (the last part-filled), one a key past long_run, one at
    long_run exactly (the first kernel's), and short ones; both write and accumulate."""
    long = geometry("embedding", f"embedding_backward_wte_long_{dtype}")
    long_run, rnd = long.long_run, long.threads // 32 * 4
    rng = np.random.default_rng(5)
    B, T, V, C = 2, 3 * rnd + 40, 90, 72             # C: 18 fp32 vectors, 9 bf16: lanes idle
    ids = rng.integers(10, V, (B, T)).astype(np.int32)
    flat = ids.reshape(-1)
    spots = rng.permutation(flat.size)
    flat[spots[:3 * rnd + 7]] = 4                     # four rounds, the last part-filled
    flat[spots[3 * rnd + 7:3 * rnd + 8 + long_run]] = 5      # long_run + 1 keys
    flat[spots[3 * rnd + 8 + long_run:3 * rnd + 8 + 2 * long_run]] = 6   # long_run keys
    dout = inputs_as_stored([rng.uniform(-1, 1, (B, T, C))], dtype)[0]
    for accumulate in (0, 1):
        base = rng.uniform(-1, 1, (V, C)) if accumulate else np.full((V, C), np.nan)
        base = inputs_as_stored([base], dtype)[0] if accumulate else base
        dwte, listed = _embedding_dwte(ids, dout, stored(base, dtype), dtype, accumulate)
        assert sorted(listed) == [4, 5], listed
        want = (base if accumulate else np.zeros((V, C))).astype(np.float32)
        np.add.at(want, flat, dout.reshape(-1, C).astype(np.float32))
        if dtype == "f32":
            assert (dwte.astype(np.float32).view(np.uint32) == want.view(np.uint32)).all(), (
                f"accumulate={accumulate}: {int((dwte != want).sum())} elements off np.add.at")
        else:
            close(dwte, want.astype(np.float64), TOL[dtype], f"bf16 accumulate={accumulate}")


def test_embedding_id_outside_the_table_traps():
    """The range check costs no host sync: the kernel prints the id and traps."""
    ids = np.int32([[0, 3, 13]])
    with pytest.raises(AssertionError, match=r"ids\[2\] = 13 is outside the table of 13 rows"):
        launch("embedding", "embedding_forward_f32", 1, 64, ids=ids,
               wte=np.zeros((13, 4), np.float32), wpe=None,
               out=np.zeros((1, 3, 4), np.float32), BT=3, T=3, C=4, V=13)
    with pytest.raises(AssertionError, match=r"ids\[0\] = -1 is outside the table"):
        launch("embedding", "embedding_backward_sort_f32", 1, 1024, ids=np.int32([-1, 2]),
               tiled=np.zeros(2, np.int64), first=np.zeros(13, np.int32),
               runs=np.zeros(1, np.int32), n=2, V=13)


# ---- row kernels with -inf entries (online max and sum) ------------------------------------

NEG_INF_OPS = [n for n in _ops("row") if n in ("softmax", "log_softmax", "cross_entropy")]
# 1250 and 6000: every block kernel at a warp count no power of two (warps whose lanes are
# all -inf, merged by the butterfly with lanes that hold no warp)
NEG_INF_COLS = [1, 17, 768, 1250, 2048, 6000, 50257]


def same_with_inf(got: np.ndarray, want: np.ndarray, tol: float, what: str) -> None:
    """-inf where the reference has -inf (log_softmax of a masked column), close elsewhere."""
    want = np.broadcast_to(want, got.shape)
    finite = np.isfinite(want)
    assert np.array_equal(got[~finite], want[~finite]), f"{what}: infinities differ"
    close(got[finite], want[finite], tol, what)


@pytest.mark.parametrize("name,cols,layout,dtype", [
    p for n in NEG_INF_OPS for p in layout_params(
        n, [(c, lay) for c in NEG_INF_COLS for lay in ("warp", "block", "held")])])
def test_online_max_and_sum_handle_minus_infinity(name, cols, layout, dtype):
    """The block-per-row kernels accumulate the sum against the running max (ir.Online), the
    warp-per-row and block_held ones keep two passes; all give numpy's values, -inf
    included."""
    op = OPS[name]
    entry = ENTRIES[name]
    mod = load_numpy_module(entry)
    rng = np.random.default_rng(cols + 7)
    x = inputs_as_stored([masked_rows(rng, 4, cols)], dtype)[0]
    rows = x.shape[0]
    ins = {"x": stored(x, dtype)}
    xs = [x]
    if any(o["role"] == "index" for o in op["inputs"]):
        target = np.array([rng.choice(np.flatnonzero(np.isfinite(r))) for r in x], np.int32)
        ins["target"] = target
        xs.append(target)
    suffix = SUFFIX[layout]
    (out,) = op["outputs"]
    scalar = out["role"] == "scalar"
    tol = TOL["f32"] if scalar else TOL[dtype]
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        want = mod.forward(*xs)
        dout = (rng.uniform(-1, 1, rows).astype(np.float32).astype(np.float64) if scalar
                else inputs_as_stored([rng.uniform(-1, 1, (rows, cols))], dtype)[0])
        want_dx = mod.backward(*xs, dout)
    assert np.isfinite(want_dx).all()
    dargs = {f"d{out['name']}": dout.astype(np.float32) if scalar else stored(dout, dtype)}
    stages = ["forward", "backward"] + (["fwdbwd"] if f"{name}_fwdbwd_{dtype}" in op["kernels"] else [])
    for stage in stages:
        k = f"{name}_{stage}{suffix}_{dtype}"
        grid, threads, _ = _row_geometry(name, k, rows, cols)
        bufs = {}
        if stage != "backward":
            bufs[out["name"]] = (np.full(rows, np.nan, np.float32) if scalar
                                 else stored(np.full((rows, cols), np.nan), dtype))
        if stage != "forward":
            bufs["dx"] = stored(np.full((rows, cols), np.nan), dtype)
            bufs |= dargs
        got = launch(name, k, grid, threads, **ins, **bufs, rows=rows, cols=cols)
        if out["name"] in got:
            g = got[out["name"]]
            same_with_inf(g.astype(np.float64) if scalar else value(g, dtype), want, tol,
                          f"{k} {out['name']}")
        if "dx" in got:
            close(value(got["dx"], dtype), want_dx, TOL[dtype], f"{k} dx")


@pytest.mark.parametrize("name", NEG_INF_OPS)
def test_minus_infinity_cases_launch_every_block_kernel_with_warps_no_power_of_two(name):
    assert not powers_of_two_only(name, NEG_INF_COLS)


@pytest.mark.parametrize("layout", ["warp", "block"])
@pytest.mark.parametrize("name", [n for n in _ops("row")
                                  if any(o["role"] == "index" for o in OPS[n]["inputs"])])
def test_a_target_outside_the_row_picks_nothing(name, layout):
    """A picked column (ir.Pick) is read once per row, and only inside the row: ids -1 and
    cols (an ignore index, a padded id) give what the sum over no matching column gives."""
    op = OPS[name]
    mod = load_numpy_module(ENTRIES[name])
    rows, cols = 4, 768
    rng = np.random.default_rng(5)
    x = inputs_as_stored([rng.uniform(-4, 4, (rows, cols))], "f32")[0]
    target = np.array([-1, cols, 0, cols - 1], np.int32)
    suffix = "_block" if layout == "block" else ""
    k = f"{name}_forward{suffix}_f32"
    grid, threads, _ = _row_geometry(name, k, rows, cols)
    (out,) = [o["name"] for o in op["outputs"]]
    got = launch(name, k, grid, threads, x=stored(x, "f32"), target=target,
                 **{out: np.full(rows, np.nan, np.float32)}, rows=rows, cols=cols)
    close(got[out].astype(np.float64), mod.forward(x, target), TOL["f32"], k)
