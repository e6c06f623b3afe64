"""Row kernels as rendered (generator/kinds/row.py, templates/row.cu.j2): the launch facts
the runtime reads from the manifest agree with what each kernel was compiled with, the
block shapes the planner chose for the ops that were measured, and which sweeps of a block
per row load and store evict-first. Their numbers are checked by tests/test_cuda_emulated.py
(CPU) and tests/gpu/."""
from __future__ import annotations

import functools
import re
import textwrap
from dataclasses import dataclass, replace

import pytest

from eulergen import GENERATED_DIR, launch
from eulergen.generator import plan as planner
from eulergen.generator.derive import derive
from eulergen.generator.render import render_op
from eulergen.generator.spec import load_spec
from eulergen.runtime.engine.compile import op_options
from eulergen.runtime.engine.manifest import load_manifest

from rendering import planned

MANIFEST = GENERATED_DIR / "manifest.json"
OPS = load_manifest(MANIFEST).ops if MANIFEST.exists() else {}
ROW_KERNELS = [(op, k) for op in sorted(OPS) if OPS[op].kind == "row"
               for k in sorted(OPS[op].kernels)
               if isinstance(OPS[op].kernels[k].geometry, launch.ROW_LAYOUTS)]
# elements in one 16-byte access (EgVec<T>::N in templates/common.cuh.j2), by storage ctype
VEC_OF_CTYPE = {planner.CTYPE[dt]: planner.VEC[dt] for dt in planner.DTYPES}

# extern "C" __global__ void __launch_bounds__(T[, M]) NAME(ARGS) {
#   [// ... and an `if (...) __trap();` check of the aligned variant]
#   IMPL<CTYPE, WARP, SLOTS, RPB, PREFETCH, BATCH, WHOLE, ALIGNED>(...);
_WRAPPER = re.compile(r'extern "C" __global__ void __launch_bounds__\((\d+)(?:, (\d+))?\) '
                      r'(\w+)\(([^)]*)\) \{\n(?:  (?://|if ).*\n)*  (\w+)<([\w ]+), (true|false), '
                      r'(\d+), (\d+), (true|false), (\d+), (true|false), (true|false)>\(')


@dataclass(frozen=True)
class Compiled:
    """A row kernel's wrapper as the .cu states it: launch bounds, the device impl it
    instantiates and the template arguments."""
    threads: int
    min_blocks: int                  # 0: no minimum in __launch_bounds__
    args: tuple[tuple[str, str], ...]
    impl: str
    ctype: str
    warp: bool
    slots: int
    rows_per_block: int
    prefetch: bool
    batch: int
    whole: bool
    aligned: bool


def parse_wrappers(source: str) -> dict[str, Compiled]:
    """Every row kernel wrapper in a rendered row .cu, by name."""
    out = {}
    for m in _WRAPPER.finditer(source):
        (threads, min_blocks, name, params, impl, ctype, warp, slots, rpb, prefetch, batch,
         whole, aligned) = m.groups()
        args = tuple((n, t) for t, n in (a.rsplit(" ", 1) for a in params.split(", ")))
        out[name] = Compiled(int(threads), int(min_blocks or 0), args, impl, ctype,
                             warp == "true", int(slots), int(rpb), prefetch == "true",
                             int(batch), whole == "true", aligned == "true")
    return out


@functools.lru_cache(maxsize=None)
def wrappers(op: str) -> dict[str, Compiled]:
    """Every row kernel wrapper in the op's generated .cu, by name."""
    return parse_wrappers(OPS[op].cuda.read_text())


