"""cuBLAS on a handle of the model's own, called through ctypes.

CuPy's cuBLAS wrappers set the handle's stream before every call, and refuse to while the
stream captures a CUDA graph; setting a stream also puts cuBLAS back on its default
workspace, which it may allocate during a capture. A captured training step
(runtime/train/step_graph.py) needs GEMMs and a norm on the capturing stream, over a workspace
the memory plan holds, and the uncaptured step the same algorithms (cuBLAS picks them by
the workspace it has), so its results are the same bits. So these calls go straight to
the libcublas CuPy loaded, on a handle that follows CuPy's current stream when that
changes, the planned workspace set again after each change.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import weakref

import numpy as np

from eulergen.errors import EulerError

# cuBLAS's recommended workspace on Hopper (its docs: 32 MiB on sm_90, 4 MiB before)
WORKSPACE_BYTES = 32 << 20
POINTER_MODE_HOST, POINTER_MODE_DEVICE = 0, 1   # cublas_api.h

_P, _I, _S = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
_SIGNATURES = {
    "cublasCreate_v2": (ctypes.POINTER(_P),),
    "cublasDestroy_v2": (_P,),
    "cublasSetStream_v2": (_P, _P),
    "cublasSetWorkspace_v2": (_P, _P, _S),
    "cublasSetPointerMode_v2": (_P, _I),
    "cublasSnrm2_v2": (_P, _I, _P, _I, _P),
    "cublasSdot_v2": (_P, _I, _P, _I, _P, _I, _P),
    "cublasGemmEx": (_P, _I, _I, _I, _I, _I, _P, _P, _I, _I, _P, _I, _I, _P, _P, _I, _I, _I, _I),
}
_lib = None


def _library():
    """The libcublas CuPy loaded (the one its handles and streams belong to)."""
    global _lib
    if _lib is None:
        import cupy
        cupy.cuda.device.get_cublas_handle()   # CuPy loads libcublas for its own handle
        with open("/proc/self/maps") as maps:
            loaded = [line.split()[-1] for line in maps if "/libcublas.so" in line]
        path = loaded[0] if loaded else ctypes.util.find_library("cublas")
        if path is None:
            raise EulerError("cannot find the libcublas CuPy uses", key="cublas")
        lib = ctypes.CDLL(path)
        for name, args in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        _lib = lib
    return _lib


def _check(status: int, call: str) -> None:
    if status:
        raise EulerError(f"{call} failed with cuBLAS status {status}", key="cublas")


class Cublas:
    """One cuBLAS handle, destroyed with this object. `workspace`: a device array (kept
    alive here) that cuBLAS uses for its scratch on every stream; None: its default."""

    def __init__(self, workspace=None):
        self.lib = _library()
        handle = _P()
        _check(self.lib.cublasCreate_v2(ctypes.byref(handle)), "cublasCreate")
        self.handle = handle.value
        self.workspace = workspace
        self._stream = None
        weakref.finalize(self, self.lib.cublasDestroy_v2, self.handle)

    def ready(self) -> int:
        """The handle, on CuPy's current stream (and its workspace, which a stream change
        resets)."""
        import cupy
        stream = cupy.cuda.get_current_stream().ptr
        if stream != self._stream:
            _check(self.lib.cublasSetStream_v2(self.handle, stream), "cublasSetStream")
            if self.workspace is not None:
                _check(self.lib.cublasSetWorkspace_v2(self.handle, self.workspace.data.ptr,
                                                      self.workspace.nbytes),
                       "cublasSetWorkspace")
            self._stream = stream
        return self.handle

    def gemm_ex(self, *args) -> None:
        """cublasGemmEx with every argument but the handle, in its order."""
        _check(self.lib.cublasGemmEx(self.ready(), *args), "cublasGemmEx")

    def nrm2(self, x, out) -> None:
        """out[0] = ‖x‖₂ of a contiguous float32 vector, written on the device: no host
        read, so it may be captured."""
        self._on_device("cublasSnrm2", x, out, lambda h: self.lib.cublasSnrm2_v2(
            h, x.size, x.data.ptr, 1, out.data.ptr))

    def dot(self, x, y, out) -> None:
        """out[0] = x·y of two contiguous float32 vectors of one size, written on the device."""
        if x.size != y.size:
            raise ValueError(f"dot of {x.size} and {y.size} elements")
        self._on_device("cublasSdot", x, out, lambda h: self.lib.cublasSdot_v2(
            h, x.size, x.data.ptr, 1, y.data.ptr, 1, out.data.ptr), y)

    def _on_device(self, call: str, x, out, run, *more) -> None:
        """A reduction whose result cuBLAS writes to device memory (its device pointer mode,
        then back to host mode for the GEMMs' host scalars)."""
        for a in (x, out, *more):
            if a.dtype != np.float32 or not a.flags.c_contiguous:
                raise ValueError(f"{call} wants contiguous float32 arrays, got {a.dtype} "
                                 f"{a.strides}")
        handle = self.ready()
        _check(self.lib.cublasSetPointerMode_v2(handle, POINTER_MODE_DEVICE), "cublasSetPointerMode")
        try:
            _check(run(handle), call)
        finally:
            self.lib.cublasSetPointerMode_v2(handle, POINTER_MODE_HOST)
