"""A kernel's signature is one value from the planner through manifest.json to the launch
(eulergen/signature.py): what the plan made is what the runtime reads back, and kernels are
found by what they are (stage, dtype, part, fusion, geometry), never by their names."""
from __future__ import annotations

import json

import pytest

from eulergen import GENERATED_DIR
from eulergen.generator import registry
from eulergen.generator.derive import derive
from eulergen.generator.ops_path import find_ops
from eulergen.generator.kinds.embedding import plan_embedding
from eulergen.generator.plan_ops import plan_op
from eulergen.generator.spec import load_spec
from eulergen.runtime.engine.kinds import support
from eulergen.runtime.engine.manifest import load_manifest
from eulergen.signature import BadSignature, KernelSig, select

MANIFEST = load_manifest(GENERATED_DIR / "manifest.json")


def _sigs(name: str) -> tuple[KernelSig, ...]:
    if name == "embedding":
        return plan_embedding().sigs
    if name in support.NAMES:   # the runtime's own kernels: kinds without a spec
        return registry.kind(name).sigs()
    plan = plan_op(derive(load_spec(find_ops()[name])))
    return plan.signatures if hasattr(plan, "signatures") else plan.sigs


@pytest.mark.parametrize("name", ["rmsnorm", "gelu", "adamw", "rope", "causal_attention",
                                  "embedding", *support.NAMES])
def test_the_manifest_reads_back_the_plans_signatures_as_the_same_values(name):
    planned = _sigs(name)
    assert tuple(MANIFEST.ops[name].kernels.values()) == planned
    for sig in planned:
        assert KernelSig.from_json(sig.name, json.loads(json.dumps(sig.to_json()))) == sig


def test_select_finds_a_kernel_by_stage_dtype_part_fusion_and_geometry():
    kernels = MANIFEST.ops["rmsnorm"].kernels.values()
    found = select(kernels, "backward", "bf16", part="rows", fusion="add", aligned=False)
    assert [k.name for k in found] == ["rmsnorm_backward_rows_add_block_unaligned_bf16"]
    assert {k.part for k in select(kernels, "backward", "f32")} == {""}
    assert [k.name for k in select(MANIFEST.ops["causal_attention"].kernels.values(),
                                   "backward", "f32", part="dq", head_dim=128)] == [
        "causal_attention_backward_dq_d128_f32"]
    # a precision variant only where asked for: its operands' C types are its own
    autocast = select(kernels, "backward", "bf16", part="rows", fusion="add",
                      precision="autocast", aligned=False)
    assert [k.name for k in autocast] == ["rmsnorm_backward_rows_add_autocast_block_unaligned_bf16"]
    assert dict(autocast[0].args)["d_stream"] == "const float*"
    assert dict(autocast[0].args)["dy"] == "const __nv_bfloat16*"


@pytest.mark.parametrize("change,key", [({"dtype": "f16"}, "dtype"), ({"stage": 1}, "stage"),
                                        ({"args": [["x"]]}, "args"), ({"pass": "forward"}, "pass"),
                                        ({"geometry": {"shape": "nope"}}, "geometry"),
                                        ({"precision": "fp8"}, "precision")])
def test_a_bad_entry_names_its_field(change, key):
    good = MANIFEST.ops["gelu"].kernel("forward", "f32").to_json()
    with pytest.raises(BadSignature) as err:
        KernelSig.from_json("gelu_forward_f32", {**good, **change})
    assert err.value.key == key
