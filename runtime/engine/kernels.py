"""Binding manifest kernels to CuPy arrays, and launching them.

A kernel's manifest entry lists its arguments as (name, C type) in launch order; the
op kinds' calls (runtime/engine/kinds/) name their arrays and scalars the same way (operand names,
`d<name>` for gradients, `rows`/`cols`/`n` for sizes, params by name). Everything a
launch depends on is checked here before the launch: every argument present, pointer
arguments CuPy arrays on the current device with the dtype the C type stores (bf16 is
stored in uint16 arrays, see bf16.py), contiguous, and scalars converted to the exact
width the kernel reads. The grid and block come from the kernel's geometry
(eulergen/launch.py), as the planner made it.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from eulergen.errors import EulerError
from eulergen.launch import Launch
from eulergen.runtime.engine.manifest import OpEntry
from eulergen.signature import KernelSig

# What a pointer's pointee is stored as, and what a scalar argument is passed as.
_STORAGE = {"float": np.float32, "__nv_bfloat16": np.uint16, "double": np.float64,
            "int": np.int32, "int32_t": np.int32, "long long": np.int64, "int64_t": np.int64,
            "unsigned int": np.uint32, "uint32_t": np.uint32, "unsigned long long": np.uint64,
            "unsigned short": np.uint16, "uint16_t": np.uint16,
            "unsigned char": np.uint8, "uint8_t": np.uint8}
DTYPE_OF = {"f32": np.dtype(np.float32), "bf16": np.dtype(np.uint16)}
NULL = object()   # a value for an optional pointer argument the kernel tests against null


def storage_dtype_name(a) -> str:
    """'f32' or 'bf16' for a float32 or uint16 (bf16 storage) array."""
    for name, dt in DTYPE_OF.items():
        if a.dtype == dt:
            return name
    raise EulerError(f"arrays must be float32 or bf16 (stored as uint16), got {a.dtype}",
                     key="dtype")


@dataclass(frozen=True)
class CType:
    base: str
    pointer: bool
    const: bool
    dtype: np.dtype     # what a pointer's array holds, or the width a scalar is passed at


@lru_cache(maxsize=None)
def parse_ctype(text: str) -> CType:
    t = " ".join(text.replace("*", " * ").split())
    const = t.startswith("const ")
    base = t.removeprefix("const ").removesuffix(" *").removesuffix(" __restrict__").strip()
    pointer = t.endswith("*")
    if base not in _STORAGE:
        raise EulerError(f"C type {text!r} is not one the runtime can pass", key="args")
    return CType(base, pointer, const, np.dtype(_STORAGE[base]))


@lru_cache(maxsize=None)
def _arg_types(args: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str, CType], ...]:
    """A kernel's arguments with their parsed C types: parsed once, not at every launch
    (the host side of a launch is most of a small kernel's cost)."""
    return tuple((name, ctext, parse_ctype(ctext)) for name, ctext in args)


_NULL_POINTER = np.uint64(0)


def bind(op: OpEntry, kernel: KernelSig, values: dict, *, contiguous: bool = True) -> tuple:
    """The argument tuple for one launch, after checking every value against its C type."""
    import cupy
    device = cupy.cuda.runtime.getDevice()
    args = []
    for name, ctext, ct in _arg_types(kernel.args):
        try:
            v = values[name]
        except KeyError:
            raise EulerError(f"{_where(op, kernel, name, ctext)}: no value given (the manifest "
                             "and runtime disagree; rebuild with `eulergen build`)", key=name) from None
        if not ct.pointer:
            args.append(ct.dtype.type(v))
        elif v is NULL:
            args.append(_NULL_POINTER)
        elif (isinstance(v, cupy.ndarray) and v.dtype == ct.dtype and v.data.device_id == device
              and (not contiguous or v.flags.c_contiguous)):
            args.append(v)
        else:
            raise _bad_array(op, kernel, name, ctext, ct, v, device)
    return tuple(args)


def _where(op: OpEntry, kernel: KernelSig, name: str, ctext: str) -> str:
    return f"{op.name}: kernel {kernel.name}: argument {name!r} ({ctext})"


def _bad_array(op, kernel, name, ctext, ct, v, device) -> EulerError:
    import cupy
    where = _where(op, kernel, name, ctext)
    if not isinstance(v, cupy.ndarray):
        return EulerError(f"{where}: expected a CuPy array, got {type(v).__name__}", key=name)
    if v.dtype != ct.dtype:
        shown = "uint16 (bf16 storage)" if ct.base == "__nv_bfloat16" else str(ct.dtype)
        return EulerError(f"{where}: dtype {v.dtype}, expected {shown}", key=name)
    if v.device.id != device:
        return EulerError(f"{where}: array is on device {v.device.id}, the launch on device "
                          f"{device}", key=name)
    return EulerError(f"{where}: array with strides {v.strides} is not C-contiguous (copy it "
                      "with cupy.ascontiguousarray)", key=name)


class Launcher:
    """The compiled module of one op (compiled on first use) and its launches."""

    def __init__(self, op: OpEntry):
        self.op = op
        self._compiled = None
        self._functions: dict[str, object] = {}   # a lookup costs about 1 us a launch

    def function(self, kernel: KernelSig):
        fn = self._functions.get(kernel.name)
        if fn is None:
            if self._compiled is None:
                if self.op.cuda is None:
                    raise EulerError("op has no CUDA source", file=str(self.op.manifest),
                                     key=f"ops.{self.op.name}.cuda")
                from eulergen.runtime.engine.compile import compile_file, op_options
                self._compiled = compile_file(self.op.cuda, op_options(self.op), self.op.template)
            fn = self._functions[kernel.name] = self._compiled.function(kernel.name)
        return fn

    def launch(self, kernel: KernelSig, at: Launch, values: dict, *, contiguous: bool = True) -> None:
        args = bind(self.op, kernel, values, contiguous=contiguous)
        launch(self.function(kernel), at, args, _arg_names(kernel.args))


@lru_cache(maxsize=None)
def _arg_names(args: tuple[tuple[str, str], ...]) -> tuple[str, ...]:
    return tuple(name for name, _ in args)


# The recorders listening to launches (runtime/engine/cuda_graph.py, while a graph is captured):
# each gets (function, launch, args, argument names) of every launch.
RECORDERS: list = []


def launch(fn, at: Launch, args: tuple, names: tuple[str, ...]) -> None:
    """Launch a CuPy kernel `fn` with `args`, whose names are the kernel's signature (the
    manifest's): the one place every generated kernel is launched from, so that a graph
    capture can learn which launches take a by-value argument that changes per replay."""
    fn(at.grid, at.block, args, shared_mem=at.shared_mem)
    for record in RECORDERS:
        record(fn, at, args, names)