@pytest.mark.parametrize("op,kernel", ROW_KERNELS, ids=[k for _, k in ROW_KERNELS])
def test_manifest_launch_facts_match_the_kernel_as_compiled(op, kernel):
    """The runtime launches from the manifest; the kernel was compiled from the template
    arguments. A block larger than __launch_bounds__ fails to launch; cols_per_thread other
    than VEC · SLOTS misplaces the registers-then-L2 split the launch size is chosen for."""
    k = OPS[op].kernels[kernel]
    c = wrappers(op)[kernel]
    vec = VEC_OF_CTYPE[c.ctype]
    assert c.args == k.args, f"{kernel}: the manifest's arguments are not the kernel's"
    g = k.geometry
    assert g.threads == c.threads
    assert g.aligned == c.aligned == ("_unaligned_" not in kernel)
    if isinstance(g, (launch.BlockPerRow, launch.BlockHeld)):
        assert not c.warp and c.rows_per_block == 1
        assert g.cols_per_thread == vec * c.slots
        assert g.threads_min <= c.threads
        if isinstance(g, launch.BlockHeld):   # the row in registers: no re-read to prefetch
            assert g.max_cols == c.threads * vec * c.slots and not c.prefetch
    else:
        assert c.warp and g.rows_per_block * 32 == c.threads == c.rows_per_block * 32
        assert g.max_cols == 32 * vec * c.slots
        # a prefetching warp takes several rows: its grid is capped (weight grads always are)
        assert (g.grid_max is not None) == (c.prefetch or g.wgrad)


ALIGNED_ROW_KERNELS = [(op, k) for op, k in ROW_KERNELS if OPS[op].kernels[k].geometry.aligned]


@pytest.mark.parametrize("op,kernel", ALIGNED_ROW_KERNELS, ids=[k for _, k in ALIGNED_ROW_KERNELS])
def test_each_aligned_row_kernel_has_an_unaligned_twin_with_its_launch_facts(op, kernel):
    """The runtime allocates outputs, sizes the grid and the workspace from the aligned kernel
    and then launches the `_unaligned` one where row_aligned says no (runtime/engine/kinds/row.py):
    the two take the same arguments and the same geometry but for `aligned`."""
    k = OPS[op].kernels[kernel]
    twin = OPS[op].kernels[f"{kernel[:-len(k.dtype)]}unaligned_{k.dtype}"]
    assert replace(twin, name=k.name, geometry=k.geometry) == k
    assert replace(twin.geometry, aligned=True) == k.geometry


@pytest.mark.parametrize("kernel,threads,min_blocks,slots", [
    # one sweep (max, online sum and picked logit): short blocks, eight an SM
    ("cross_entropy_forward_block_f32", 256, 8, 2),
    ("cross_entropy_forward_block_bf16", 256, 8, 1),
    # fp32 re-read: 10 groups of the one cached operand (x), one block an SM
    ("cross_entropy_fwdbwd_block_f32", 1024, 1, 10),
    ("cross_entropy_backward_block_f32", 1024, 1, 10),
    # bf16 keeps one group and the next row's prefetch
    ("cross_entropy_fwdbwd_block_bf16", 1024, 0, 1),
])
def test_cross_entropy_block_kernels_take_the_measured_shapes(kernel, threads, min_blocks, slots):
    c = wrappers("cross_entropy")[kernel]
    assert (c.threads, c.min_blocks, c.slots) == (threads, min_blocks, slots)


def test_softmax_fp32_backward_splits_the_re_read_groups_between_x_and_dy():
    c = wrappers("softmax")["softmax_backward_block_f32"]
    assert (c.threads, c.min_blocks, c.slots) == (1024, 1, 5)
    assert wrappers("softmax")["softmax_forward_block_f32"].slots == 10


@pytest.mark.parametrize("op,fast", [("cross_entropy", True), ("silu", True), ("softmax", False),
                                     ("swiglu", False), ("gelu_erf", False)])
def test_only_the_ops_that_opt_in_are_compiled_with_fast_math(op, fast):
    """ops/cross_entropy.yaml and ops/silu.yaml opt in: the manifest marks them and the runtime
    asks NVRTC; the others keep IEEE exp and division."""
    assert OPS[op].fast_math is fast
    assert op_options(OPS[op]) == (("--use_fast_math",) if fast else ())


# ---- evict-first sweeps of a block per row ------------------------------------------------

# A row op with a weight, one reduction and an element output: each stage has a reduction
# sweep followed by an element sweep.
CENTER = """\
name: center_scale
kind: row
doc: a row less its mean, scaled by a weight
inputs: {x: row, w: weight}
reduce:
  mu: mean(x)
outputs:
  y: (x - mu)*w
"""
# A step of a kernel's row loop starts at its comment, at the loop body's indent.
_STEP = re.compile(r"^    // (pass|per element|per row)\b", re.M)
_LOAD = re.compile(r"eg_load_group(?:_n<VEC>)?\((\w+), [^;]*;")   # _n: autocast's
_STORE = re.compile(r"eg_store_group(?:_n<VEC>)?\([^;]*;")


