"""The runtime's own kernels: ops of the built-in manifest without a spec whose kernels no
OpLibrary call launches (templates/step_control.cu.j2: the step's scalars and the loss
mean; draw.cu.j2: the sampler's draw; bf16.cu.j2: the bf16 steps outside the ops;
moves.cu.j2: rows moved by device-held positions; gemv.cu.j2: the decoder's few-row
GEMMs). Each is a kind that takes no call; the module that owns the concern
(runtime/train/step_control.py, runtime/model/loss.py, runtime/generate/draw.py,
runtime/engine/bf16.py, runtime/generate/moves.py, runtime/engine/gemv.py) holds its numpy
form and launches its kernels through `launch`: found by call and dtype, compiled through
runtime/engine/compile.py's cache on first use (a warm-up, never a capture), bound and
launched by kernels.Launcher with the grid of the kernel's geometry.
"""
from __future__ import annotations

from functools import lru_cache

from eulergen.errors import EulerError
from eulergen.runtime.engine.kernels import Launcher
from eulergen.runtime.engine.kinds.base import OpKind
from eulergen.runtime.engine.manifest import BUILTIN_MANIFEST, Manifest, load_manifest

NAMES = ("step_control", "draw", "bf16", "moves", "gemv")


class Support(OpKind):
    calls = ()

    def __init__(self, name: str):
        self.name = name


KINDS = tuple(Support(name) for name in NAMES)


@lru_cache(maxsize=1)
def _manifest() -> Manifest:
    return load_manifest(BUILTIN_MANIFEST)


@lru_cache(maxsize=None)
def _launcher(name: str) -> Launcher:
    """The built-in op `name`'s Launcher, one a process (its module compiled once)."""
    op = _manifest().ops.get(name)
    if op is None:
        raise EulerError(f"no op {name!r} (a stale build: run `eulergen build`)",
                         file=str(BUILTIN_MANIFEST), key=f"ops.{name}")
    return Launcher(op)


def entry(name: str):
    """The built-in op `name`'s manifest entry (what its kernels are)."""
    return _launcher(name).op


def launch(name: str, call: str, dtype: str, values: dict, *sizes,
           contiguous: bool = True, **geometry) -> None:
    """Launch the kernel of built-in op `name` for `call` in `dtype` (whose geometry has the
    fields `geometry` gives) on CuPy's current stream, `values` by its signature's names,
    its grid its geometry's at `sizes`. `contiguous` False: the caller has checked the
    layouts its arrays need."""
    launcher = _launcher(name)
    kernel = launcher.op.kernel(call, dtype, **geometry)
    launcher.launch(kernel, kernel.geometry.launch(*sizes), values, contiguous=contiguous)
