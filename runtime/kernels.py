"""Binding manifest kernels to CuPy arrays, and launching them.

A kernel's manifest entry lists its arguments as (name, C type) in launch order; the
callers in runtime/ops.py name their arrays and scalars the same way (operand names,
`d<name>` for gradients, `rows`/`cols`/`n` for sizes, params by name). Everything a
launch depends on is checked here before the launch: every argument present, pointer
arguments CuPy arrays on the current device with the dtype the C type stores (bf16 is
stored in uint16 arrays, see ops.py), contiguous, and scalars converted to the exact
width the kernel reads. The launch geometry comes from the kernel's plan (the keys are
documented in generator/plan.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from eulergen.errors import EulerError
from eulergen.runtime.manifest import Kernel, OpEntry

# What a pointer's pointee is stored as, and what a scalar argument is passed as.
_STORAGE = {"float": np.float32, "__nv_bfloat16": np.uint16, "int": np.int32,
            "int32_t": np.int32, "long long": np.int64, "int64_t": np.int64,
            "unsigned int": np.uint32, "uint32_t": np.uint32, "unsigned short": np.uint16,
            "uint16_t": np.uint16, "unsigned char": np.uint8, "uint8_t": np.uint8}
DTYPE_OF = {"f32": np.dtype(np.float32), "bf16": np.dtype(np.uint16)}
NULL = object()   # a value for an optional `const T*` argument the kernel tests against null


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


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def bind(op: OpEntry, kernel: Kernel, values: dict, *, contiguous: bool = True) -> tuple:
    """The argument tuple for one launch, after checking every value against its C type."""
    import cupy
    device = cupy.cuda.runtime.getDevice()
    args = []
    for name, ctext in kernel.args:
        ct = parse_ctype(ctext)
        try:
            v = values[name]
        except KeyError:
            raise EulerError(f"{_where(op, kernel, name, ctext)}: no value given (the manifest "
                             "and runtime disagree; rebuild with `eulergen build`)", key=name) from None
        if not ct.pointer:
            args.append(ct.dtype.type(v))
        elif v is NULL and ct.const:
            args.append(np.uint64(0))
        elif (isinstance(v, cupy.ndarray) and v.dtype == ct.dtype and v.device.id == device
              and (v.flags.c_contiguous or not contiguous)):
            args.append(v)
        else:
            raise _bad_array(op, kernel, name, ctext, ct, v, device)
    return tuple(args)


def _where(op: OpEntry, kernel: Kernel, name: str, ctext: str) -> str:
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

    def function(self, kernel: Kernel):
        if self._compiled is None:
            if self.op.cuda is None:
                raise EulerError("op has no CUDA source", file=str(self.op.manifest),
                                 key=f"ops.{self.op.name}.cuda")
            from eulergen.runtime.compile import compile_file, op_options
            self._compiled = compile_file(self.op.cuda, op_options(self.op), self.op.template)
        return self._compiled.function(kernel.name)

    def launch(self, kernel: Kernel, grid, block, values: dict, *, shared_mem: int = 0,
               contiguous: bool = True) -> None:
        args = bind(self.op, kernel, values, contiguous=contiguous)
        grid = grid if isinstance(grid, tuple) else (grid,)
        block = block if isinstance(block, tuple) else (block,)
        self.function(kernel)(grid, block, args, shared_mem=shared_mem)


# ---- launch geometry, one function per plan shape (keys: generator/plan.py) --------------

def _grid(count: int, plan: dict) -> int:
    cap = plan.get("grid_max")
    return max(1, min(count, cap) if cap else count)


def pointwise_geometry(plan: dict, n: int) -> tuple[int, int]:
    per_block = plan["vec"] * plan.get("unroll", 1) * plan["threads"]
    return _grid(cdiv(n, per_block), plan), plan["threads"]


def row_kernel(op: OpEntry, stage: str, dtype: str, cols: int) -> Kernel:
    """The warp-per-row kernel for rows it holds in registers, else the block-per-row one."""
    candidates = [k for k in op.kernels.values() if k.stage == stage and k.dtype == dtype]
    if not candidates:
        return op.kernel(stage, dtype)   # raises, naming the kernels there are
    warp = [k for k in candidates if k.plan.get("layout") == "warp_per_row"]
    block = [k for k in candidates if k.plan.get("layout") == "block_per_row"]
    if warp and (not block or cols <= warp[0].plan["max_cols"]):
        return warp[0]
    return (block or candidates)[0]


@dataclass(frozen=True)
class RowGeometry:
    grid: int
    threads: int
    partials: int        # rows of the weight-gradient workspace this launch writes


def row_geometry(plan: dict, rows: int, cols: int) -> RowGeometry:
    rpb = plan.get("rows_per_block", 1)
    if plan.get("layout") == "block_per_row":
        want = cdiv(cdiv(cols, plan["cols_per_thread"]), 32) * 32
        threads = min(max(want, plan["threads_min"]), plan["threads"])
        grid = _grid(rows, plan)
        return RowGeometry(grid, threads, grid)
    grid = _grid(cdiv(rows, rpb), plan)
    return RowGeometry(grid, plan["threads"], grid * rpb)


def row_partials_max(plan: dict) -> int:
    """The most workspace rows a launch of this kernel writes (for memory planning)."""
    cap = plan.get("grid_max") or 1
    return cap * (plan.get("rows_per_block", 1) if plan.get("layout") != "block_per_row" else 1)


def reduce_geometry(plan: dict, cols: int) -> tuple[int, tuple[int, int]]:
    tx, ty = plan.get("threads_x", 32), plan.get("threads_y", 32)
    return cdiv(cols, tx), (tx, ty)


# ---- the calls, per op kind ---------------------------------------------------------------

def _outputs(kernel: Kernel, names, shapes, given, op: OpEntry, call: str) -> tuple:
    """The caller's `out` arrays (shape-checked here, dtype-checked in bind) or new ones in
    the storage type the kernel writes (a weight gradient, written by the reduce kernel
    rather than this one, is in the storage dtype)."""
    import cupy
    if given is None:
        args = dict(kernel.args)
        return tuple(cupy.empty(s, dtype=parse_ctype(args[n]).dtype if n in args
                                else DTYPE_OF[kernel.dtype]) for n, s in zip(names, shapes))
    if len(given) != len(names):
        raise EulerError(f"{op.name}.{call}: out= has {len(given)} arrays, expected "
                         f"{len(names)} ({', '.join(names)})", file=op.spec, key="out")
    for n, a, s in zip(names, given, shapes):
        if tuple(a.shape) != tuple(s):
            raise EulerError(f"{op.name}.{call}: out {n} has shape {tuple(a.shape)}, expected "
                             f"{tuple(s)}", file=op.spec, key="out")
    return tuple(given)


def _same_shape(op: OpEntry, call: str, named: dict, shape) -> None:
    for n, a in named.items():
        if tuple(a.shape) != tuple(shape):
            raise EulerError(f"{op.name}.{call}: {n} has shape {tuple(a.shape)}, expected "
                             f"{tuple(shape)} (the shape of {next(iter(named))})",
                             file=op.spec, key=n)


@dataclass(frozen=True)
class RowSig:
    """What one stage of a row op reads and writes, by name and role (computed once)."""
    names: tuple[str, ...]        # the call's arrays in order: inputs, then output grads
    roles: tuple[str, ...]        # 'row' | 'weight' | 'index' | 'scalar' for each
    x: int                        # position of the first row input (it sets the shape)
    writes: tuple[str, ...]       # forward outputs, then input grads, in GRADS order
    write_roles: tuple[str, ...]
    wgrads: tuple[str, ...]       # the weight grads among `writes` (workspace + reduce)


@lru_cache(maxsize=None)
def _row_sig(op: OpEntry, stage: str) -> RowSig:
    douts = [o for o in op.outputs if stage == "backward" or
             (stage == "fwdbwd" and o.role == "scalar")]
    names = tuple(o.name for o in op.inputs) + tuple(f"d{o.name}" for o in douts)
    roles = tuple(o.role for o in op.inputs) + tuple(o.role for o in douts)
    fwd = [o for o in op.outputs] if stage in ("forward", "fwdbwd") else []
    grads = [o for o in op.inputs if o.differentiable] if stage != "forward" else []
    return RowSig(names, roles, roles.index("row"),
                  tuple(o.name for o in fwd) + tuple(f"d{o.name}" for o in grads),
                  tuple(o.role for o in fwd) + tuple(o.role for o in grads),
                  tuple(f"d{o.name}" for o in grads if o.role == "weight"))


class CudaOps:
    """Forward, backward, step and fused calls of manifest ops on CuPy arrays."""

    def __init__(self):
        self._launchers: dict[tuple, Launcher] = {}
        self._attention: dict[tuple, object] = {}
        self._workspaces: dict[tuple, object] = {}

    def launcher(self, op: OpEntry) -> Launcher:
        key = (op.name, str(op.cuda), op.cuda_sha256)
        if key not in self._launchers:
            self._launchers[key] = Launcher(op)
        return self._launchers[key]

    def attention(self, op: OpEntry):
        """Attention kernels are launched by runtime/attention.py (flash tiling, strided q/k/v)."""
        from eulergen.runtime.attention import AttentionKernels
        key = (op.name, str(op.cuda), op.cuda_sha256)
        if key not in self._attention:
            self._attention[key] = AttentionKernels.from_op(op)
        return self._attention[key]

    def forward(self, op: OpEntry, inputs: tuple, out, params: dict, pos0: int = 0) -> tuple:
        if op.kind == "pointwise":
            return self._pointwise(op, "forward", inputs, out, params)
        if op.kind == "row":
            return self._row(op, "forward", inputs, out, params)
        if op.kind == "pair":
            return self._pair(op, "forward", inputs, out, params, pos0)
        if op.kind == "embedding":
            return self._embedding_forward(op, inputs, out)
        if op.kind == "attention":
            from eulergen.runtime.attention import attention_forward
            o, lse = (None, None) if out is None else out
            return attention_forward(self.attention(op), *inputs, out=o, lse=lse, **params)
        raise EulerError(f"op {op.name!r}: kind {op.kind!r} has no CUDA forward",
                         file=op.spec, key="kind")

    def backward(self, op: OpEntry, args: tuple, out, params: dict, pos0: int = 0) -> tuple:
        if op.kind == "pointwise":
            return self._pointwise(op, "backward", args, out, params)
        if op.kind == "row":
            return self._row(op, "backward", args, out, params)
        if op.kind == "pair":
            return self._pair(op, "backward", args, out, params, pos0)
        if op.kind == "embedding":
            return self._embedding_backward(op, args, out)
        if op.kind == "attention":
            from eulergen.runtime.attention import attention_backward
            return attention_backward(self.attention(op), *args, out=out, **params)
        raise EulerError(f"op {op.name!r}: kind {op.kind!r} has no CUDA backward",
                         file=op.spec, key="kind")

    def step(self, op: OpEntry, args: tuple, params: dict) -> None:
        """An update op over flat buffers: state float32, grads in the storage dtype; every
        operand the same shape (the caller launches once per weight-decay range)."""
        named = dict(zip((o.name for o in op.inputs), args))
        _same_shape(op, "step", named, args[0].shape)
        grads = [a for o, a in zip(op.inputs, args) if o.role == "grad"]
        kernel = op.kernel("step", storage_dtype_name(grads[0]) if grads else "f32")
        n = args[0].size
        if n:
            grid = _grid(cdiv(n, kernel.plan["vec"] * kernel.plan["threads"]), kernel.plan)
            self.launcher(op).launch(kernel, grid, kernel.plan["threads"],
                                     {**named, **params, "n": n})

    def fused(self, op: OpEntry, args: tuple, out, params: dict) -> tuple:
        n_in, n_out = len(op.inputs), len(op.outputs)
        has_fwdbwd = any(k.stage == "fwdbwd" for k in op.kernels.values())
        if op.kind == "row" and has_fwdbwd:
            return self._row(op, "fwdbwd", args, out, params)
        # No one-pass kernel: forward, then backward into fresh buffers, so that a gradient
        # `out` may alias an input the backward still reads.
        outs = self.forward(op, args[:n_in], None if out is None else tuple(out[:n_out]), params)
        grads = self.backward(op, args, None, params)
        if out is not None:
            for dst, src in zip(out[n_out:], grads):
                dst[...] = src
            grads = tuple(out[n_out:])
        return tuple(outs) + tuple(grads)

    # -- pointwise: every operand the same shape, one flat loop ----------------------------

    def _pointwise(self, op: OpEntry, stage: str, args: tuple, out, params: dict) -> tuple:
        ins = [o.name for o in op.inputs]
        outs = [o.name for o in op.outputs]
        names = ins + ([f"d{o}" for o in outs] if stage == "backward" else [])
        named = dict(zip(names, args))
        shape = args[0].shape
        _same_shape(op, stage, named, shape)
        dtype = storage_dtype_name(args[0])
        kernel = op.kernel(stage, dtype)
        writes = [f"d{g}" for g in op.grads] if stage == "backward" else outs
        results = _outputs(kernel, writes, [shape] * len(writes), out, op, stage)
        values = {**named, **dict(zip(writes, results)), **params, "n": args[0].size}
        arg_names = {n for n, _ in kernel.args}
        if stage == "backward" and arg_names & set(outs):
            # The planner chose to read forward outputs in the backward: recompute them.
            values.update(zip(outs, self._pointwise(op, "forward", args[:len(ins)], None, params)))
        if args[0].size:
            grid, block = pointwise_geometry(kernel.plan, args[0].size)
            self.launcher(op).launch(kernel, grid, block, values)
        return results

    # -- row: [..., cols] rows, weights [cols], one index or scalar per row -------------------

    def _row(self, op: OpEntry, stage: str, args: tuple, out, params: dict) -> tuple:
        sig = _row_sig(op, stage)
        x = args[sig.x]
        if x.ndim < 1 or x.shape[-1] == 0:
            raise EulerError(f"{op.name}.{stage}: row input has shape {tuple(x.shape)}; rows "
                             "need a last axis of length ≥ 1", file=op.spec, key="shape")
        shape = tuple(x.shape)
        cols, lead = shape[-1], shape[:-1]
        by_role = {"row": shape, "weight": (cols,), "index": lead, "scalar": lead}
        for n, r, a in zip(sig.names, sig.roles, args):
            if tuple(a.shape) != by_role[r]:
                raise EulerError(f"{op.name}.{stage}: {n} has shape {tuple(a.shape)}, expected "
                                 f"{by_role[r]} for rows of shape {shape}", file=op.spec, key=n)
        rows = x.size // cols
        dtype = storage_dtype_name(x)
        kernel = row_kernel(op, stage, dtype, cols)
        geom = row_geometry(kernel.plan, rows, cols)
        results = _outputs(kernel, sig.writes, [by_role[r] for r in sig.write_roles], out, op,
                           stage)
        values = dict(zip(sig.names, args))
        values.update(zip(sig.writes, results))
        values.update(params)
        values["rows"], values["cols"] = rows, cols
        if not rows:
            for g in sig.wgrads:
                values[g].fill(0)
            return results
        for g in sig.wgrads:
            values[f"{g}_partials"] = self._workspace(op, g, geom.partials, cols)
        launcher = self.launcher(op)
        launcher.launch(kernel, geom.grid, geom.threads, values)
        for g in sig.wgrads:
            red = op.kernel("wgrad_reduce", dtype)
            grid, block = reduce_geometry(red.plan, cols)
            launcher.launch(red, grid, block, {
                "partials": values[f"{g}_partials"], "dw": values[g],
                "num_partials": geom.partials, "cols": cols, "accumulate": 0})
        return results

    def _workspace(self, op: OpEntry, grad: str, partials: int, cols: int):
        """The float32 [partials, cols] buffer of one weight's per-worker partial sums, kept
        between calls: launches on one stream run in order, so each call's reduce has read
        the buffer before the next call's kernel writes it."""
        import cupy
        key = (op.name, grad, partials, cols)
        if key not in self._workspaces:
            self._workspaces[key] = cupy.empty((partials, cols), dtype=np.float32)
        return self._workspaces[key]

    # -- pair: [B, T, H, D] tensors, element k paired with k + D/2; strided views allowed ------

    def _pair(self, op: OpEntry, stage: str, args: tuple, out, params: dict, pos0: int) -> tuple:
        ins = [o.name for o in op.inputs]
        outs = [o.name for o in op.outputs]
        names = ins + ([f"d{o}" for o in outs] if stage == "backward" else [])
        named = dict(zip(names, args))
        x = args[0]
        if x.ndim != 4 or x.shape[-1] % 2:
            raise EulerError(f"{op.name}.{stage}: expected [B, T, H, D] with D even, got shape "
                             f"{tuple(x.shape)}", file=op.spec, key=names[0])
        _same_shape(op, stage, named, x.shape)
        B, T, H, D = x.shape
        kernel = op.kernel(stage, storage_dtype_name(x))
        writes = [f"d{g}" for g in op.grads] if stage == "backward" else outs
        results = _outputs(kernel, writes, [x.shape] * len(writes), out, op, stage)
        values = {**named, **dict(zip(writes, results)), **params,
                  "B": B, "T": T, "H": H, "D": D, "pos0": pos0}
        if stage == "backward" and {n for n, _ in kernel.args} & set(outs):
            values.update(zip(outs, self._pair(op, "forward", args[:len(ins)], None, params, pos0)))
        for name in list(values):
            a = values[name]
            if hasattr(a, "strides") and f"{name}_sb" in dict(kernel.args):
                item = a.dtype.itemsize
                if a.strides[3] != item:
                    raise EulerError(f"{op.name}.{stage}: {name} must be contiguous along D "
                                     f"(strides {a.strides})", file=op.spec, key=name)
                values[f"{name}_sb"], values[f"{name}_st"], values[f"{name}_sh"] = (
                    s // item for s in a.strides[:3])
        if x.size:
            self.launcher(op).launch(kernel, _grid(B * T, kernel.plan), kernel.plan["threads"],
                                     values, contiguous=False)
        return results

    # -- embedding: out[b, t] = wte[ids[b, t]] (+ wpe[t]); deterministic backward ----------------

    def _embedding_check(self, op: OpEntry, call: str, ids, wte, wpe):
        import cupy
        if ids.ndim < 1 or ids.dtype != np.int32:
            raise EulerError(f"{op.name}.{call}: ids must be int32 [..., T], got {ids.dtype} "
                             f"{tuple(ids.shape)}", file=op.spec, key="ids")
        if wte.ndim != 2:
            raise EulerError(f"{op.name}.{call}: wte must be [vocab, C], got {tuple(wte.shape)}",
                             file=op.spec, key="wte")
        T, C = ids.shape[-1], wte.shape[1]
        if wpe is not None and (wpe.ndim != 2 or wpe.shape[1] != C or wpe.shape[0] < T):
            raise EulerError(f"{op.name}.{call}: wpe has shape {tuple(wpe.shape)}, expected "
                             f"[≥ {T}, {C}]", file=op.spec, key="wpe")
        if ids.size:
            # An id past the table would read (or, backward, write) outside it: one host
            # sync per call buys a clear error instead of an illegal-address fault.
            lo, hi = (int(v) for v in cupy.stack([ids.min(), ids.max()]).get())
            if lo < 0 or hi >= wte.shape[0]:
                raise EulerError(f"{op.name}.{call}: ids span [{lo}, {hi}], the table has "
                                 f"{wte.shape[0]} rows", file=op.spec, key="ids")
        return T, C

    def _embedding_forward(self, op: OpEntry, inputs: tuple, out) -> tuple:
        ids, wte, wpe = inputs
        T, C = self._embedding_check(op, "forward", ids, wte, wpe)
        kernel = op.kernel("forward", storage_dtype_name(wte))
        (y,) = _outputs(kernel, ["out"], [tuple(ids.shape) + (C,)], out, op, "forward")
        bt = ids.size
        if bt:
            plan = kernel.plan
            grid = _grid(cdiv(bt * C, plan["vec"] * plan["threads"]), plan)
            self.launcher(op).launch(kernel, grid, plan["threads"], {
                "ids": ids, "wte": wte, "wpe": NULL if wpe is None else wpe, "out": y, "BT": bt, "T": T,
                "C": C})
        return (y,)

    def _embedding_backward(self, op: OpEntry, args: tuple, out) -> tuple:
        """(dwte, dwpe), written (not added to). Rows of dout are grouped by id after a sort
        of the keys id · BT + position, which are unique, so the order inside a group is
        token order on any sort: each dwte row has one writer and one summation order."""
        import cupy
        ids, wte, wpe, dout = args
        T, C = self._embedding_check(op, "backward", ids, wte, wpe)
        dtype = storage_dtype_name(wte)
        wte_k, wpe_k = op.kernel("backward_wte", dtype), op.kernel("backward_wpe", dtype)
        if tuple(dout.shape) != tuple(ids.shape) + (C,):
            raise EulerError(f"{op.name}.backward: dout has shape {tuple(dout.shape)}, expected "
                             f"{tuple(ids.shape) + (C,)}", file=op.spec, key="dout")
        names, shapes = ["dwte"], [wte.shape]
        if wpe is not None:
            names, shapes = names + ["dwpe"], shapes + [wpe.shape]
        given = None if out is None else tuple(g for g in out if g is not None)
        grads = _outputs(wte_k, names, shapes, given, op, "backward")
        for g in grads:
            g.fill(0)
        bt = ids.size
        if bt:
            flat = ids.reshape(-1).astype(np.int64)
            order = cupy.argsort(flat * bt + cupy.arange(bt, dtype=np.int64))
            sorted_ids = flat[order]
            starts = cupy.flatnonzero(cupy.concatenate([
                cupy.ones(1, dtype=bool), sorted_ids[1:] != sorted_ids[:-1]]))
            segments = int(starts.size)
            offsets = cupy.concatenate([starts, cupy.asarray([bt])]).astype(np.int32)
            plan = wte_k.plan
            self.launcher(op).launch(
                wte_k, (segments, cdiv(C, plan["threads_x"])), plan["threads_x"],
                {"dout": dout, "sorted_pos": order.astype(np.int32), "seg_offsets": offsets,
                 "seg_ids": sorted_ids[starts].astype(np.int32), "dwte": grads[0], "C": C})
            if wpe is not None:
                plan = wpe_k.plan
                self.launcher(op).launch(
                    wpe_k, _grid(cdiv(T * C, plan["threads"]), plan), plan["threads"],
                    {"dout": dout, "dwpe": grads[1], "B": bt // T, "T": T, "C": C})
        return grads + ((None,) if wpe is None else ())
