"""Launching the flash-attention kernels of one attention op (templates/attention*.cu.j2).

    ak = AttentionKernels.from_op(lib.op("causal_attention"))   # or from a rendered file
    o, lse = attention_forward(ak, q, k, v)
    dq, dk, dv = attention_backward(ak, q, k, v, o, lse, do)
    o = attention_decode(ak, q_new, k_cache, v_cache, pos0)     # new queries over a KV cache

q, o, dq [B, T, H, D]; k, v, dk, dv [B, T, KVH, D]; lse [B, H, T] float32. Arrays are
CuPy, float32 or bf16 (stored as uint16), all of one dtype. They may be strided views —
q, k and v slices of one fused qkv buffer [B, T, (H + 2·KVH)·D] are the intended case — as
long as the head dim is contiguous and every stride keeps 16-byte alignment. Everything is
checked before a launch; a mismatch is an EulerError naming the argument.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Callable

import numpy as np

from eulergen.errors import EulerError
from eulergen.launch import FlashKernel, Launch, cdiv
from eulergen.runtime.engine.backend import sm_count
from eulergen.runtime.engine.kernels import DTYPE_OF, launch, storage_dtype_name
from eulergen.signature import KernelSig, select


@dataclass(frozen=True)
class AttentionKernels:
    """One attention op's kernels (their signatures), param defaults, and `function(name)`
    giving a launchable CuPy kernel."""
    op: str
    kernels: tuple[KernelSig, ...]
    params: dict
    function: Callable[[str], object]
    arch: str = ""   # what `function`'s build targets (compile.device_arch); "" for none known
    _ready: dict = field(default_factory=dict, compare=False, repr=False)  # name -> kernel
    # decode's split-K records and per-chunk counters (zero between launches), grown on demand,
    # and its checked launches by array layout
    _decode_ws: dict = field(default_factory=dict, compare=False, repr=False)
    _decode_launches: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_op(cls, op) -> "AttentionKernels":
        """From a manifest OpEntry; the .cu is compiled (and cached) on first use."""
        from eulergen.runtime.engine.compile import compile_file, device_arch, op_options
        compiled = []

        def function(name: str):
            if not compiled:   # with the key compile.prefetch computes for it
                compiled.append(compile_file(op.cuda, op_options(op), op.template))
            return compiled[0].function(name)
        return cls(op.name, tuple(op.kernels.values()), dict(op.params), function,
                   device_arch())

    def head_dims(self) -> list[int]:
        return _head_dims(k.geometry for k in self.kernels)

    def backward_isa(self, dtype: str, head_dim: int) -> str:
        """'wgmma' where this op has sm_90a backward kernels for (dtype, head_dim) and its
        build is sm_90a, else 'mma'."""
        if self.arch == "90a" and select(self.kernels, "backward", dtype, part="dkv",
                                                  head_dim=head_dim, isa="wgmma"):
            return "wgmma"
        return "mma"

    def kernel(self, stage: str, dtype: str, part: str = "",
               head_dim: int | None = None, isa: str | None = None) -> KernelSig:
        """The kernel of one call's `part` in `dtype`, of `head_dim` (None: rowdot's, which
        takes any), for `isa` where the part has variants ('mma' | 'wgmma')."""
        dims = {} if head_dim is None else {"head_dim": head_dim}
        if isa is not None:
            dims["isa"] = isa
        found = select(self.kernels, stage, dtype, part=part, **dims)
        if not found:
            raise EulerError(f"{self.op}: head dim {head_dim} is not supported (kernels exist "
                             f"for {self.head_dims()}); use one of those", key="head_dim")
        return found[0]

    def launch(self, kernel: KernelSig, at: Launch, args: tuple) -> None:
        smem = at.shared_mem
        fn = self._ready.get(kernel.name)
        if fn is None:
            fn = self.function(kernel.name)
            if smem > 48 * 1024:
                # Past the default 48 KiB of dynamic shared memory a kernel must opt in.
                try:
                    fn.max_dynamic_shared_size_bytes = smem
                except AttributeError:  # a bare cupy.cuda.function.Function
                    from cupy.cuda import driver
                    driver.funcSetAttribute(
                        fn.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
            self._ready[kernel.name] = fn
        launch(fn, at, args, tuple(n for n, _ in kernel.args))

    def decode_workspace(self, records: int, cells: int) -> tuple:
        """(part, counts) for a split decode: `records` float32 records of a block's rows and
        `cells` counters, which the kernels leave at zero."""
        import cupy
        ws = self._decode_ws
        if ws.get("part") is None or ws["part"].size < records:
            ws["part"] = cupy.empty(max(records, 1), np.float32)
        if ws.get("counts") is None or ws["counts"].size < cells:
            ws["counts"] = cupy.zeros(max(cells, 1), np.int32)
        return ws["part"], ws["counts"]

    def param_values(self, given: dict) -> tuple:
        unknown = sorted(set(given) - set(self.params))
        if unknown:
            raise EulerError(f"{self.op}: unknown param {unknown[0]!r} (params: "
                             f"{sorted(self.params) or 'none'})", key=unknown[0])
        values = []
        for name, default in self.params.items():
            value = given.get(name, default)
            if value is None:
                raise EulerError(f"{self.op}: param {name!r} has no default and was not given",
                                 key=name)
            values.append(np.float32(value))
        return tuple(values)


def _head_dims(geometries) -> list[int]:
    return sorted({g.head_dim for g in geometries if isinstance(g, FlashKernel)})


def head_dims(op) -> list[int]:
    """The head dims an attention op (a manifest OpEntry) has kernels for."""
    return _head_dims(k.geometry for k in op.kernels.values())


def _strides(name: str, a, dtype: np.dtype) -> tuple:
    """(batch, seq, head) strides in elements, after checking the layout the kernels read:
    unit stride along D, 16-byte aligned base and strides."""
    item = a.dtype.itemsize
    if a.strides[3] != item:
        raise EulerError(f"{name}: the head dim must be contiguous (strides {a.strides})", key=name)
    if any(s % 16 for s in a.strides[:3]) or a.data.ptr % 16:
        raise EulerError(f"{name}: base and strides {a.strides} must be multiples of 16 bytes "
                         "(16-byte vector loads)", key=name)
    return tuple(np.int64(s // item) for s in a.strides[:3])


def _check(name: str, a, shape: tuple, dtype: np.dtype) -> None:
    import cupy
    if not isinstance(a, cupy.ndarray):
        raise EulerError(f"{name}: expected a CuPy array, got {type(a).__name__}", key=name)
    if a.dtype != dtype:
        raise EulerError(f"{name}: dtype {a.dtype}, expected {dtype}", key=name)
    if tuple(a.shape) != tuple(shape):
        raise EulerError(f"{name}: shape {tuple(a.shape)}, expected {tuple(shape)}", key=name)


def _geometry(q, k, v) -> tuple[int, int, int, int, int, str]:
    import cupy
    for name, a in (("q", q), ("k", k), ("v", v)):
        if not isinstance(a, cupy.ndarray) or a.ndim != 4:
            raise EulerError(f"{name}: expected a 4-d CuPy array [B, T, heads, D], got "
                             f"{getattr(a, 'shape', type(a).__name__)}", key=name)
    dt = storage_dtype_name(q)
    B, T, H, D = q.shape
    KVH = k.shape[2]
    if T < 1 or H < 1 or KVH < 1:
        raise EulerError(f"q: empty shape {q.shape}", key="q")
    if H % KVH:
        raise EulerError(f"k: {KVH} kv heads do not divide {H} query heads", key="k")
    _check("k", k, (B, T, KVH, D), q.dtype)
    _check("v", v, (B, T, KVH, D), q.dtype)
    return B, T, H, KVH, D, dt


def decode_geometry(q, k_cache, v_cache, pos0: int) -> tuple[int, int, int, int, int, int]:
    """(B, Tq, H, KVH, D, Tmax) of a decode call, from shapes alone (both backends): q
    [B, Tq, H, D] at positions pos0 … pos0+Tq-1, caches [B, Tmax, KVH, D] that hold them."""
    for name, a in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if getattr(a, "ndim", None) != 4:
            raise EulerError(f"{name}: expected a 4-d array [B, T, heads, D], got "
                             f"{getattr(a, 'shape', type(a).__name__)}", key=name)
    B, Tq, H, D = q.shape
    Tmax, KVH = k_cache.shape[1], k_cache.shape[2]
    if Tq < 1 or H < 1 or KVH < 1:
        raise EulerError(f"q: empty shape {tuple(q.shape)}", key="q")
    if H % KVH:
        raise EulerError(f"k_cache: {KVH} kv heads do not divide {H} query heads", key="k_cache")
    for name, a in (("k_cache", k_cache), ("v_cache", v_cache)):
        if tuple(a.shape) != (B, Tmax, KVH, D):
            raise EulerError(f"{name}: shape {tuple(a.shape)}, expected {(B, Tmax, KVH, D)} "
                             f"([B, Tmax, KVH, D] with q's B and D)", key=name)
    if pos0 < 0 or pos0 + Tq > Tmax:
        raise EulerError(f"pos0: {Tq} queries at position {pos0} reach past the cache's "
                         f"{Tmax} rows (want 0 <= pos0 <= {Tmax - Tq})", key="pos0")
    return B, Tq, H, KVH, D, Tmax


def attention_forward(ak: AttentionKernels, q, k, v, *, out=None, lse=None, **params):
    """(o, lse): o [B, T, H, D] in q's dtype, lse [B, H, T] float32. `out`/`lse` write into
    given arrays (o may be a strided view)."""
    import cupy
    B, T, H, KVH, D, dt = _geometry(q, k, v)
    kernel = ak.kernel("forward", dt, head_dim=D)
    pvals = ak.param_values(params)
    o = cupy.empty(q.shape, q.dtype) if out is None else out
    lse = cupy.empty((B, H, T), np.float32) if lse is None else lse
    _check("out", o, q.shape, q.dtype)
    _check("lse", lse, (B, H, T), np.dtype(np.float32))
    if not lse.flags.c_contiguous:
        raise EulerError("lse: must be C-contiguous", key="lse")
    dtype = DTYPE_OF[dt]
    args = (q, k, v, o, lse, np.int32(T), np.int32(H), np.int32(KVH),
            *_strides("q", q, dtype), *_strides("k", k, dtype), *_strides("v", v, dtype),
            *_strides("out", o, dtype), *pvals)
    ak.launch(kernel, kernel.geometry.launch(B, T, H, KVH), args)
    return o, lse


def attention_backward(ak: AttentionKernels, q, k, v, o, lse, do, *, out=None, delta=None,
                       isa: str | None = None, **params):
    """(dq, dk, dv) in q's dtype. `out=(dq, dk, dv)` writes into given arrays (views of a
    fused dqkv buffer work); `delta` is a [B, H, T] float32 workspace, allocated if absent;
    `isa` picks the kernels ('mma' | 'wgmma'; None: ak.backward_isa's)."""
    import cupy
    B, T, H, KVH, D, dt = _geometry(q, k, v)
    _check("o", o, q.shape, q.dtype)
    _check("do", do, q.shape, q.dtype)
    _check("lse", lse, (B, H, T), np.dtype(np.float32))
    if not lse.flags.c_contiguous:
        raise EulerError("lse: must be C-contiguous", key="lse")
    isa = isa or ak.backward_isa(dt, D)
    dkv = ak.kernel("backward", dt, "dkv", D, isa)
    dq_k = ak.kernel("backward", dt, "dq", D, isa)
    rowdot = ak.kernel("backward", dt, "rowdot")
    pvals = ak.param_values(params)
    if out is None:
        out = (cupy.empty(q.shape, q.dtype), cupy.empty(k.shape, k.dtype),
               cupy.empty(v.shape, v.dtype))
    dq, dk, dv = out
    _check("dq", dq, q.shape, q.dtype)
    _check("dk", dk, k.shape, k.dtype)
    _check("dv", dv, v.shape, v.dtype)
    delta = cupy.empty((B, H, T), np.float32) if delta is None else delta
    _check("delta", delta, (B, H, T), np.dtype(np.float32))
    if not delta.flags.c_contiguous:
        raise EulerError("delta: must be C-contiguous", key="delta")
    dtype = DTYPE_OF[dt]
    sq, sk, sv = _strides("q", q, dtype), _strides("k", k, dtype), _strides("v", v, dtype)
    so, sdo = _strides("o", o, dtype), _strides("do", do, dtype)
    sizes = (np.int32(T), np.int32(H), np.int32(KVH))

    ak.launch(rowdot, rowdot.geometry.launch(B * H * T),
              (o, do, delta, np.int32(B), np.int32(T), np.int32(H), np.int32(D), *so, *sdo))
    ak.launch(dkv, dkv.geometry.launch(B, T, H, KVH),
              (q, k, v, do, lse, delta, dk, dv, *sizes, *sq, *sk, *sv, *sdo,
               *_strides("dk", dk, dtype), *_strides("dv", dv, dtype), *pvals))
    ak.launch(dq_k, dq_k.geometry.launch(B, T, H, KVH),
              (q, k, v, do, lse, delta, dq, *sizes, *sq, *sk, *sv, *sdo,
               *_strides("dq", dq, dtype), *pvals))
    return dq, dk, dv


# The SMs a memory plan made without a GPU (`eulergen plan --inference`) assumes: an H200's.
PLAN_SMS = 132

# Blocks a decode launch aims for per SM, splitting the cache across blocks until it has them:
# decoding reads a few MB with little math, so what bounds it is loads in flight.
DECODE_BLOCKS_PER_SM = 4


def decode_splits(cells: int, keys: int, tile: int, sms: int) -> tuple[int, int]:
    """(splits, keys a split) for `cells` blocks of rows over `keys` cached keys: enough
    splits to give every SM DECODE_BLOCKS_PER_SM blocks, each split a whole number of tiles."""
    tiles = cdiv(keys, tile)
    splits = max(1, min(tiles, cdiv(DECODE_BLOCKS_PER_SM * sms, cells)))
    split_keys = cdiv(tiles, splits) * tile
    return cdiv(keys, split_keys), split_keys


@dataclass(frozen=True)
class _DecodeLaunch:
    """What the layouts of a decode call's arrays fix, checked once: a sampler calls decode
    per layer per token with the same layouts, where checks would cost more than the launch."""
    kernel: KernelSig
    sizes: tuple      # B, Tq, H, KVH: what geometry.launch takes before the splits
    tq: int
    tmax: int
    cells: int        # blocks of rows of one split: B · KVH · chunks of block_rows rows
    record: int       # floats of one split's record: block_rows · (D + 2)
    heads: tuple      # n_heads, n_kv_heads
    tail: tuple       # strides of q, k, v, the new k and v (0 without), o, then the params


def _layout(a) -> tuple:
    """Everything the checks of one array look at (AttributeError: not a CuPy array)."""
    return type(a), a.shape, a.strides, a.dtype, a.data.ptr % 16


def _decode_launch(ak: AttentionKernels, q, k_cache, v_cache, out, pos0: int, new,
                   params: dict) -> _DecodeLaunch:
    """Every check of a decode call, before anything is launched: EulerError naming the
    argument. `out` None: o will be a new contiguous array."""
    import cupy
    B, Tq, H, KVH, D, Tmax = decode_geometry(q, k_cache, v_cache, pos0)
    for name, a in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(a, cupy.ndarray):
            raise EulerError(f"{name}: expected a CuPy array, got {type(a).__name__}", key=name)
    dt = storage_dtype_name(q)
    _check("k_cache", k_cache, k_cache.shape, q.dtype)
    _check("v_cache", v_cache, v_cache.shape, q.dtype)
    kernel = ak.kernel("decode", dt, head_dim=D)
    geometry = kernel.geometry
    pvals = ak.param_values(params)
    dtype = DTYPE_OF[dt]
    if out is None:
        o_strides = tuple(np.int64(s) for s in (Tq * H * D, H * D, D))
    else:
        _check("out", out, q.shape, q.dtype)
        o_strides = _strides("out", out, dtype)
    new_strides = (np.int64(0),) * 6
    if new is not None:
        for name, a in zip(("new k", "new v"), new):
            _check(name, a, (B, Tq, KVH, D), q.dtype)
        new_strides = (*_strides("new k", new[0], dtype), *_strides("new v", new[1], dtype))
    sizes = (B, Tq, H, KVH)
    return _DecodeLaunch(
        kernel, sizes, Tq, Tmax, prod(geometry.launch(*sizes).grid),
        geometry.block_rows * (D + 2), (np.int32(H), np.int32(KVH)),
        (*_strides("q", q, dtype), *_strides("k_cache", k_cache, dtype),
         *_strides("v_cache", v_cache, dtype), *new_strides, *o_strides, *pvals))


def decode_workspace_bound(op, head_dim: int, sms: int) -> tuple[int, int]:
    """(float32 records, int32 counters) that cover a split decode of any shape by an
    attention op (a manifest OpEntry) on a GPU of `sms` SMs: a launch splits only while its
    cells are fewer than DECODE_BLOCKS_PER_SM·sms, so cells·splits < 2·DECODE_BLOCKS_PER_SM·
    sms. What a memory plan gives `workspace=`."""
    rows = max((k.geometry.block_rows for k in select(op.kernels.values(), "decode")),
               default=1)
    cells = DECODE_BLOCKS_PER_SM * sms
    return 2 * cells * rows * (head_dim + 2), cells


def attention_decode(ak: AttentionKernels, q, k_cache, v_cache, pos0: int, *, out=None,
                     keys: int | None = None, workspace: tuple | None = None, new=None,
                     **params):
    """o [B, Tq, H, D] in q's dtype: queries q at positions pos0 … pos0+Tq-1 over the caches
    [B, Tmax, KVH, D], of which rows pos0+Tq and later are never read (docs/internals.md).
    `new`: (k, v) [B, Tq, KVH, D] of the new positions (strided views work), which the
    launch reads and writes into the caches' rows pos0 … (else the caches hold them).
    `out` writes into a given array (a strided view works). `keys`: plan the split over the
    cache for this many keys (≥ pos0+Tq; default pos0+Tq), so that launches at different
    positions have one grid (a CUDA graph replays one launch at every position).
    `workspace`: (part float32, counts int32 zeros) for the split, planned by the caller
    (decode_workspace_bound); default: `ak`'s own, grown on demand (calls on one stream run
    in order, so they may share it)."""
    try:
        key = (_layout(q), _layout(k_cache), _layout(v_cache),
               None if out is None else _layout(out),
               None if new is None else tuple(map(_layout, new)), tuple(params.items()))
    except AttributeError:  # not CuPy arrays: the checks say which
        key = None
    launch = ak._decode_launches.get(key)
    if launch is None:
        launch = _decode_launch(ak, q, k_cache, v_cache, out, pos0, new, params)
        if key is not None:
            ak._decode_launches[key] = launch
    elif not 0 <= pos0 <= launch.tmax - launch.tq:
        decode_geometry(q, k_cache, v_cache, pos0)   # raises, naming pos0
    if out is None:
        import cupy
        out = cupy.empty(q.shape, q.dtype)
    cells = launch.cells
    if keys is not None and keys < pos0 + launch.tq:
        raise EulerError(f"keys {keys}: fewer than the {pos0 + launch.tq} the queries see",
                         key="keys")
    splits, split_keys = decode_splits(cells, keys or pos0 + launch.tq, launch.kernel.geometry.tile,
                                       sm_count())
    split = splits > 1
    records, cells_used = (cells * splits * launch.record, cells) if split else (0, 0)
    if workspace is None:
        part, counts = ak.decode_workspace(records, cells_used)
    else:
        part, counts = workspace
        if part.size < records or counts.size < cells_used:
            raise EulerError(f"workspace: {part.size} records and {counts.size} counters, "
                             f"the split needs {records} and {cells_used}", key="workspace")
    ak.launch(launch.kernel, launch.kernel.geometry.launch(*launch.sizes, splits),
              (q, k_cache, v_cache, *(new or (None, None)), out, part, counts,
               np.int32(launch.tq), np.int32(pos0),
               *launch.heads, np.int32(splits), np.int32(split_keys), *launch.tail))
    return out
