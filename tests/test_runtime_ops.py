"""OpLibrary on the numpy backend, against a small hand-written manifest and modules
(so these tests do not depend on what `eulergen build` currently produces). Their functions
take `_out=` and return arrays of their own, which the library copies into it."""
from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest

from eulergen.errors import EulerError
from eulergen.runtime.engine.backend import get_backend
from eulergen.runtime.engine.manifest import FORMAT
from eulergen.runtime.engine.ops import OpLibrary

MODULES = {
    "scale": """
        KIND = "pointwise"
        INPUTS = ("x",)
        OUTPUTS = ("y",)
        PARAMS = {"k": 2.0}
        GRADS = ("x",)

        def forward(x, k=2.0, _out=None):
            return x * k

        def backward(x, dy, k=2.0, _out=None):
            return dy * k
    """,
    "mulsplit": """
        KIND = "pointwise"
        INPUTS = ("a", "b")
        OUTPUTS = ("p", "s")
        PARAMS = {}
        GRADS = ("a", "b")

        def forward(a, b, _out=None):
            return a * b, a + b

        def backward(a, b, dp, ds, _out=None):
            return dp * b + ds, dp * a + ds
    """,
    "xent": """
        KIND = "row"
        INPUTS = ("x", "t")
        OUTPUTS = ("loss",)
        PARAMS = {}
        GRADS = ("x",)
        import numpy as np

        def forward(x, t, _out=None):
            m = x.max(-1, keepdims=True)
            lse = np.log(np.exp(x - m).sum(-1)) + m[..., 0]
            return lse - np.take_along_axis(x, t[..., None], -1)[..., 0]

        def backward(x, t, dloss, _out=None):
            p = np.exp(x - x.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            np.put_along_axis(p, t[..., None], np.take_along_axis(p, t[..., None], -1) - 1, -1)
            return p * dloss[..., None]
    """,
    "sgd": """
        KIND = "update"
        INPUTS = ("p", "g")
        OUTPUTS = ()
        PARAMS = {"lr": None}
        GRADS = ()
        CONTROL = ("skip", "grad_scale", "lr")

        def step(p, g, control):
            skip, grad_scale, lr = control
            if not skip:
                p -= lr * grad_scale * g
    """,
}

OPS = {
    "scale": {"kind": "pointwise", "inputs": [{"name": "x", "role": "elem"}],
              "outputs": [{"name": "y", "role": "elem"}], "params": {"k": 2.0}},
    "mulsplit": {"kind": "pointwise",
                 "inputs": [{"name": "a", "role": "elem"}, {"name": "b", "role": "elem"}],
                 "outputs": [{"name": "p", "role": "elem"}, {"name": "s", "role": "elem"}],
                 "params": {}},
    "xent": {"kind": "row",
             "inputs": [{"name": "x", "role": "row"},
                        {"name": "t", "role": "index", "differentiable": False}],
             "outputs": [{"name": "loss", "role": "scalar"}], "params": {}},
    "sgd": {"kind": "update",
            "inputs": [{"name": "p", "role": "state"},
                       {"name": "g", "role": "grad", "differentiable": False}],
            "outputs": [], "params": {"lr": None}},
}


def write_manifest(folder, ops=OPS, modules=MODULES):
    (folder / "numpy").mkdir(parents=True, exist_ok=True)
    for name, text in modules.items():
        (folder / "numpy" / f"{name}.py").write_text(textwrap.dedent(text))
    manifest = {"format": FORMAT, "generator": "test",
                "ops": {n: {**o, "spec": f"ops/{n}.yaml", "spec_sha256": "0" * 64,
                            "numpy": f"numpy/{n}.py", "kernels": {}} for n, o in ops.items()}}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return folder / "manifest.json"


@pytest.fixture
def lib(tmp_path):
    return OpLibrary(get_backend("numpy"), manifests=[write_manifest(tmp_path / "m")])


def test_forward_runs_the_numpy_module_with_default_and_given_params(lib):
    x = np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(lib.forward("scale", x), 2 * x)
    np.testing.assert_array_equal(lib.forward("scale", x, k=3.0), 3 * x)


