"""runtime/engine/attention.py end to end without a GPU: a stand-in `cupy` whose arrays are numpy
arrays and whose kernels are the generated .cu compiled by g++ into a shared library over
tests/attention_emulator/. This checks what the GPU tests would otherwise be the first to
see: argument order and C types against the rendered signatures, strides of views into a
fused qkv buffer, launch grids, the shared-memory opt-in, and the results."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import jinja2
import numpy as np
import pytest

from eulergen import TEMPLATES_DIR
from eulergen.errors import EulerError
from eulergen.generator.numpy_attention import render_attention_module
from eulergen.generator.plan_attention import plan_attention
from eulergen.generator.render_attention import render_attention
from eulergen.launch import AttentionRowdot
from eulergen.runtime.engine.bf16 import from_bf16, to_bf16

import attention_ops

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")]

EMULATOR = Path(__file__).resolve().parent / "attention_emulator"
CONFIGS = ((64, "f32"), (64, "bf16"))
_CTYPES = {"int": ctypes.c_int, "long long": ctypes.c_longlong, "float": ctypes.c_float}
_SCALARS = {"int": np.int32, "long long": np.int64, "float": np.float32}


class FakeArray(np.ndarray):
    """A numpy array dressed as a CuPy one: `.data.ptr` is its address."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)


def _fake_cupy() -> types.ModuleType:
    cupy = types.ModuleType("cupy")
    cupy.ndarray = FakeArray
    cupy.empty = lambda shape, dtype: np.empty(shape, dtype).view(FakeArray)
    return cupy


class FakeKernel:
    """A kernel of the shared library: checks the launch against the signature, then runs."""

    def __init__(self, lib, sig):
        self.sig = sig
        self.fn = getattr(lib, f"emu_{sig.name}")
        self.max_dynamic_shared_size_bytes = 48 * 1024

    def __call__(self, grid, block, args, shared_mem=0):
        assert len(args) == len(self.sig.args), f"{self.sig.name}: {len(args)} arguments"
        assert block == (self.sig.geometry.threads,) and len(grid) in (1, 3)
        g = self.sig.geometry
        smem = 0 if isinstance(g, AttentionRowdot) else g.smem_bytes
        assert shared_mem == smem <= self.max_dynamic_shared_size_bytes
        cargs = []
        for (name, ctype), value in zip(self.sig.args, args):
            if ctype.endswith("*"):   # an array, or None for NULL (decode's kn, vn)
                assert value is None or isinstance(value, FakeArray), \
                    f"{self.sig.name}: {name} is not an array"
                cargs.append(ctypes.c_void_p(0 if value is None else value.data.ptr))
            else:
                assert type(value) is _SCALARS[ctype], f"{self.sig.name}: {name} is {type(value)}"
                cargs.append(_CTYPES[ctype](value))
        gx, gy, gz = (tuple(grid) + (1, 1))[:3]
        self.fn(ctypes.c_uint(gx), ctypes.c_uint(gy), ctypes.c_uint(gz),
                ctypes.c_uint(block[0]), *cargs)