def _sweeps(source: str) -> list[tuple[str, str]]:
    """(step kind, its source) of every pass and element sweep of every kernel template."""
    out = []
    for impl in source.split("template <typename scalar_t, bool WARP")[1:]:
        cuts = list(_STEP.finditer(impl))
        for m, nxt in zip(cuts, cuts[1:] + [None]):
            out.append((m.group(1), impl[m.start():nxt.start() if nxt else len(impl)]))
    return out


@pytest.fixture(scope="module")
def center_sweeps(tmp_path_factory) -> list[tuple[str, str]]:
    path = tmp_path_factory.mktemp("ops") / "center_scale.yaml"
    path.write_text(CENTER)
    sweeps = _sweeps(render_op(*planned(derive(load_spec(path))), "header").source)
    kinds = [k for k, _ in sweeps]
    # forward, backward, and the split backward's rows kernel (plan.WGRAD_SPLIT_COLS); then
    # the same three of its `add` fusion (generator/fuse.py); then all six in the autocast
    # precision (plan_row.AUTOCAST)
    assert kinds.count("pass") >= 12 and kinds.count("per element") == 12, kinds
    return sweeps


def test_element_sweeps_re_read_the_row_and_store_evict_first_in_a_block_per_row(center_sweeps):
    """A row's last sweep: what it reads and writes is not read again, and would push out of
    L2 the rows in flight still to be re-read (WARP: a warp's row stays in registers)."""
    for kind, text in center_sweeps:
        if kind != "per element":
            continue
        row_loads = [m.group(0) for m in _LOAD.finditer(text) if m.group(1).endswith("_row_")]
        stores = _STORE.findall(text)
        assert row_loads and stores, text
        assert all(s.endswith(", !WARP);") for s in row_loads + stores), row_loads + stores


def test_reduction_sweeps_and_weights_load_for_keeps(center_sweeps):
    """A reduction sweep's row is read again by the sweeps after it, and every row reads the
    weights: neither is loaded evict-first."""
    weight_loads = []
    for kind, text in center_sweeps:
        loads = [m.group(0) for m in _LOAD.finditer(text)]
        if kind == "pass":
            assert loads and not _STORE.findall(text), text
            assert not any("!WARP" in s for s in loads), loads
        weight_loads += [s for s in loads if s.startswith("eg_load_group(w_ptr,")]
    assert weight_loads and not any("!WARP" in s for s in weight_loads), weight_loads


# -- which impl each kernel instantiates, and its prefetch -------------------------------------

@pytest.mark.parametrize("op,kernel", ROW_KERNELS, ids=[k for _, k in ROW_KERNELS])
def test_each_row_kernel_prefetches_as_the_plan_says(op, kernel):
    """bf16 prefetches the next row's cached groups, fp32 does not (its re-read shapes'
    groups leave no room: generator/plan.block_shape), in both layouts; except the warp
    backwards with weight gradients over two reduction levels, which take more warps
    instead (plan.warp_shape), and the blocks that hold their row (plan.held_shape), which
    take a row each."""
    k, c = OPS[op].kernels[kernel], wrappers(op)[kernel]
    deep = c.warp and c.min_blocks == planner.WARP_DEEP_WGRAD_BLOCKS
    held = isinstance(k.geometry, launch.BlockHeld)
    assert c.prefetch == (k.dtype in planner.PREFETCH_DTYPES and not deep and not held), kernel


