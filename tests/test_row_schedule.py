"""Row plans as values (generator/plan_row.py, generator/row_schedule.py): which sweeps,
picks and per-row steps each stage's impls take, what a sweep does with a group, the split
backward's row stats and the entry points' signatures, read from the RowPlan without
rendering Jinja. tests/test_row_render.py checks the .cu printed from them."""
from __future__ import annotations

import functools

import pytest

from eulergen.generator import plan as planner
from eulergen.generator.derive import derive
from eulergen.generator.plan_row import RowKernel, RowPlan, plan_row
from eulergen.generator.render import render_op
from eulergen.generator.row_schedule import Pick, RowCode, RowStats, Sweep
from eulergen.generator.ops_path import find_ops
from eulergen.generator.spec import load_spec

from rendering import planned

ROW_OPS = ("softmax", "log_softmax", "cross_entropy", "layernorm", "rmsnorm")


@functools.lru_cache(maxsize=None)
def plan(op: str) -> RowPlan:
    return plan_row(derive(load_spec(find_ops()[op])))


def kernel(op: str, impl: str) -> RowKernel:
    return next(k for k in plan(op).kernels if k.impl == impl)


def sweeps(k: RowKernel) -> list[list[str]]:
    """The reductions each reduction sweep forms, plain then online, in order."""
    return [[n for n, _ in s.ops] + [o.name for o in s.online]
            for s in k.steps if isinstance(s, Sweep) and s.kind == "sweep"]


def test_softmax_block_per_row_forward_is_one_sweep_with_an_online_sum():
    """z joins m's sweep against the running max in the block kernel that re-reads its row;
    the warp and held kernels, whose row is in registers, keep two sweeps."""
    online = kernel("softmax", "softmax_forward_online")
    assert [lay.name for lay in online.layouts] == ["block_per_row"] and online.online
    (sweep,) = [s for s in online.steps if s.kind == "sweep"]
    assert sweep.ops == (("m", "max"),)
    assert [(o.name, o.red, o.max) for o in sweep.online] == [("z", "sum", "m")]
    assert [s.kind for s in online.steps] == ["sweep", "elements"]
    two_pass = kernel("softmax", "softmax_forward")
    assert [lay.name for lay in two_pass.layouts] == ["warp_per_row", "block_held"]
    assert sweeps(two_pass) == [["m"], ["z"]] and not two_pass.online


def test_an_online_sweep_visits_its_cached_groups_plain_then_online_and_re_read_ones_once():
    """The cached groups come first in the row: the max over them first, then the online
    terms against it, nothing to rescale; a re-read group may move the max: it keeps m and
    rescales the sums."""
    (sweep,) = [s for s in kernel("softmax", "softmax_forward_online").steps if s.kind == "sweep"]
    plain, online = sweep.cached
    assert (plain.elements, plain.online, plain.rescale) == (True, False, ())
    assert (online.elements, online.online, online.rescale) == (False, True, ())
    assert plain.bounds and online.bounds          # both accumulate only the body's columns
    re = sweep.reread
    assert (re.elements, re.online, re.rescale) == (True, True, ("m",))
    assert re.loads.operands == ("x",) and sweep.maxes == ("m",)
    assert sweep.merged == ("m", "z")              # the block's shared rows, in that order


def test_cross_entropy_backward_skips_the_picked_logit():
    """`picked` only enters the loss: the forward reads it at the target's column, the
    backward (d loss / d x does not read it) forms no pick at all."""
    fwd = kernel("cross_entropy", "cross_entropy_forward_online")
    (pick,) = [s for s in fwd.steps if isinstance(s, Pick)]
    assert pick.index == "target" and pick.block.results == ("picked",)
    assert pick.loads.operands == ("x",)
    for impl in ("cross_entropy_backward", "cross_entropy_backward_online"):
        assert not [s for s in kernel("cross_entropy", impl).steps if isinstance(s, Pick)], impl
    assert sweeps(kernel("cross_entropy", "cross_entropy_backward_online")) == [["m", "z"]]


