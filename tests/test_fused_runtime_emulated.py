"""The CUDA side of the fused variants' calls (`fusion=`: runtime/engine/kinds/row.py, pointwise.py)
end to end without a GPU: OpLibrary on a stand-in `cupy` whose arrays are numpy arrays,
launching generated/cuda's kernels compiled by g++ over tests/cudagen_emulator into a
shared library (as tests/test_attention_runtime_emulated.py does for attention). It checks
what the GPU tests would otherwise be the first to see: which kernel a call takes (layout,
aligned or not), the arguments bound by the manifest's signatures, the
workspace carved for the partial sums, the reduce, the in-place add into the stream's
gradient, and the results against the numpy backend's fused functions."""
from __future__ import annotations

import ctypes
import functools
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import pytest

from eulergen import GENERATED_DIR
from eulergen.runtime.engine.backend import NUMPY, Backend
from eulergen.runtime.engine.kernels import bind
from eulergen.runtime.engine.bf16 import from_bf16, to_bf16
from eulergen.runtime.engine.ops import OpLibrary

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")]

EMULATOR = Path(__file__).resolve().parent / "cudagen_emulator"
_CTYPES = {np.float32: ctypes.c_float, np.int32: ctypes.c_int, np.int64: ctypes.c_longlong,
           np.uint64: lambda p: ctypes.c_void_p(int(p))}   # bind's null pointer
TOL = {"f32": 1e-5, "bf16": 2.0 ** -8}


