"""Reading manifests: good ones become frozen entries, bad ones name file and key."""
from __future__ import annotations

import json

import pytest

from eulergen.errors import EulerError
from eulergen.launch import Pointwise
from eulergen.runtime.engine.manifest import FORMAT, load_manifest

POINTWISE = {"shape": "pointwise", "threads": 256, "vec": 4, "unroll": 1}
GOOD = {"format": FORMAT, "generator": "0.1.0", "ops": {"gelu": {
    "kind": "pointwise", "spec": "ops/gelu.yaml", "spec_sha256": "ab" * 32,
    "inputs": [{"name": "x", "role": "elem", "differentiable": True}],
    "outputs": [{"name": "y", "role": "elem"}], "params": {},
    "numpy": "numpy/gelu.py", "cuda": "cuda/gelu.cu", "cuda_sha256": "cd" * 32,
    "kernels": {"gelu_forward_f32": {"args": [["x", "const float*"], ["y", "float*"],
                                              ["n", "long long"]],
                                     "dtype": "f32", "stage": "forward", "geometry": POINTWISE},
                "gelu_backward_bf16": {"args": [], "dtype": "bf16", "stage": "backward",
                                       "geometry": {**POINTWISE, "vec": 8}}}}}}


def write(tmp_path, data):
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


def test_a_good_manifest_gives_entries_with_paths_beside_it(tmp_path):
    m = load_manifest(write(tmp_path, GOOD))
    gelu = m.ops["gelu"]
    assert gelu.numpy == tmp_path.resolve() / "numpy/gelu.py"
    assert gelu.cuda == tmp_path.resolve() / "cuda/gelu.cu"
    assert gelu.grads == ("x",)
    k = gelu.kernel("forward", "f32")
    assert k.args[0] == ("x", "const float*")
    assert k.geometry == Pointwise(threads=256, vec=4, unroll=1)
    assert k.geometry.launch(4096).grid == (4,)
    assert gelu.kernel("backward", "bf16").name == "gelu_backward_bf16"


def test_a_missing_kernel_lists_the_kernels_there_are(tmp_path):
    gelu = load_manifest(write(tmp_path, GOOD)).ops["gelu"]
    with pytest.raises(EulerError, match="no backward kernel for dtype f32 .*forward/f32"):
        gelu.kernel("backward", "f32")


def test_a_missing_manifest_says_to_build(tmp_path):
    with pytest.raises(EulerError, match="run `eulergen build`"):
        load_manifest(tmp_path / "manifest.json")


def test_bad_json_names_the_line(tmp_path):
    with pytest.raises(EulerError, match=r"manifest.json:2: not valid JSON"):
        load_manifest(write(tmp_path, '{"format": 1,\n "ops": }'))


def test_another_format_is_refused(tmp_path):
    with pytest.raises(EulerError, match="format: manifest format 1"):
        load_manifest(write(tmp_path, {**GOOD, "format": 1}))


def test_a_manifest_of_the_format_before_the_signatures_says_to_rebuild(tmp_path):
    with pytest.raises(EulerError, match=r"format: manifest format 2, this runtime reads 3 "
                                         r"\(rebuild with `eulergen build`\)"):
        load_manifest(write(tmp_path, {**GOOD, "format": 2}))


def test_a_kernel_without_its_stage_names_the_key_and_says_to_rebuild(tmp_path):
    data = json.loads(json.dumps(GOOD))
    del data["ops"]["gelu"]["kernels"]["gelu_forward_f32"]["stage"]
    with pytest.raises(EulerError, match=r"ops\.gelu\.kernels\.gelu_forward_f32\.stage: missing "
                                         r"key 'stage' \(rebuild"):
        load_manifest(write(tmp_path, data))


@pytest.mark.parametrize("geometry,fault", [
    ({**POINTWISE, "shape": "pointwize"}, "unknown shape 'pointwize'"),
    ({**POINTWISE, "threds": 1}, "pointwise: unknown field 'threds'"),
    ({"shape": "pointwise", "threads": 256}, "pointwise: missing field 'vec'"),
    (None, "should be an object with a 'shape'")])
def test_a_bad_geometry_names_the_kernel_and_the_fault(tmp_path, geometry, fault):
    data = json.loads(json.dumps(GOOD))
    data["ops"]["gelu"]["kernels"]["gelu_forward_f32"]["geometry"] = geometry
    with pytest.raises(EulerError, match=rf"ops\.gelu\.kernels\.gelu_forward_f32\.geometry: {fault}"):
        load_manifest(write(tmp_path, data))


def test_a_bad_kernel_dtype_names_the_key(tmp_path):
    data = json.loads(json.dumps(GOOD))
    data["ops"]["gelu"]["kernels"]["gelu_forward_f32"]["dtype"] = "f16"
    with pytest.raises(EulerError, match=r"ops\.gelu\.kernels\.gelu_forward_f32\.dtype"):
        load_manifest(write(tmp_path, data))


def test_an_operand_without_a_role_names_the_key(tmp_path):
    data = json.loads(json.dumps(GOOD))
    del data["ops"]["gelu"]["inputs"][0]["role"]
    with pytest.raises(EulerError, match=r"ops\.gelu\.inputs\[0\]: missing key 'role'"):
        load_manifest(write(tmp_path, data))


def test_a_pair_op_lists_its_index_roles_and_a_bad_list_names_the_key(tmp_path):
    from eulergen.runtime.engine.ops import BUILTIN_MANIFEST
    rope = load_manifest(BUILTIN_MANIFEST).ops["rope"]
    assert rope.index == {"pos": "position", "k": "pair", "D": "head_dim"}
    assert load_manifest(write(tmp_path, GOOD)).ops["gelu"].index == {}
    data = json.loads(json.dumps(GOOD))
    data["ops"]["gelu"]["index"] = ["pos"]
    with pytest.raises(EulerError, match=r"ops\.gelu\.index: index should be an object"):
        load_manifest(write(tmp_path, data))


def test_an_update_op_s_rest_op_is_read_and_a_matrix_step_without_one_names_the_op(tmp_path):
    """lion's `rest: adamw` comes through the built manifest; a matrix step needs a rest op
    (the 1-D parameters are no matrices), refused naming the op's key."""
    from eulergen.runtime.engine.ops import BUILTIN_MANIFEST
    ops = load_manifest(BUILTIN_MANIFEST).ops
    assert (ops["lion"].rest, ops["muon"].rest, ops["adamw"].rest) == ("adamw", "adamw", None)
    data = json.loads(BUILTIN_MANIFEST.read_text())
    del data["ops"]["muon"]["rest"]
    with pytest.raises(EulerError, match=r"ops\.muon: an op with a matrix step needs 'rest'"):
        load_manifest(write(tmp_path, data))
    data["ops"]["muon"]["rest"] = ["adamw"]
    with pytest.raises(EulerError, match=r"ops\.muon\.rest: 'rest' should be str, got list"):
        load_manifest(write(tmp_path, data))