def _library(name: str, folder: Path, **plan):
    """`plan`: more keywords of plan_attention (tiles, roles)."""
    derived = attention_ops.load(name, folder)
    rendered = render_attention(derived, plan_attention(derived, configs=CONFIGS, **plan),
                                templates=jinja2.FileSystemLoader(str(EMULATOR)))
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES_DIR)))
    (folder / "eulergen_common.cuh").write_text(
        env.get_template("common.cuh.j2").render(header="prelude (CPU emulation)"))
    (folder / f"{name}.cu").write_text(rendered.source)
    wrappers = [f'#include "{name}.cu"',
                "namespace eg_attn { alignas(16) unsigned char eg_smem[232448]; }"]
    for sig in rendered.kernels:
        params = ", ".join(f"{ct} a{n}" for n, (_, ct) in enumerate(sig.args))
        call = ", ".join(f"a{n}" for n in range(len(sig.args)))
        wrappers.append(
            f'extern "C" void emu_{sig.name}(unsigned gx, unsigned gy, unsigned gz, unsigned bx, '
            f"{params}) {{ emu_launch(dim3(gx, gy, gz), dim3(bx), [=] {{ {sig.name}({call}); }}); }}")
    (folder / "lib.cpp").write_text("\n".join(wrappers) + "\n")
    so = folder / "lib.so"
    build = subprocess.run(["g++", "-std=c++17", "-O1", "-w", "-shared", "-fPIC", "-I",
                            str(EMULATOR), "-I", str(folder), "lib.cpp", "-o", str(so)],
                           cwd=folder, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    lib = ctypes.CDLL(str(so))
    mod = types.ModuleType(name)
    exec(compile(render_attention_module(derived), f"{name}.py", "exec"), mod.__dict__)
    return rendered, derived, lib, mod


@pytest.fixture(scope="module")
def runtime(monkeypatch_module):
    monkeypatch_module.setitem(sys.modules, "cupy", _fake_cupy())
    from eulergen.runtime.engine.attention import (AttentionKernels, attention_backward,
                                            attention_forward)
    rendered, derived, lib, mod = _library("causal_attention",
                                           Path(tempfile.mkdtemp(prefix="eg-attn-rt-")))
    sigs = {k.name: k for k in rendered.kernels}
    ak = AttentionKernels("causal_attention", rendered.kernels,
                          {}, lambda name: FakeKernel(lib, sigs[name]))
    return ak, attention_forward, attention_backward, mod


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _rel(ours, ref) -> float:
    """Max abs error over max abs value, floored at 0.1 (inputs are standard normal)."""
    assert np.all(np.isfinite(ours))
    return float(np.max(np.abs(ours - ref)) / max(np.max(np.abs(ref)), 0.1))


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_runtime_on_fused_qkv_views_matches_numpy(runtime, dtype):
    ak, forward, backward, mod = runtime
    B, T, H, KVH, D = 2, 70, 4, 2, 64
    rng = np.random.default_rng(5)
    qkv = rng.standard_normal((B, T, (H + 2 * KVH) * D)).astype(np.float32)
    do = rng.standard_normal((B, T, H, D)).astype(np.float32)
    if dtype == "bf16":
        qkv_dev, do_dev = to_bf16(qkv).view(FakeArray), to_bf16(do).view(FakeArray)
        qkv, do = from_bf16(to_bf16(qkv)), from_bf16(to_bf16(do))
    else:
        qkv_dev, do_dev = qkv.copy().view(FakeArray), do.copy().view(FakeArray)

    def split(buf):
        return (buf[..., :H * D].reshape(B, T, H, D),
                buf[..., H * D:(H + KVH) * D].reshape(B, T, KVH, D),
                buf[..., (H + KVH) * D:].reshape(B, T, KVH, D))
    q, k, v = split(qkv_dev)
    assert not q.flags.c_contiguous and isinstance(q, FakeArray)
    o, lse = forward(ak, q, k, v)
    dqkv = np.zeros_like(qkv_dev).view(FakeArray)
    backward(ak, q, k, v, o, lse, do_dev, out=split(dqkv))

    host = (lambda a: from_bf16(np.asarray(a))) if dtype == "bf16" else np.asarray
    ref_q, ref_k, ref_v = (a.astype(np.float64) for a in split(qkv))
    ref_o, ref_lse = mod.forward(ref_q, ref_k, ref_v)
    grads = mod.backward(ref_q, ref_k, ref_v, ref_o, ref_lse, do.astype(np.float64))
    tol = {"f32": 1e-3, "bf16": 3e-2}[dtype]
    assert _rel(host(o), ref_o) < tol
    assert _rel(np.asarray(lse), ref_lse) < 1e-4
    for name, ours, ref in zip(("dq", "dk", "dv"), split(host(dqkv)), grads):
        assert _rel(ours, ref) < tol, name


def test_runtime_refuses_misaligned_views_before_launch(runtime):
    ak, forward, _, _ = runtime
    buf = np.zeros((1, 8, 4 * 64 + 4), np.float32).view(FakeArray)
    q = buf[..., 4:].reshape(1, 8, 4, 64)            # base 16 bytes in: fine
    k = buf[..., 2:2 + 2 * 64].reshape(1, 8, 2, 64)  # base 8 bytes in: not 16-byte aligned
    with pytest.raises(EulerError, match="multiples of 16 bytes"):
        forward(ak, q, k, k)