class FakeArray(np.ndarray):
    """A numpy array dressed as a CuPy one on device 0."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data, device_id=0)


def _fake_cupy() -> types.ModuleType:
    cupy = types.ModuleType("cupy")
    cupy.ndarray = FakeArray
    cupy.empty = lambda shape, dtype: np.empty(shape, dtype).view(FakeArray)
    cupy.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDevice=lambda: 0))
    return cupy


@functools.lru_cache(maxsize=None)
def _library(op: str) -> ctypes.CDLL:
    """The op's .cu with a C entry `emu_<kernel>(gx, gy, bx, by, args…)` per kernel, built
    at -O0 as test_cuda_emulated's runners are (a third of -O1's build time)."""
    import json
    kernels = json.loads((GENERATED_DIR / "manifest.json").read_text())["ops"][op]["kernels"]
    folder = Path(tempfile.mkdtemp(prefix=f"eg-fused-rt-{op}-"))
    for f in ("eulergen_common.cuh", f"{op}.cu"):
        shutil.copy(GENERATED_DIR / "cuda" / f, folder / f)
    lines = [f'#include "{op}.cu"']
    for name, k in kernels.items():
        params = ", ".join(f"{ct} a{n}" for n, (_, ct) in enumerate(k["args"]))
        call = ", ".join(f"a{n}" for n in range(len(k["args"])))
        lines.append(f'extern "C" void emu_{name}(unsigned gx, unsigned gy, unsigned bx, '
                     f"unsigned by, {params}) {{ emu_launch_2d(dim3(gx, gy), dim3(bx, by), "
                     f"[=] {{ {name}({call}); }}); }}")
    (folder / "lib.cpp").write_text("\n".join(lines) + "\n")
    done = subprocess.run(["g++", "-std=c++17", "-O0", "-w", "-shared", "-fPIC",
                           f"-I{EMULATOR}", "-o", "lib.so", "lib.cpp"], cwd=folder,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    return ctypes.CDLL(str(folder / "lib.so"))


class FakeLauncher:
    """Binds a launch's values by the manifest's signature, as the GPU's Launcher does, and
    runs the kernel in the emulator; it records the kernels launched."""

    def __init__(self, op, launched: list):
        self.op, self.lib, self.launched = op, _library(op.name), launched

    def launch(self, kernel, at, values, *, contiguous: bool = True) -> None:
        args = bind(self.op, kernel, values, contiguous=contiguous)
        threads = int(np.prod(at.block))
        assert threads <= kernel.geometry.threads, f"{kernel.name}: block {at.block}"
        cargs = [ctypes.c_void_p(a.ctypes.data) if isinstance(a, np.ndarray)
                 else _CTYPES[type(a)](a) for a in args]
        gx, gy = (tuple(at.grid) + (1,))[:2]
        bx, by = (tuple(at.block) + (1,))[:2]
        getattr(self.lib, f"emu_{kernel.name}")(*(ctypes.c_uint(v) for v in (gx, gy, bx, by)),
                                                *cargs)
        self.launched.append(kernel.name)


@pytest.fixture(scope="module")
def libs():
    mp = pytest.MonkeyPatch()
    mp.setitem(sys.modules, "cupy", _fake_cupy())
    gpu = OpLibrary(Backend("cuda", np, True, "emulated (sm_90)", 90))
    launched: list = []
    gpu._cuda.launcher = lambda op: FakeLauncher(op, launched)
    yield gpu, OpLibrary(NUMPY), launched
    mp.undo()


def _dev(a: np.ndarray, dtype: str, shift: int = 0) -> FakeArray:
    """`a` stored in the dtype, `shift` elements into its buffer."""
    stored = to_bf16(a.astype(np.float32)) if dtype == "bf16" else a.astype(np.float32)
    flat = np.empty(stored.size + shift, stored.dtype).view(FakeArray)
    view = flat[shift:].reshape(stored.shape)
    view[...] = stored
    return view


def _host(a, dtype: str) -> np.ndarray:
    a = np.asarray(a)
    return (from_bf16(a) if dtype == "bf16" else a).astype(np.float64)


def _values(rng, shape, dtype: str) -> np.ndarray:
    """float64 values the storage dtype holds exactly."""
    return _host(_dev(rng.uniform(-2, 2, shape), dtype), dtype)


def _close(got, want, dtype: str, what: str, tol=None) -> None:
    got = _host(got, dtype)
    scale = max(float(np.abs(want).max()), 1e-30)
    err = float(np.abs(got - want).max())
    assert err <= (tol or TOL[dtype]) * scale * 4, f"{what}: error {err / scale:.2e}"


# 17 columns: rows off 16-byte boundaries (the `_unaligned` kernels); 24: on them. Short
# rows: the reduce launches 1024 threads a block per 8 columns, each an emulated fiber
# (test_fused_emulated.py runs the block layouts' and the split backward's kernels).
@pytest.mark.parametrize("cols,dtype", [(17, "f32"), (24, "bf16")])   # both kernels, both dtypes
def test_a_norm_s_add_fusion_through_the_cuda_calls(libs, cols, dtype):
    gpu, ref, launched = libs
    op = gpu.op("rmsnorm")
    rows = 37
    rng = np.random.default_rng(cols)
    x, branch, dy, dh = (_values(rng, (rows, cols), dtype) for _ in range(4))
    w = _values(rng, (cols,), dtype)
    launched.clear()
    h, y = gpu.forward(op, _dev(x, dtype), _dev(branch, dtype), _dev(w, dtype), fusion="add")
    want_h, want_y = ref.forward("rmsnorm", x, branch, w, fusion="add")
    _close(h, want_h, dtype, "_stream")
    _close(y, want_y, dtype, "y")
    variant = "" if cols % 8 == 0 else "_unaligned"
    assert launched == [f"rmsnorm_forward_add{variant}_{dtype}"]

    stream = _dev(dh, dtype)
    need = gpu.workspace_elements(op, "backward", (rows, cols), dtype=dtype, fusion="add")
    workspace = np.empty(need, np.float32).view(FakeArray)
    dw = _dev(np.zeros(cols), dtype)
    launched.clear()
    gpu.backward(op, _dev(_host(h, dtype), dtype), _dev(w, dtype), _dev(dy, dtype), stream,
                 out=(stream, dw), workspace=workspace, fusion="add")
    want_dx, want_dw = ref.backward("rmsnorm", _host(h, dtype), w, dy, dh, fusion="add")
    _close(stream, want_dx, dtype, "dx (added in place into d_stream)")
    _close(dw, want_dw, dtype, "dw")
    assert launched == [f"rmsnorm_backward_add{variant}_{dtype}", f"rmsnorm_wgrad_reduce_{dtype}"]


@pytest.mark.parametrize("shift,dtype", [(0, "f32"), (1, "bf16")])   # both kernels, both dtypes
def test_a_gated_activation_s_bias_fusion_through_the_cuda_calls(libs, shift, dtype):
    """Arrays one element into their buffers take the `_unaligned` kernels."""
    gpu, ref, launched = libs
    op = gpu.op("swiglu")
    rows, cols = 29, 40
    rng = np.random.default_rng(shift)
    a, b, dy = (_values(rng, (rows, cols), dtype) for _ in range(3))
    ba, bb = (_values(rng, (cols,), dtype) for _ in range(2))
    ins = [_dev(v, dtype, shift) for v in (a, b, ba, bb)]
    launched.clear()
    y = _dev(np.zeros((rows, cols)), dtype, shift)
    gpu.forward(op, *ins, out=y, fusion="bias")
    _close(y, ref.forward("swiglu", a, b, ba, bb, fusion="bias"), dtype, "y")
    variant = "_unaligned" if shift else ""
    assert launched == [f"swiglu_forward_bias{variant}_{dtype}"]

    need = gpu.workspace_elements(op, "backward", (rows, cols), dtype=dtype, fusion="bias")
    assert need > 0
    launched.clear()
    grads = gpu.backward(op, *ins, _dev(dy, dtype, shift),
                         workspace=np.empty(need, np.float32).view(FakeArray), fusion="bias")
    want = ref.backward("swiglu", a, b, ba, bb, dy, fusion="bias")
    for name, got, w in zip(("da", "db", "d_bias_a", "d_bias_b"), grads, want):
        _close(got, w, dtype, name)
    assert launched == [f"swiglu_backward_bias{variant}_{dtype}"] + [f"swiglu_reduce_bias_{dtype}"] * 2


def test_a_norm_s_autocast_calls_take_its_float32_stream_and_write_float32_gradients(libs):
    """precision="autocast" (runtime/engine/kinds/row.py): the add fusion's forward over the
    float32 stream and a bf16 branch, its outputs allocated in the kernel's types (the sum
    float32, y bf16); its backward adds dx into the float32 d_stream, writes the bf16 copy
    and the float32 weight gradient through the reduce of float32; the op's own backward
    (no copy: none written) allocates dw in its weight's float32."""
    gpu, ref, launched = libs
    op = gpu.op("rmsnorm")
    rows, cols = 37, 24
    rng = np.random.default_rng(5)
    x, dh = (_values(rng, (rows, cols), "f32") for _ in range(2))
    branch, dy = (_values(rng, (rows, cols), "bf16") for _ in range(2))
    w = _values(rng, (cols,), "f32")
    launched.clear()
    h, y = gpu.forward(op, _dev(x, "f32"), _dev(branch, "bf16"), _dev(w, "f32"), fusion="add",
                       precision="autocast")
    assert (h.dtype, y.dtype) == (np.float32, np.uint16)
    want_h, want_y = ref.forward("rmsnorm", x, branch, w, fusion="add")
    _close(h, want_h, "f32", "_stream")
    _close(y, want_y, "bf16", "y")
    assert launched == ["rmsnorm_forward_add_autocast_bf16"]

    stream, dw = _dev(dh, "f32"), _dev(np.zeros(cols), "f32")
    copy = np.zeros((rows, cols), np.uint16).view(FakeArray)
    need = gpu.workspace_elements(op, "backward", (rows, cols), dtype="bf16", fusion="add",
                                  precision="autocast")
    launched.clear()
    gpu.backward(op, _dev(_host(h, "f32"), "f32"), _dev(w, "f32"), _dev(dy, "bf16"), stream,
                 out=(stream, dw), workspace=np.empty(need, np.float32).view(FakeArray),
                 fusion="add", precision="autocast", copy=copy)
    want_dx, want_dw = ref.backward("rmsnorm", _host(h, "f32"), w, dy, dh, fusion="add")
    _close(stream, want_dx, "f32", "dx (added in place into d_stream)")
    _close(dw, want_dw, "f32", "dw")
    np.testing.assert_array_equal(copy, to_bf16(np.asarray(stream)))
    assert launched == ["rmsnorm_backward_add_autocast_bf16", "rmsnorm_wgrad_reduce_f32"]

    launched.clear()
    dx, dw = gpu.backward(op, _dev(x, "f32"), _dev(w, "f32"), _dev(dy, "bf16"),
                          precision="autocast")
    assert (dx.dtype, dw.dtype) == (np.float32, np.float32)
    want_dx, want_dw = ref.backward("rmsnorm", x, w, dy)
    _close(dx, want_dx, "f32", "dx")
    _close(dw, want_dw, "f32", "dw")
    assert launched == ["rmsnorm_backward_autocast_bf16", "rmsnorm_wgrad_reduce_f32"]


