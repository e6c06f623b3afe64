"""The plans of pointwise, pair, update and embedding ops (generator/plan.py), inspected
without rendering: stages, pointer operands, signatures and geometry; and every entry point
of a generated .cu of those kinds declares exactly the parameters its signature lists."""
from __future__ import annotations

import re

import pytest

from eulergen import GENERATED_DIR, launch
from eulergen.generator import plan as planner, plan_ops
from eulergen.generator.derive import derive
from eulergen.generator.kinds import embedding
from eulergen.generator.ops_path import find_ops
from eulergen.generator.spec import load_spec
from eulergen.runtime.engine.manifest import load_manifest

MANIFEST = load_manifest(GENERATED_DIR / "manifest.json")


def _plan(name: str):
    return plan_ops.plan_op(derive(load_spec(find_ops()[name])))


def test_a_pointwise_plan_has_a_stage_per_pass_with_the_dtype_tiles():
    plan = _plan("swiglu")
    assert [(st.name, st.loads, st.stores) for st in plan.stages] == [
        ("swiglu_forward", ("a", "b"), ("y",)),
        ("swiglu_backward", ("a", "b", "dy"), ("da", "db"))]
    for st in plan.stages:
        assert [sig.dtype for sig in st.sigs] == list(planner.DTYPES)
        for sig in st.sigs:
            t = planner.CTYPE[sig.dtype]
            assert sig.args == tuple((n, f"const {t}*") for n in st.loads) + tuple(
                (n, f"{t}*") for n in st.stores) + (("n", "long long"),)
            assert isinstance(sig.geometry, launch.Pointwise)
            assert (sig.geometry.threads, sig.geometry.unroll) == planner.POINTWISE_TILE[sig.dtype]


def test_a_pointwise_backward_reads_the_forward_outputs_its_formula_reuses():
    op = derive(load_spec(find_ops()["silu"]))
    (_, bwd) = plan_ops.plan_op(op).stages
    reused = [o.name for o in op.outputs if o.name in op.body.backward.uses]
    assert bwd.loads == tuple(["x"] + reused + ["dy"])


def test_a_pair_plan_passes_three_strides_a_pointer_then_the_sizes():
    fwd = _plan("rope").stages[0]
    sig = fwd.sigs[0]
    assert [n for n, _ in sig.args] == ["x", "x_sb", "x_st", "x_sh", "y", "y_sb", "y_st", "y_sh",
                                        "base", "B", "T", "H", "D", "pos0"]
    assert sig.geometry == planner.pair_launch(sig.dtype)


def test_an_update_plan_keeps_state_float32_and_grads_in_the_storage_dtype():
    (step,) = _plan("adamw").stages
    assert step.stores == ("p", "m", "v")
    bf16 = step.sigs[1]
    assert bf16.name == "adamw_step_bf16" and bf16.stage == "step"
    assert dict(bf16.args)["g"] == "const __nv_bfloat16*"
    assert dict(bf16.args)["p"] == dict(bf16.args)["m"] == "float*"
    assert bf16.geometry.vec == 8


def test_an_update_step_reads_its_runtime_params_from_a_control_array_and_bf16_writes_a_copy():
    """lr and step are no scalar arguments (a captured step replays with new ones): the
    kernels read them, the skip flag and the gradient scale from `control`; the bf16 entry
    point also takes the weight's bf16 copy, and so does the autocast one, of float32
    grads, whose vectors are the copy's 8 elements (whole 16-byte stores)."""
    f32, bf16, autocast = _plan("adamw").stages[0].sigs
    for sig in (f32, bf16, autocast):
        assert sig.control == ("skip", "grad_scale", "lr", "step")
        assert dict(sig.args)["control"] == "const float*"
        assert not {"lr", "step"} & set(dict(sig.args))
    assert dict(bf16.args)["p_bf16"] == "__nv_bfloat16*" and "p_bf16" not in dict(f32.args)
    assert (autocast.dtype, autocast.precision, autocast.geometry.vec) == ("f32", "autocast", 8)
    assert dict(autocast.args)["g"] == "const float*"
    assert dict(autocast.args)["p_bf16"] == "__nv_bfloat16*"
    assert MANIFEST.ops["adamw"].kernel("step", "bf16").control == bf16.control
    assert MANIFEST.ops["adamw"].kernel("step", "f32").name == f32.name   # '' before autocast


@pytest.mark.parametrize("name", sorted(n for n, o in MANIFEST.ops.items() if o.kind == "update"))
def test_the_phase_of_each_update_op_that_writes_the_weight_has_an_autocast_kernel(name):
    """training.precision autocast steps with any update op: the phase that updates the
    weight (the step; a matrix op's apply) has a kernel of float32 grads that writes the
    weight's bf16 copy, which the runtime picks for float32 grads with a copy; a phase that
    never writes it (muon's step and normalize) runs its f32 kernel there and has none."""
    op = derive(load_spec(find_ops()[name]))
    weight = next(o.name for o in op.inputs if o.role == "state")
    grads = {o.name for o in op.inputs if o.role == "grad"}
    for st in _plan(name).stages:
        autocast = [sig for sig in st.sigs if sig.precision == "autocast"]
        if weight not in st.stores:
            assert autocast == [], st.name
            continue
        (sig,) = autocast
        args = dict(sig.args)
        assert sig.dtype == "f32" and args[f"{weight}_bf16"] == "__nv_bfloat16*"
        assert all(args[g] == "const float*" for g in grads & set(args))
        assert MANIFEST.ops[name].kernel("step", "f32", part=sig.part, precision="autocast") == sig


def test_the_embedding_plan_has_its_forward_and_every_backward_part_in_every_dtype():
    plan = embedding.plan_embedding()
    assert {(k.stage, k.part, k.dtype) for k in plan.sigs} == {
        ("backward" if p else "forward", p, d) for p in embedding.PARTS
        for d in planner.DTYPES}
    assert isinstance(plan.sig("wte_long", "bf16").geometry, launch.EmbeddingWteLong)


_ENTRY = re.compile(r'extern "C" __global__ void __launch_bounds__\((\d+)(?:, \d+)?\) (\w+)\((.*?)\) \{',
                    re.S)


@pytest.mark.parametrize("name", sorted(n for n, o in MANIFEST.ops.items() if o.kind != "row"))
def test_each_entry_point_declares_its_signature_and_launch_bounds(name):
    op = MANIFEST.ops[name]
    declared = {m.group(2): (int(m.group(1)), " ".join(m.group(3).split()))
                for m in _ENTRY.finditer(op.cuda.read_text())}
    assert set(declared) == set(op.kernels)
    for k in op.kernels.values():
        bounds, params = declared[k.name]
        assert params == ", ".join(f"{t} {n}" for n, t in k.args), k.name
        assert bounds == k.geometry.threads, k.name
