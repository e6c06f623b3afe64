"""CUDA graphs of a decoder step: captured once on a side stream (CuPy stream capture),
replayed on the current stream, with the by-value kernel arguments that change from one
replay to the next (a position, a draw's step) written into the graph before a launch.
`capture` alone (no live arguments) is also how the training step is captured
(runtime/train/step_graph.py).

    graph = Graph.capture(tape.forward, live)      # live: {"pos0": 0, "step": 0, …}
    live["pos0"] = 17; graph.launch(live)          # the step at position 17

GEMMs. cupy_backends sets a cuBLAS handle's stream before every call and raises while
any stream captures, so the decoder's GEMMs are the training step's (runtime/engine/gemm.py:
cuBLASLt, or cublasGemmEx on a ctypes handle of runtime/engine/cublas.py), on CuPy's current
stream over the plan's workspace (without one cuBLAS would allocate its own while captured).

Live arguments. The generated kernels take the position by value (`int pos0`: rope, the
decode attention); a captured launch keeps the value it was captured with. While a graph
is captured, every launch whose signature names a key of `live` is recorded
(runtime/engine/kernels.py launch); afterwards their kernel nodes are found in the graph by
function (cuGraphGetNodes, cuGraphKernelNodeGetParams), each node's arguments are copied
out once, and before a replay the changed live values are written into that copy and
handed back (cuGraphExecKernelNodeSetParams: later launches see them, those in flight do
not). Nothing else of a node changes, so a replay is one driver call per live node and
one graph launch: no Python walks the model.
"""
from __future__ import annotations

import ctypes
import gc
from ctypes import byref, c_int, c_size_t, c_uint, c_void_p
from functools import lru_cache

import numpy as np

from eulergen.errors import EulerError
from eulergen.runtime.engine.kernels import RECORDERS

_KERNEL_NODE = 0              # CU_GRAPH_NODE_TYPE_KERNEL
_CTYPE = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.uint32): ctypes.c_uint32,
          np.dtype(np.int64): ctypes.c_int64, np.dtype(np.uint64): ctypes.c_uint64,
          np.dtype(np.float32): ctypes.c_float}


class _NodeParams(ctypes.Structure):   # CUDA_KERNEL_NODE_PARAMS_v2 (cuda.h)
    _fields_ = [("func", c_void_p), ("gridDimX", c_uint), ("gridDimY", c_uint),
                ("gridDimZ", c_uint), ("blockDimX", c_uint), ("blockDimY", c_uint),
                ("blockDimZ", c_uint), ("sharedMemBytes", c_uint), ("kernelParams", c_void_p),
                ("extra", c_void_p), ("kern", c_void_p), ("ctx", c_void_p)]


def _check(status: int, call: str) -> None:
    if status:
        raise EulerError(f"{call} failed (status {status})", key="cuda_graph")


@lru_cache(maxsize=None)
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuGraphGetNodes.argtypes = (c_void_p, c_void_p, ctypes.POINTER(c_size_t))
    lib.cuGraphNodeGetType.argtypes = (c_void_p, ctypes.POINTER(c_int))
    lib.cuGraphKernelNodeGetParams_v2.argtypes = (c_void_p, ctypes.POINTER(_NodeParams))
    lib.cuGraphExecKernelNodeSetParams_v2.argtypes = (c_void_p, c_void_p,
                                                      ctypes.POINTER(_NodeParams))
    return lib


def _function(fn) -> int:
    """The CUfunction of a kernel of a compiled module (compile.Compiled.function's: its
    `.kernel`'s pointer), or of a bare cupy.cuda.Function."""
    return getattr(fn, "kernel", fn).ptr


def _size(a) -> tuple[int, np.dtype | None]:
    """(bytes, dtype) of one kernel argument as CuPy passes it: arrays (and NULL) as an
    8-byte pointer, scalars by value."""
    if isinstance(a, np.generic):
        return a.dtype.itemsize, a.dtype
    return 8, None