def test_several_outputs_come_back_as_a_tuple_in_spec_order(lib):
    a, b = np.float32([1, 2]), np.float32([3, 4])
    p, s = lib.forward("mulsplit", a, b)
    np.testing.assert_array_equal(p, a * b)
    np.testing.assert_array_equal(s, a + b)


def test_backward_is_always_a_tuple_of_grads_in_input_order(lib):
    x, dy = np.float32([1, 2]), np.float32([5, 7])
    (dx,) = lib.backward("scale", x, dy)
    np.testing.assert_array_equal(dx, 2 * dy)
    da, db = lib.backward("mulsplit", np.float32([1]), np.float32([3]), np.float32([1]),
                          np.float32([0]))
    assert (da[0], db[0]) == (3, 1)


def test_every_call_takes_the_ops_entry_as_well_as_its_name(lib):
    """A model resolves its ops once (lib.op) and calls with the entry; it is not looked
    up again, so a name removed from the library afterwards does not matter."""
    x, dy = np.float32([1, 2]), np.float32([5, 7])
    scale, sgd = lib.op("scale"), lib.op("sgd")
    del lib.ops["scale"], lib.ops["sgd"]
    np.testing.assert_array_equal(lib.forward(scale, x, k=3.0), 3 * x)
    np.testing.assert_array_equal(lib.backward(scale, x, dy)[0], 2 * dy)
    p = np.float32([1, 1])
    lib.step(sgd, p, np.float32([1, 2]), lr=0.5)
    np.testing.assert_array_equal(p, [0.5, 0])
    with pytest.raises(EulerError, match="unknown op 'scale'"):
        lib.forward("scale", x)


def test_out_writes_into_the_given_buffers_and_returns_them(lib):
    a, b = np.float32([1, 2]), np.float32([3, 4])
    p, s = np.full(2, np.nan, np.float32), np.full(2, np.nan, np.float32)
    got = lib.forward("mulsplit", a, b, out=(p, s))
    assert got[0] is p and got[1] is s
    np.testing.assert_array_equal(p, a * b)
    y = np.empty(2, np.float32)
    assert lib.forward("scale", a, out=y) is y
    np.testing.assert_array_equal(y, 2 * a)


def test_out_with_a_wrong_shape_raises_before_writing(lib):
    y = np.zeros(3, np.float32)
    with pytest.raises(EulerError, match=r"out\[0\] has shape \(3,\)"):
        lib.forward("scale", np.float32([1, 2]), out=y)
    assert not y.any()


def test_step_updates_state_in_place_and_needs_its_runtime_params(lib):
    p, g = np.float32([1, 1]), np.float32([1, 2])
    assert lib.step("sgd", p, g, lr=0.5) is None
    np.testing.assert_array_equal(p, [0.5, 0])
    with pytest.raises(EulerError, match="needs parameter 'lr'"):
        lib.step("sgd", p, g)


def test_fused_returns_loss_and_grad_and_lets_the_grad_alias_the_logits(lib):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5)).astype(np.float32)
    t = np.array([0, 4, 2])
    dloss = np.ones(3, np.float32)
    want_loss = lib.forward("xent", x, t)
    (want_dx,) = lib.backward("xent", x, t, dloss)
    loss = np.empty(3, np.float32)
    got_loss, got_dx = lib.fused("xent", x, t, dloss, out=(loss, x))
    assert got_loss is loss and got_dx is x
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    np.testing.assert_allclose(x, want_dx, rtol=1e-6)


def test_an_unknown_op_suggests_the_nearest_name(lib):
    with pytest.raises(EulerError, match="unknown op 'scal' \\(did you mean 'scale'\\?\\)"):
        lib.forward("scal", np.float32([1]))


def test_an_unknown_param_names_the_op_and_suggests(lib):
    with pytest.raises(EulerError, match="no parameter 'kk' \\(did you mean 'k'\\?\\)"):
        lib.forward("scale", np.float32([1]), kk=1.0)


def test_the_wrong_number_of_arrays_names_what_is_expected(lib):
    with pytest.raises(EulerError, match=r"scale.backward takes 2 arrays \(x, dy\), got 1"):
        lib.backward("scale", np.float32([1]))