@pytest.mark.parametrize("op", ["softmax", "log_softmax", "cross_entropy", "layernorm"])
def test_rows_held_in_registers_take_the_two_pass_impl_and_long_block_rows_the_online_one(op):
    """An online sum joins its max's sweep only in block_per_row kernels, which re-read
    their rows; the warp and block_held kernels sweep registers twice. Only the HELD_SLOTS
    dtypes have block_held kernels, and only for stages without weight gradients."""
    held = set()
    for name, c in wrappers(op).items():
        k = OPS[op].kernels[name]
        online = c.impl.endswith("_online")
        if isinstance(k.geometry, launch.BlockHeld):   # never with weight gradients
            held.add((k.stage, k.fusion, k.dtype))
        assert online == (isinstance(k.geometry, launch.BlockPerRow) and op != "layernorm"), name
    stages = [(s, "") for s in ["forward"] + ([] if op == "layernorm" else ["backward"]) + (
        ["fwdbwd"] if op == "cross_entropy" else [])]
    if op != "cross_entropy":   # a norm-shaped op: its `add` fusion's stages too
        stages += [(s, "add") for s, _ in stages]
    assert held == {(s, f, dt) for s, f in stages for dt in planner.HELD_SLOTS}


@pytest.mark.parametrize("op,deep", [("layernorm", True), ("rmsnorm", False)])
def test_a_bf16_warp_backward_over_two_reduction_levels_trades_its_prefetch_for_warps(op, deep):
    """LayerNorm's backward forms its mean, then its variance and adjoint sums; RMSNorm's
    forms all in one sweep. The grid, which sizes the partials' workspace, holds as many
    blocks an SM as the launch bounds ask."""
    for name in (f"{op}_backward_bf16", f"{op}_backward_unaligned_bf16"):
        k, c = OPS[op].kernels[name], wrappers(op)[name]
        blocks = planner.WARP_DEEP_WGRAD_BLOCKS if deep else 4
        assert (c.prefetch, c.min_blocks) == ((False, blocks) if deep else (True, 0))
        assert k.geometry.grid_max == 132 * blocks


@pytest.mark.parametrize("op,kernel", ROW_KERNELS, ids=[k for _, k in ROW_KERNELS])
def test_each_row_kernel_batches_its_first_sweep_as_the_plan_says(op, kernel):
    """BATCH is the plan's RowShape.batch: 2 in the fp32 re-read shapes reading one row
    operand (cross-entropy's, the softmax forwards), 1 elsewhere."""
    k, c = OPS[op].kernels[kernel], wrappers(op)[kernel]
    reread = not c.warp and c.slots > planner.BLOCK_SLOTS[k.dtype]
    one_operand = c.slots == planner.BLOCK_REREAD_GROUPS.get(k.dtype)
    assert c.batch == (planner.BLOCK_REREAD_BATCH if reread and one_operand else 1), kernel


@pytest.mark.parametrize("op", ["cross_entropy", "softmax", "layernorm"])
def test_only_the_first_sweep_of_an_impl_some_shape_batches_has_the_batched_loop(op):
    """The first sweep reads the row from memory, later ones re-read it from L2; an impl no
    shape of which batches keeps the one plain loop."""
    source = OPS[op].cuda.read_text()
    batching = {c.impl for c in wrappers(op).values() if c.batch > 1}
    for impl in source.split("template <typename scalar_t, bool WARP")[1:]:
        name = re.search(r"void (\w+)\(", impl).group(1)
        sweeps = [text for _, text in _sweeps("template <typename scalar_t, bool WARP" + impl)]
        batched = ["g0b_" in text for text in sweeps]
        assert batched == [name in batching] + [False] * (len(sweeps) - 1), (name, batched)
    assert batching or op == "layernorm"


@pytest.mark.parametrize("op,kernel", ROW_KERNELS, ids=[k for _, k in ROW_KERNELS])
def test_each_row_kernel_sweeps_whole_groups_as_the_plan_says(op, kernel):
    """WHOLE is the plan's RowShape.whole: the block_per_row rows of ops without weights
    (a block_held kernel has its row in registers, no re-read groups)."""
    c = wrappers(op)[kernel]
    weights = any(i.role == "weight" for i in OPS[op].inputs)
    block = isinstance(OPS[op].kernels[kernel].geometry, launch.BlockPerRow)
    assert c.whole == (block and not weights), kernel


