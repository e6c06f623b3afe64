"""The arrays of a launch besides its inputs: the outputs a call was not given (in the
storage type the kernel writes), shape checks among a call's arrays, and float32 views of a
caller's workspace for the kernels' temporaries (the op kinds' calls, runtime/engine/kinds/)."""
from __future__ import annotations

from math import prod

import numpy as np

from eulergen.errors import EulerError
from eulergen.runtime.engine.kernels import DTYPE_OF, parse_ctype
from eulergen.runtime.engine.manifest import OpEntry
from eulergen.signature import KernelSig


def outputs(kernel: KernelSig, names, shapes, given, op: OpEntry, call: str) -> tuple:
    """The caller's `out` arrays (shape-checked here, dtype-checked in bind) or new ones in
    the storage type the kernel writes (a weight gradient `d<w>`, written by the reduce
    kernel rather than this one, in its weight's type, else the storage dtype)."""
    import cupy
    if given is None:
        args = dict(kernel.args)
        typed = {n: args.get(n) or args.get(n[1:]) for n in names}
        return tuple(cupy.empty(s, dtype=parse_ctype(typed[n]).dtype if typed[n]
                                else DTYPE_OF[kernel.dtype]) for n, s in zip(names, shapes))
    if len(given) != len(names):
        raise EulerError(f"{op.name}.{call}: out= has {len(given)} arrays, expected "
                         f"{len(names)} ({', '.join(names)})", file=op.spec, key="out")
    for n, a, s in zip(names, given, shapes):
        if tuple(a.shape) != tuple(s):
            raise EulerError(f"{op.name}.{call}: out {n} has shape {tuple(a.shape)}, expected "
                             f"{tuple(s)}", file=op.spec, key="out")
    return tuple(given)


def same_shape(op: OpEntry, call: str, named: dict, shape) -> None:
    for n, a in named.items():
        if tuple(a.shape) != tuple(shape):
            raise EulerError(f"{op.name}.{call}: {n} has shape {tuple(a.shape)}, expected "
                             f"{tuple(shape)} (the shape of {next(iter(named))})",
                             file=op.spec, key=n)


WORKSPACE_ALIGN = 64   # elements: each workspace slice starts 256-byte aligned (vector loads)


def aligned(n: int) -> int:
    return -(-n // WORKSPACE_ALIGN) * WORKSPACE_ALIGN


def elements(shapes) -> int:
    """The float32 elements of views of `shapes` laid out as carve lays them out."""
    return sum(aligned(prod(s)) for s in shapes)


def carve(op: OpEntry, workspace, shapes) -> list:
    """Consecutive float32 views of a caller's workspace, laid out as workspace_elements
    counts them: WORKSPACE_ALIGN apart from a start on a 16-byte boundary."""
    if workspace.dtype != np.float32 or workspace.ndim != 1 or not workspace.flags.c_contiguous:
        raise EulerError(f"{op.name}: workspace must be a contiguous 1-d float32 array, got "
                         f"{workspace.dtype} {tuple(workspace.shape)}", file=op.spec,
                         key="workspace")
    if workspace.data.ptr % 16:
        raise EulerError(f"{op.name}: workspace starts {workspace.data.ptr % 16} bytes past a "
                         "16-byte boundary; the kernels access it 16 bytes at a time (a CuPy "
                         "allocation starts on one)", file=op.spec, key="workspace")
    need = elements(shapes)
    if need > workspace.size:
        raise EulerError(f"{op.name}: workspace has {workspace.size} elements, this call needs "
                         f"{need} (plan it with workspace_elements)", file=op.spec,
                         key="workspace")
    views, at = [], 0
    for s in shapes:
        view = workspace[at:at + prod(s)]
        views.append(view if len(s) == 1 else view.reshape(s))   # a reshape costs ~1.5 us
        at += aligned(prod(s))
    return views