def test_a_bias_gradient_in_float32_takes_the_reduce_of_its_dtype(libs):
    """autocast's float32 gradients of a bf16 activation's biases: the bf16 kernels, then the
    reduce that writes float32 (the gradient's dtype picks it)."""
    gpu, ref, launched = libs
    op = gpu.op("gelu")
    rows, cols = 29, 40
    rng = np.random.default_rng(9)
    x, dy = (_values(rng, (rows, cols), "bf16") for _ in range(2))
    b = _values(rng, (cols,), "bf16")
    dx, db = _dev(np.zeros((rows, cols)), "bf16"), _dev(np.zeros(cols), "f32")
    need = gpu.workspace_elements(op, "backward", (rows, cols), dtype="bf16", fusion="bias")
    launched.clear()
    gpu.backward(op, _dev(x, "bf16"), _dev(b, "bf16"), _dev(dy, "bf16"), out=(dx, db),
                 workspace=np.empty(need, np.float32).view(FakeArray), fusion="bias")
    want_dx, want_db = ref.backward("gelu", x, b, dy, fusion="bias")
    _close(dx, want_dx, "bf16", "dx")
    _close(db, want_db, "f32", "db", tol=TOL["bf16"])   # a sum of the bf16 kernel's terms
    assert launched == ["gelu_backward_bias_bf16", "gelu_reduce_bias_f32"]