@pytest.mark.parametrize("op,impl,want", [
    ("layernorm", "layernorm_backward", [["mu"], ["var", "sum_dvar", "sum_dmu"]]),
    ("layernorm", "layernorm_backward_rows", [["mu"], ["var", "sum_dvar", "sum_dmu"]]),
    ("rmsnorm", "rmsnorm_backward", [["ms", "sum_dms"]]),
    ("log_softmax", "log_softmax_backward", [["m", "sum_dz"], ["z"]]),
    ("log_softmax", "log_softmax_backward_online", [["m", "sum_dz", "z"]]),
    ("softmax", "softmax_backward", [["m"], ["z", "sum_dz"]]),
    ("softmax", "softmax_backward_online", [["m", "z"], ["sum_dz"]]),
])
def test_adjoint_sums_sit_in_the_sweep_after_the_reductions_they_read(op, impl, want):
    """LayerNorm's Σ dy·w·(x - mu) reads mu: var's sweep; RMSNorm's and log-softmax's read
    nothing reduced: the first sweep; softmax's reads m, which its online impl forms in its
    only forward sweep: a sweep of their own after it."""
    assert sweeps(kernel(op, impl)) == want


def test_the_split_backward_writes_its_row_stats_before_its_element_sweep():
    """backward_rows (block_per_row only) writes the per-row values the weight-gradient terms
    read, which wgrad_cols reads back with the rows by columns."""
    p = plan("layernorm")
    rows = kernel("layernorm", "layernorm_backward_rows")
    assert [lay.name for lay in rows.layouts] == ["block_per_row"]
    kinds = [type(s) for s in rows.steps]
    assert kinds[-2:] == [RowStats, Sweep] and RowCode in kinds
    stats = rows.steps[-2]
    assert stats.names == p.split.stats == ("mu", "var")
    assert rows.ptrs[-1].name == "rowstats" and rows.ptrs[-1].role == "stats"
    assert not rows.wgrads and rows.steps[-1].stores == ("dx",) and not rows.steps[-1].wgrads
    for dt in planner.DTYPES:
        assert dict(rows.split_cols)[dt] == planner.wgrad_split_cols(dt, 2)
    assert (p.split.operands, p.split.weights, p.split.wgrads) == (("x", "dy"), (), ("dw", "db"))
    assert [a.name for a in p.split.ptrs] == ["x", "dy", "rowstats", "dw_partials", "db_partials"]
    assert p.split.step.wgrads == ("dw", "db") and p.split.stats == ("mu", "var")


def test_weight_grads_add_into_registers_for_cached_groups_and_the_workspace_for_the_rest():
    (elements,) = [s for s in kernel("rmsnorm", "rmsnorm_backward").steps if s.kind == "elements"]
    assert elements.stores == ("dx",) and elements.wgrads == ("dw",)
    (cached,) = elements.cached
    assert (cached.registers, cached.workspace, cached.bounds) == (("dw",), (), False)
    assert (elements.reread.registers, elements.reread.workspace) == ((), ("dw",))
    assert elements.reread.bounds                  # only the body's columns add partials
    assert elements.evict_first


@pytest.mark.parametrize("op", ROW_OPS)
def test_only_a_kernels_first_reduction_sweep_is_batched_and_only_where_a_shape_batches(op):
    for k in plan(op).kernels:
        served = [k.shape(lay.name, dt) for lay in k.layouts for dt in planner.DTYPES]
        batches = any(sh and sh.batch > 1 for sh in served)
        flags = [s.batched for s in k.steps if isinstance(s, Sweep)]
        assert flags == [batches] + [False] * (len(flags) - 1), k.impl
        assert not any(s.evict_first for s in k.steps if isinstance(s, Sweep) and s.batched)


@pytest.mark.parametrize("op", ROW_OPS)
def test_each_entry_point_has_the_shape_of_its_layout_and_the_plans_signature(op):
    """The entry points' KernelSigs are the manifest's (render_op adds none), two a
    (layout, dtype) with a shape: aligned and `_unaligned`."""
    p = plan(op)
    assert render_op(*planned(derive(load_spec(find_ops()[op]))), "header").kernels == p.signatures
    for k in p.kernels:
        for e in k.entries:
            assert e.shape == k.shape(e.layout.name, e.sig.dtype) is not None
            assert e.sig.name.endswith(f"{'' if e.aligned else '_unaligned'}_{e.sig.dtype}")
            assert e.sig.geometry.aligned is e.aligned
            assert e.sig.args[:len(k.ptrs)] == tuple((a.name, dict(a.ctypes)[e.sig.dtype])
                                                     for a in k.ptrs)
        shaped = [(lay.name, dt) for lay in k.layouts for dt in planner.DTYPES
                if k.shape(lay.name, dt)]
        assert len(k.entries) == 2 * len(shaped), k.impl
