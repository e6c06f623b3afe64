"""Which array library runs the ops: numpy on the CPU or CuPy on a CUDA GPU.

`get_backend("auto")` is what commands use: a GPU when CuPy imports and sees a device,
else numpy with a one-line notice saying why, so a run on a laptop still works."""
from __future__ import annotations

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


def get_backend(kind: str = "auto", *, notice=None) -> Backend:
    """'numpy', 'cuda' (EulerError if CuPy or a GPU is missing) or 'auto'.

    `notice` receives the one line printed when 'auto' falls back to numpy (default:
    stderr), so the CLI and tests can route it."""
    if kind == "numpy":
        return NUMPY
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
        return NUMPY