class _LiveNode:
    """One kernel node with live arguments: its own copy of the node's arguments, whose
    live slots a replay rewrites, and the params that hand the copy back."""

    def __init__(self, node: int, params: _NodeParams, names: tuple, args: tuple, live: dict):
        sizes = [_size(a) for a in args]
        offsets = np.cumsum([0] + [-(-n // 8) * 8 for n, _ in sizes])
        self.buffer = ctypes.create_string_buffer(int(offsets[-1]))
        base = ctypes.addressof(self.buffer)
        given = ctypes.cast(params.kernelParams, ctypes.POINTER(c_void_p))
        for i, (n, _) in enumerate(sizes):   # the node's own values, as captured
            ctypes.memmove(base + int(offsets[i]), given[i], n)
        self.pointers = (c_void_p * len(args))(*(base + int(o) for o in offsets[:-1]))
        self.params = _NodeParams.from_buffer_copy(params)
        self.params.kernelParams = ctypes.addressof(self.pointers)
        self.params.extra = None
        self.node = node
        self.slots = {name: _CTYPE[sizes[i][1]].from_address(base + int(offsets[i]))
                      for i, name in enumerate(names) if name in live}
        self.seen = {name: None for name in self.slots}

    def update(self, driver, graph_exec: int, live: dict) -> None:
        changed = False
        for name, slot in self.slots.items():
            value = live[name]
            if value != self.seen[name]:
                slot.value, self.seen[name], changed = value, value, True
        if changed:
            _check(driver.cuGraphExecKernelNodeSetParams_v2(graph_exec, self.node,
                                                            byref(self.params)),
                   "cuGraphExecKernelNodeSetParams")


class Graph:
    """A captured step and its live nodes."""

    def __init__(self, graph, nodes: list[_LiveNode]):
        self.graph, self.nodes = graph, nodes

    @classmethod
    def capture(cls, run, live: dict) -> Graph:
        """`run()` captured on a side stream into a graph (nothing runs yet)."""
        import cupy
        seen = []

        def record(fn, at, args, names):
            if not live.keys().isdisjoint(names):
                seen.append((fn, at, args, names))

        RECORDERS.append(record)
        try:
            graph = capture(cupy.cuda.Stream(non_blocking=True), run)
        finally:
            RECORDERS.remove(record)
        return cls(graph, _live_nodes(graph.graph, seen, live))

    def kernel_count(self) -> int:
        """The kernels one launch runs (the profiles' count of a step)."""
        return len(_kernel_nodes(self.graph.graph))

    def launch(self, live: dict) -> None:
        """Write the changed live values into the graph, then launch it on the current
        stream."""
        driver, graph_exec = _driver(), self.graph.graphExec
        for node in self.nodes:
            node.update(driver, graph_exec, live)
        self.graph.launch()


def capture(stream, run):
    """`run()` captured on `stream` into a CuPy graph (nothing runs yet). The cyclic garbage
    collector runs before and not during: a finalizer it calls mid-capture (a cuBLAS handle's
    cublasDestroy synchronizes the device) would invalidate the capture at a random launch.
    On an error the capture is ended and the first error raised."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        with stream:
            stream.begin_capture()
            try:
                run()
            except BaseException:
                try:
                    stream.end_capture()
                except Exception:   # an invalidated capture: the first error says why
                    pass
                raise
            return stream.end_capture()
    finally:
        if enabled:
            gc.enable()


def _kernel_nodes(graph: int) -> list[int]:
    """The kernel nodes of a CUgraph, in the graph's order."""
    driver = _driver()
    count = c_size_t(0)
    _check(driver.cuGraphGetNodes(graph, None, byref(count)), "cuGraphGetNodes")
    handles = (c_void_p * count.value)()
    _check(driver.cuGraphGetNodes(graph, handles, byref(count)), "cuGraphGetNodes")
    kernels = []
    for node in handles:
        kind = c_int()
        _check(driver.cuGraphNodeGetType(node, byref(kind)), "cuGraphNodeGetType")
        if kind.value == _KERNEL_NODE:
            kernels.append(node)
    return kernels


def _live_nodes(graph: int, seen: list, live: dict) -> list[_LiveNode]:
    """The kernel nodes of the recorded launches, in the graph's order, each with the
    signature its function was launched with."""
    driver = _driver()
    by_function = {_function(fn): names for fn, _, _, names in seen}
    args_of = {_function(fn): args for fn, _, args, _ in seen}
    nodes = []
    for node in _kernel_nodes(graph):
        params = _NodeParams()
        _check(driver.cuGraphKernelNodeGetParams_v2(node, byref(params)),
               "cuGraphKernelNodeGetParams")
        names = by_function.get(params.func)
        if names is not None:
            nodes.append(_LiveNode(node, params, names, args_of[params.func], live))
    if len(nodes) != len(seen):
        raise EulerError(f"graph capture: {len(seen)} launches take live arguments, the graph "
                         f"has {len(nodes)} kernel nodes of their functions", key="cuda_graph")
    return nodes