@pytest.mark.parametrize("op", ["cross_entropy", "softmax", "layernorm"])
def test_only_the_impls_some_shape_sweeps_whole_have_the_whole_group_loop(op):
    """An impl no shape of which sweeps whole keeps the one checked loop (and so the SASS
    it had before WHOLE)."""
    source = OPS[op].cuda.read_text()
    whole = {c.impl for c in wrappers(op).values() if c.whole}
    for impl in source.split("template <typename scalar_t, bool WARP")[1:]:
        name = re.search(r"void (\w+)\(", impl).group(1)
        assert ("eg_whole_end" in impl) == (name in whole), name
    assert whole or op == "layernorm"


def test_a_stage_that_reads_no_online_sum_has_one_impl_for_both_layouts(tmp_path):
    # s = sum(exp(x)): the forward reads z (online in the block kernels); the backward,
    # ds·exp(x - m)·exp(m), reads only m, so its two-pass impl serves both layouts
    (tmp_path / "sumexp.yaml").write_text(textwrap.dedent("""\
        name: sumexp
        kind: row
        inputs: {x: row}
        reduce:
          m: max(x)
          z: sum(exp(x - m))
        stabilizers: [m]
        outputs:
          s: z * exp(m)
        domain: {x: [-10, 10]}
        """))
    rendered = render_op(*planned(derive(load_spec(tmp_path / "sumexp.yaml"))), "header")
    impls = re.findall(r"__device__ __forceinline__ void (\w+)\(", rendered.source)
    assert impls == ["sumexp_forward", "sumexp_forward_online", "sumexp_backward",
                     "sumexp_fwdbwd", "sumexp_fwdbwd_online"], impls
    made = parse_wrappers(rendered.source)
    assert sorted(made) == sorted(k.name for k in rendered.kernels if k.part != "reduce")
    for dt in planner.DTYPES:
        assert made[f"sumexp_backward_{dt}"].impl == "sumexp_backward"
        assert made[f"sumexp_backward_block_{dt}"].impl == "sumexp_backward"
        assert made[f"sumexp_forward_block_{dt}"].impl == "sumexp_forward_online"


def _passes(op: str, impl: str) -> list[str]:
    """What each `// pass:` comment of one device impl in the op's generated .cu names."""
    source = OPS[op].cuda.read_text()
    body = source[source.index(f"void {impl}("):]
    return re.findall(r"^    // pass: ([^\n]*)", body[:body.index("\n}\n")], re.M)


@pytest.mark.parametrize("op,adjoint,passes", [
    ("log_softmax", "sum_dz", {"log_softmax_backward": 2, "log_softmax_backward_online": 1}),
    ("rmsnorm", "sum_dms", {"rmsnorm_backward": 1}),
])
def test_adjoint_sums_that_read_no_reduction_join_the_rows_first_sweep(op, adjoint, passes):
    """log-softmax's Σdy and RMSNorm's Σdy·w·x need nothing the forward reduces: the backward
    forms them in the sweep that forms the forward's first reduction, one sweep fewer (the
    two-pass log-softmax: m with Σdy, then z)."""
    for impl, count in passes.items():
        sweeps = _passes(op, impl)
        assert len(sweeps) == count and f"{adjoint} = sum" in sweeps[0], (impl, sweeps)


def test_adjoint_sums_that_read_the_last_sweeps_reduction_take_a_sweep_of_their_own():
    """softmax's Σ dy·exp(x - m) reads m, which the online impl forms in its one forward
    sweep (with z): no later sweep to join, so a sweep of its own after it."""
    sweeps = _passes("softmax", "softmax_backward_online")
    assert [s.split(" =")[0] for s in sweeps] == ["m", "sum_dz"], sweeps


@pytest.mark.parametrize("op,impl,sweeps", [
    ("layernorm", "layernorm_backward", ["mu", "var, sum_dvar, sum_dmu"]),
    ("softmax", "softmax_backward", ["m", "z, sum_dz"]),
])
def test_adjoint_sums_join_the_sweep_after_the_reductions_they_read(op, impl, sweeps):
    """LayerNorm's Σ dy·w·(x - mu) reads mu, not var: it is formed in var's sweep; the
    two-pass softmax's Σ dy·exp(x - m) reads m, not z: in z's sweep. One sweep, and one
    reduction's latency, fewer than a sweep of their own."""
    got = _passes(op, impl)
    assert [", ".join(p.split(" = ")[0] for p in s.split(", ")) for s in got] == sweeps, got
