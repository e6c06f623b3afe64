"""Flash-attention kernels on the GPU against the numpy reference and torch SDPA.

Run on the H200: python -m pytest -m gpu tests/gpu/test_attention.py -x -q
References are float64 (torch on the GPU for causal, the generated numpy module for the
other specs) computed from the very inputs the kernel saw (bf16-rounded for bf16). fp32
storage runs split-bf16 tensor cores (~16 bits per operand), so it must agree to 1e-3
relative; bf16 must be no worse than 3x the error of torch's own bf16 SDPA (flash).
"""
from __future__ import annotations

import functools
import sys
import tempfile
import types
from pathlib import Path

import jinja2
import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
try:
    if cupy.cuda.runtime.getDeviceCount() < 1:
        raise RuntimeError("no device")
except Exception as err:  # no driver or no device: skip, never fail
    pytest.skip(f"no CUDA device ({err})", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import attention_ops  # noqa: E402

from eulergen import TEMPLATES_DIR  # noqa: E402
from eulergen.errors import EulerError  # noqa: E402
from eulergen.generator.numpy_attention import render_attention_module  # noqa: E402
from eulergen.generator.plan_attention import plan_attention  # noqa: E402
from eulergen.generator.render_attention import render_attention  # noqa: E402
from eulergen.runtime.engine.attention import (AttentionKernels, attention_backward,  # noqa: E402
                                        attention_forward)
from eulergen.runtime.engine.compile import compile_file, device_arch  # noqa: E402
from eulergen.runtime.engine.bf16 import from_bf16, to_bf16  # noqa: E402

pytestmark = pytest.mark.gpu
_FOLDER = Path(tempfile.mkdtemp(prefix="eg-attn-gpu-"))


@functools.lru_cache(maxsize=None)
def _op(name: str):
    """(kernels, numpy module) for one op: rendered, written beside the prelude, compiled."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES_DIR)))
    (_FOLDER / "eulergen_common.cuh").write_text(
        env.get_template("common.cuh.j2").render(
            header="eulergen_common.cuh, rendered for the attention tests and benchmark"))
    derived = attention_ops.load(name, _FOLDER)
    rendered = render_attention(derived, plan_attention(derived))
    cu = _FOLDER / f"{name}.cu"
    cu.write_text(rendered.source)
    compiled = compile_file(cu)
    ak = AttentionKernels(name, rendered.kernels,
                          {p.name: p.default for p in derived.params}, compiled.function,
                          device_arch())
    mod = types.ModuleType(name)
    exec(compile(render_attention_module(derived), f"{name}.py", "exec"), mod.__dict__)
    return ak, mod


def _inputs(B, T, H, KVH, D, seed):
    rng = np.random.default_rng(seed)
    shapes = [(B, T, H, D), (B, T, KVH, D), (B, T, KVH, D), (B, T, H, D)]
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def _device(a: np.ndarray, dtype: str):
    """(device array in storage dtype, the float64 values it holds)."""
    if dtype == "bf16":
        bits = to_bf16(a)
        return cupy.asarray(bits), from_bf16(bits).astype(np.float64)
    return cupy.asarray(a), a.astype(np.float64)


def _host(a, dtype: str) -> np.ndarray:
    a = cupy.asnumpy(a)
    return (from_bf16(a) if dtype == "bf16" else a).astype(np.float64)


def _rel(ours: np.ndarray, ref: np.ndarray) -> float:
    """Max abs error over max abs value: one number per tensor, meaningful at any size.
    Inputs are standard normal, so every tensor is O(1); the floor of 0.1 keeps a gradient
    that is exactly 0 in exact math (T = 1: dS = P·(dP − rowsum(dO∘O)) = 0) from turning
    rounding noise into an infinite relative error."""
    assert np.all(np.isfinite(ours)), "non-finite values"
    return float(np.max(np.abs(ours - ref)) / max(np.max(np.abs(ref)), 0.1))


def _run(name, dtype, B, T, H, KVH, D, seed=0, isa="mma", **params):
    ak, _ = _op(name)
    host = _inputs(B, T, H, KVH, D, seed)
    dev, ref = zip(*(_device(a, dtype) for a in host))
    q, k, v, do = dev
    o, lse = attention_forward(ak, q, k, v, **params)
    dq, dk, dv = attention_backward(ak, q, k, v, o, lse, do, isa=isa, **params)
    ours = {"o": _host(o, dtype), "lse": cupy.asnumpy(lse).astype(np.float64),
            "dq": _host(dq, dtype), "dk": _host(dk, dtype), "dv": _host(dv, dtype)}
    return ours, ref


def _torch_reference(ref, dtype=torch.float64):
    """Causal SDPA (GQA) on the GPU in `dtype`: o, lse and the three gradients."""
    q, k, v, do = (torch.tensor(a, device="cuda", dtype=dtype).transpose(1, 2) for a in ref)
    for t in (q, k, v):
        t.requires_grad_(True)
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    o.backward(do)
    out = {"o": o, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    out = {n: t.detach().transpose(1, 2).double().cpu().numpy() for n, t in out.items()}
    if dtype == torch.float64:  # lse from the same scores, [B, H, T]
        T, D = ref[0].shape[1], ref[0].shape[3]
        s = torch.einsum("bhid,bhjd->bhij", q.detach(),
                         k.detach().repeat_interleave(q.shape[1] // k.shape[1], 1)) * D ** -0.5
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
        out["lse"] = torch.logsumexp(s, -1).cpu().numpy()
    return out


# (storage dtype, backward kernels): mma.sync in both dtypes (every GPU), and on a Hopper
# GPU the wgmma ones (bf16), which attention_backward takes there by default.
KERNELS = [("f32", "mma"), ("bf16", "mma"), ("bf16", "wgmma")]


def _isa(isa: str) -> str:
    if isa == "wgmma" and cupy.cuda.Device().compute_capability != "90":
        pytest.skip("wgmma kernels run on sm_90 only")
    return isa


@pytest.mark.parametrize("dtype,isa", KERNELS)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("T", [1, 63, 64, 1000, 1024, 2048])
def test_causal_matches_torch_sdpa(T, D, dtype, isa):
    B, H, KVH = (2, 4, 2) if T <= 1024 else (1, 4, 2)
    ours, ref = _run("causal_attention", dtype, B, T, H, KVH, D, seed=T + D, isa=_isa(isa))
    exact = _torch_reference(ref)
    assert _rel(ours["lse"], exact["lse"]) < 1e-4, "lse"
    if dtype == "f32":
        for n in ("o", "dq", "dk", "dv"):
            err = _rel(ours[n], exact[n])
            assert err < 1e-3, f"T={T} D={D} f32 {n}: relative error {err:.2e}"
    else:
        peer = _torch_reference(ref, torch.bfloat16)  # torch's own bf16 error, same inputs
        for n in ("o", "dq", "dk", "dv"):
            err, peer_err = _rel(ours[n], exact[n]), _rel(peer[n], exact[n])
            assert err < 3 * peer_err + 1e-3, \
                f"T={T} D={D} bf16 {n}: error {err:.2e}, torch bf16 {peer_err:.2e}"


def _against_numpy(name, dtype, B, T, H, KVH, D, tol_f32=1e-3, tol_bf16=3e-2, isa="mma",
                   **params):
    ours, ref = _run(name, dtype, B, T, H, KVH, D, isa=_isa(isa), **params)
    _, mod = _op(name)
    q, k, v, do = ref
    o, lse = mod.forward(q, k, v, **params)
    dq, dk, dv = mod.backward(q, k, v, o, lse, do, **params)
    tol = tol_f32 if dtype == "f32" else tol_bf16
    for n, r in (("o", o), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        err = _rel(ours[n], r)
        assert err < (1e-4 if n == "lse" else tol), f"{name} T={T} D={D} {dtype} {n}: {err:.2e}"
    return ours


@pytest.mark.parametrize("dtype,isa", KERNELS)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("name", ["softcap_attention", "alibi_attention", "full_attention"])
def test_score_variants_match_numpy(name, D, dtype, isa):
    _against_numpy(name, dtype, 2, 257, 4, 2, D, isa=isa)


def test_softcap_param_reaches_the_kernel():
    # A small cap changes the result a lot; the kernel must agree with numpy at that cap.
    _against_numpy("softcap_attention", "f32", 1, 130, 2, 1, 64, cap=2.0)


@pytest.mark.parametrize("dtype,isa", KERNELS)
def test_rows_with_no_visible_key_give_zeros_not_nan(dtype, isa):
    # j < i: row 0 is empty
    ours = _against_numpy("strict_attention", dtype, 2, 100, 4, 1, 64, isa=isa)
    assert np.all(ours["o"][:, 0] == 0) and np.all(ours["lse"][:, :, 0] == 0)
    assert np.all(ours["dq"][:, 0] == 0)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_fused_qkv_views_give_the_same_bits_as_separate_arrays(dtype):
    ak, _ = _op("causal_attention")
    B, T, H, KVH, D = 2, 200, 6, 2, 64
    q, k, v, do = (_device(a, dtype)[0] for a in _inputs(B, T, H, KVH, D, 7))
    qkv = cupy.concatenate([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], -1)
    qv = qkv[:, :, :H * D].reshape(B, T, H, D)
    kv = qkv[:, :, H * D:(H + KVH) * D].reshape(B, T, KVH, D)
    vv = qkv[:, :, (H + KVH) * D:].reshape(B, T, KVH, D)
    assert not qv.flags.c_contiguous
    o1, l1 = attention_forward(ak, q, k, v)
    o2, l2 = attention_forward(ak, qv, kv, vv)
    g1 = attention_backward(ak, q, k, v, o1, l1, do)
    dqkv = cupy.zeros_like(qkv)
    g2 = attention_backward(ak, qv, kv, vv, o2, l2, do, out=(
        dqkv[:, :, :H * D].reshape(B, T, H, D), dqkv[:, :, H * D:(H + KVH) * D].reshape(B, T, KVH, D),
        dqkv[:, :, (H + KVH) * D:].reshape(B, T, KVH, D)))
    for a, b in zip((o1, l1) + tuple(g1), (o2, l2) + tuple(g2)):
        assert cupy.array_equal(a, b)
    assert cupy.array_equal(dqkv[:, :, :H * D].reshape(B, T, H, D), g1[0])


@pytest.mark.parametrize("isa", ["mma", "wgmma"])
def test_backward_is_deterministic(isa):
    ak, _ = _op("causal_attention")
    q, k, v, do = (_device(a, "bf16")[0] for a in _inputs(4, 1024, 12, 4, 64, 3))
    o, lse = attention_forward(ak, q, k, v)
    first = attention_backward(ak, q, k, v, o, lse, do, isa=_isa(isa))
    for _ in range(3):
        again = attention_backward(ak, q, k, v, o, lse, do, isa=isa)
        assert all(cupy.array_equal(a, b) for a, b in zip(first, again))


def test_hopper_takes_the_wgmma_backward_by_default():
    ak, _ = _op("causal_attention")
    hopper = cupy.cuda.Device().compute_capability == "90"
    assert ak.backward_isa("bf16", 64) == ("wgmma" if hopper else "mma")
    assert ak.backward_isa("f32", 64) == "mma"


def test_bad_shapes_and_dtypes_are_refused_before_launch():
    ak, _ = _op("causal_attention")
    q = cupy.zeros((1, 16, 4, 64), cupy.float32)
    k = cupy.zeros((1, 16, 2, 64), cupy.float32)
    with pytest.raises(EulerError, match="head dim 96 is not supported"):
        z = cupy.zeros((1, 16, 4, 96), cupy.float32)
        attention_forward(ak, z, z[:, :, :2], z[:, :, :2])
    with pytest.raises(EulerError, match="dtype"):
        attention_forward(ak, q, k.astype(cupy.uint16), k)
    with pytest.raises(EulerError, match="do not divide"):
        k3 = cupy.zeros((1, 16, 3, 64), cupy.float32)
        attention_forward(ak, q, k3, k3)
    with pytest.raises(EulerError, match="shape"):
        attention_forward(ak, q, k, k[:, :8])
    with pytest.raises(EulerError, match="unknown param"):
        attention_forward(ak, q, k, k, cap=1.0)