def test_backward_of_an_update_op_is_refused(lib):
    with pytest.raises(EulerError, match="update op"):
        lib.backward("sgd", np.float32([1]), np.float32([1]))


def test_a_precision_variant_is_for_a_kind_that_has_one(lib):
    """A row op's numpy module computes in its arrays' dtype, autocast's math; a pointwise
    op has no autocast kernels, and numpy no bf16 copy."""
    x, t = np.float32([[1, 2, 3]]), np.int32([2])
    np.testing.assert_array_equal(lib.forward("xent", x, t, precision="autocast"),
                                  lib.forward("xent", x, t))
    with pytest.raises(EulerError, match="pointwise op: it has no 'autocast' precision"):
        lib.forward("scale", np.float32([1]), precision="autocast")
    with pytest.raises(EulerError, match="copy= is a bf16 copy; the numpy backend"):
        lib.backward("xent", x, t, np.float32([1]), precision="autocast",
                     copy=np.zeros((1, 3), np.uint16))


def test_a_later_manifest_replaces_an_op_of_the_same_name(tmp_path):
    first = write_manifest(tmp_path / "a")
    modules = dict(MODULES, scale=MODULES["scale"].replace("x * k", "x * k + 1"))
    second = write_manifest(tmp_path / "b", modules=modules)
    lib = OpLibrary(get_backend("numpy"), manifests=[first, second])
    np.testing.assert_array_equal(lib.forward("scale", np.float32([1])), [3])


def test_a_stale_module_that_disagrees_with_the_manifest_is_reported(tmp_path):
    modules = dict(MODULES, scale=MODULES["scale"].replace('INPUTS = ("x",)', 'INPUTS = ("z",)'))
    lib = OpLibrary(get_backend("numpy"), manifests=[write_manifest(tmp_path, modules=modules)])
    with pytest.raises(EulerError, match="stale build"):
        lib.forward("scale", np.float32([1]))


# ---- the embedding on numpy (no generated module: runtime/engine/ops.py holds it) -----------------

def test_embedding_backward_adds_or_writes_each_gradient_as_accumulate_says(lib):
    rng = np.random.default_rng(0)
    ids = np.int32([[0, 2, 0], [1, 0, 2]])
    wte = rng.standard_normal((4, 3)).astype(np.float32)
    wpe = rng.standard_normal((5, 3)).astype(np.float32)
    dout = rng.standard_normal((2, 3, 3)).astype(np.float32)
    want_wte, want_wpe = lib.backward("embedding", ids, wte, wpe, dout)
    assert not want_wte[3].any() and not want_wpe[3:].any(), "absent ids and positions: 0"
    dwte, dwpe = np.ones_like(wte), np.ones_like(wpe)
    lib.backward("embedding", ids, wte, wpe, dout, out=(dwte, dwpe), accumulate=(True, False))
    np.testing.assert_array_equal(dwte, np.float32(1) + want_wte)
    np.testing.assert_array_equal(dwpe, want_wpe)
    lib.backward("embedding", ids, wte, wpe, dout, out=(dwte, dwpe), accumulate=True)
    np.testing.assert_allclose(dwpe, 2 * want_wpe, rtol=1e-6)


def test_embedding_ids_outside_the_table_are_refused_on_the_host(lib):
    wte = np.zeros((4, 3), np.float32)
    with pytest.raises(EulerError, match=r"ids span \[-1, 2\], the table has 4 rows"):
        lib.forward("embedding", np.int32([[2, -1]]), wte, None)
    with pytest.raises(EulerError, match=r"ids span \[0, 4\]"):
        lib.backward("embedding", np.int32([[4, 0]]), wte, None, np.zeros((1, 2, 3), np.float32))


def test_accumulate_is_refused_where_it_cannot_be_honoured(lib):
    x, dy = np.float32([1, 2]), np.float32([5, 7])
    with pytest.raises(EulerError, match="accumulate= is not for a pointwise op"):
        lib.backward("scale", x, dy, out=(np.zeros(2, np.float32),), accumulate=True)
    with pytest.raises(EulerError, match="accumulate= needs out="):
        lib.backward("embedding", np.int32([[0]]), np.zeros((1, 2), np.float32), None,
                     np.zeros((1, 1, 2), np.float32), accumulate=True)
