"""Which array library runs the ops: numpy on the CPU or CuPy on a CUDA GPU.

`get_backend("auto")` is what commands use: a GPU when CuPy imports and sees a device,
else numpy with a one-line notice saying why, so a run on a laptop still works."""
from __future__ import annotations

import ctypes
import functools
import sys
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from eulergen.errors import EulerError

INSTALL_HINT = "pip install 'eulergen[cuda13]' (or 'eulergen[cuda12]' for a CUDA 12 driver)"


@dataclass(frozen=True)
class Backend:
    name: str          # 'numpy' | 'cuda'
    xp: ModuleType     # numpy or cupy
    is_gpu: bool
    device: str        # a short description for logs ("cpu", "NVIDIA H200 (sm_90)")
    sm: int = 0        # compute capability as major·10 + minor (90); 0: none or unknown

    def synchronize(self) -> None:
        """Wait for queued GPU work; timing and host reads need it, numpy does not."""
        if self.is_gpu:
            self.xp.cuda.get_current_stream().synchronize()

    def asnumpy(self, a) -> np.ndarray:
        return self.xp.asnumpy(a) if self.is_gpu else np.asarray(a)

    def asarray(self, a, dtype=None):
        return self.xp.asarray(a, dtype=dtype)


def is_cupy(a) -> bool:
    """Whether `a` is a CuPy array (without importing CuPy): which form of a helper runs."""
    return type(a).__module__.startswith("cupy")


def _cuda_backend() -> Backend:
    """The CuPy backend, or EulerError saying what is missing and what to install."""
    try:
        import cupy
    except ImportError as err:
        raise EulerError(f"CuPy is not installed ({err}); {INSTALL_HINT}",
                         key="backend.cuda") from None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:  # CUDARuntimeError without a driver, or a broken install
        raise EulerError(f"CuPy found no usable CUDA device ({err}); check the driver, "
                         f"or {INSTALL_HINT} matching it", key="backend.cuda") from None
    if count == 0:
        raise EulerError("CuPy is installed but no CUDA device is visible",
                         key="backend.cuda")
    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return Backend("cuda", cupy, True, f"{name} (sm_{dev.compute_capability})",
                   int(dev.compute_capability))


NUMPY = Backend("numpy", np, False, "cpu")


@functools.cache
def sm_count() -> int:
    """The current CUDA device's SMs (what launches that aim to fill the GPU divide by)."""
    import cupy
    return int(cupy.cuda.Device().attributes["MultiProcessorCount"])

# glibc's mallopt parameters, and the values numpy runs under (_keep_freed_memory)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD = 32 << 20    # glibc's largest; blocks past it are a rare, large array
_TRIM_THRESHOLD = 256 << 20   # freed memory kept at the heap's top before any goes back


@functools.cache
def _keep_freed_memory() -> None:
    """Keep the memory numpy frees for its next arrays. By default glibc gives a block past
    its mmap threshold (128 KiB at first, rising as such blocks are freed) back to the
    system, and trims the heap once its top holds twice that threshold free; so a step's
    temporaries of a few MiB each came back as fresh pages, a fault per 4 KiB, which in a
    VM cost a third of a CPU training step (benchmarks/RESULTS.md, "The CPU step"). Fixed
    thresholds keep them in the heap. glibc only: elsewhere (no mallopt) nothing changes."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return
    mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
    mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)


def _numpy() -> Backend:
    _keep_freed_memory()
    return NUMPY


def get_backend(kind: str = "auto", *, notice=None) -> Backend:
    """'numpy', 'cuda' (EulerError if CuPy or a GPU is missing) or 'auto'.

    `notice` receives the one line printed when 'auto' falls back to numpy (default:
    stderr), so the CLI and tests can route it."""
    if kind == "numpy":
        return _numpy()
    if kind == "cuda":
        return _cuda_backend()
    if kind != "auto":
        raise EulerError(f"unknown backend {kind!r} (expected 'auto', 'numpy' or 'cuda')",
                         key="backend")
    try:
        return _cuda_backend()
    except EulerError as err:
        line = f"eulergen: no GPU backend ({err.message}); running on numpy"
        (notice or (lambda s: print(s, file=sys.stderr)))(line)
        return _numpy()
