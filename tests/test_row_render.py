"""Row kernels (generator/render_row.py, templates/row.cu.j2): which device impl each kernel
instantiates and with which plan choices. Their numbers are checked by
tests/test_cuda_emulated.py (CPU) and tests/gpu/test_kernels.py."""
from __future__ import annotations

import re
import textwrap

import pytest

from eulergen.generator import plan
from eulergen.generator.derive import derive
from eulergen.generator.render import render_op
from eulergen.generator.spec import load_op, load_spec

ROW_OPS = ("softmax", "log_softmax", "cross_entropy", "layernorm", "rmsnorm")

# extern "C" wrapper -> (impl, template arguments)
_WRAPPER = re.compile(r"void __launch_bounds__\([^)]*\) (\w+)\(.*?\) \{\n  (\w+)<([^>]*)>\(", re.S)


def _instantiations(source: str) -> dict[str, tuple[str, list[str]]]:
    return {kernel: (impl, [a.strip() for a in args.split(",")])
            for kernel, impl, args in _WRAPPER.findall(source)}


def _impls(source: str) -> list[str]:
    return re.findall(r"__device__ __forceinline__ void (\w+)\(", source)


@pytest.mark.parametrize("name", ROW_OPS)
def test_each_row_kernel_prefetches_as_its_plan_says(name):
    rendered = render_op(derive(load_op(name)), "header")
    made = _instantiations(rendered.source)
    for k in rendered.kernels:
        if k.stage == "wgrad_reduce":
            continue
        p = dict(k.plan)
        _, args = made[k.name]
        prefetch = args[4] == "true"
        # the plan's rule: bf16 prefetches, fp32 does not, in both layouts
        assert prefetch == (k.dtype in plan.PREFETCH_DTYPES), k.name
        # a warp-per-row kernel loops over several rows a warp where it prefetches
        if p["layout"] == "warp_per_row" and "wgrad_partials" not in p:
            assert (p["grid_max"] is not None) == prefetch, k.name


def test_fp32_reread_kernels_cache_ten_groups_and_do_not_prefetch():
    shape = plan.block_shape("f32", sweeps=2, cached=1, weights=False, wgrad=False, forward=False)
    assert (shape.slots, shape.prefetch) == (plan.BLOCK_REREAD_GROUPS["f32"], False)


@pytest.mark.parametrize("name", ["softmax", "log_softmax", "cross_entropy"])
def test_block_kernels_of_ops_with_online_sums_use_the_online_impl(name):
    source = render_op(derive(load_op(name)), "header").source
    for kernel, (impl, args) in _instantiations(source).items():
        block = "_block_" in kernel
        assert impl.endswith("_online") == block, (kernel, impl)
        assert args[1] == ("false" if block else "true"), kernel


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
    rendered = render_op(derive(load_spec(tmp_path / "sumexp.yaml")), "header")
    impls = _impls(rendered.source)
    assert impls == ["sumexp_forward", "sumexp_forward_online", "sumexp_backward",
                     "sumexp_fwdbwd", "sumexp_fwdbwd_online"], impls
    made = _instantiations(rendered.source)
    assert sorted(made) == sorted(k.name for k in rendered.kernels)
    for dt in plan.DTYPES:
        assert made[f"sumexp_backward_{dt}"][0] == "sumexp_backward"
        assert made[f"sumexp_backward_block_{dt}"][0] == "sumexp_backward"
        assert made[f"sumexp_forward_block_{dt}"][0] == "sumexp_forward_online"
