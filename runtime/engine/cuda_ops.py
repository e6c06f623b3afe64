"""The CUDA half of runtime/engine/ops.py: forward, backward, step and fused calls of manifest
ops on CuPy arrays, one method per op kind.

Each call checks its arrays' shapes against one another (dtypes, contiguity and devices
are checked in kernels.bind), allocates the outputs it was not given in the storage type
the kernel writes, and launches the kernels with their geometry (eulergen/launch.py). Weight
gradients of row ops go through a float32 workspace of per-worker partial sums and the
op's `wgrad_reduce` kernel (deterministic: fixed order, no atomics); over long rows the
backward is split (`backward_rows` writes dx and per-row values, `wgrad_cols` sums the
weight terms by columns: generator/plan.py WGRAD_SPLIT_COLS). Attention is
launched by runtime/engine/attention.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import prod

import numpy as np

from eulergen.errors import EulerError
from eulergen.runtime.engine.bias_ops import bias_call, bias_layout
from eulergen.runtime.engine.kernels import (NULL, Launcher, row_aligned, row_kernel,
                                      storage_dtype_name, wgrad_split)
from eulergen.runtime.engine.launch_args import carve, elements, outputs, same_shape
from eulergen.runtime.engine.manifest import OpEntry
from eulergen.signature import select


@dataclass(frozen=True)
class RowSig:
    """What one stage of a row op reads and writes, by name and role (computed once)."""
    names: tuple[str, ...]        # the call's arrays in order: inputs, then output grads
    roles: tuple[str, ...]        # 'row' | 'weight' | 'index' | 'scalar' for each
    x: int                        # position of the first row input (it sets the shape)
    writes: tuple[str, ...]       # forward outputs, then input grads, in GRADS order
    write_roles: tuple[str, ...]
    wgrads: tuple[str, ...]       # the weight grads among `writes` (workspace + reduce)
    row_ptrs: tuple[str, ...]     # the row operands among names and writes, and the weights
    weight_ptrs: tuple[str, ...]  # among names: what kernels.row_aligned checks


@lru_cache(maxsize=None)
def _row_sig(op: OpEntry, stage: str, fusion: str = "") -> RowSig:
    """`fusion`: of the op's fused variant (manifest.Fusion) of that name."""
    side = op if not fusion else getattr(op.fusions[fusion],
                                         "backward" if stage == "backward" else "forward")
    douts = [o for o in side.outputs if stage == "backward" or
             (stage == "fwdbwd" and o.role == "scalar")]
    names = tuple(o.name for o in side.inputs) + tuple(f"d{o.name}" for o in douts)
    roles = tuple(o.role for o in side.inputs) + tuple(o.role for o in douts)
    fwd = [o for o in side.outputs] if stage in ("forward", "fwdbwd") else []
    grads = [o for o in side.inputs if o.differentiable] if stage != "forward" else []
    writes = tuple(o.name for o in fwd) + tuple(f"d{o.name}" for o in grads)
    write_roles = tuple(o.role for o in fwd) + tuple(o.role for o in grads)
    return RowSig(names, roles, roles.index("row"), writes, write_roles,
                  tuple(f"d{o.name}" for o in grads if o.role == "weight"),
                  tuple(n for n, r in zip(names + writes, roles + write_roles) if r == "row"),
                  tuple(n for n, r in zip(names, roles) if r == "weight"))


def workspace_elements(op: OpEntry, stage: str, shape, dtype: str = "f32", *,
                       table_rows: int = 0, fusion: str = "") -> int:
    """The float32 elements a `stage` call of `op` (its `fusion` variant) needs from a
    caller's `workspace` (0: none) for inputs of `shape` (a row op's row input, a pointwise
    op's, attention's q [B, T, H, D], the embedding's ids, with `table_rows` the rows of
    its token table). Pure: a memory planner calls it without a GPU."""
    if op.kind == "row":
        return elements(_row_layout(op, stage, dtype, prod(shape[:-1]), shape[-1], fusion)[1])
    if op.kind == "pointwise" and fusion:
        return elements(bias_layout(op, stage, dtype, shape))
    if op.kind == "attention" and stage == "backward":
        B, T, H, _ = shape
        return elements([(B, H, T)])    # delta = rowsum(dO∘O), [B, H, T]
    if op.kind == "embedding" and stage == "backward":
        return elements(_embedding_layout(op, prod(shape), table_rows))
    return 0


def _row_layout(op: OpEntry, stage: str, dtype: str, rows: int, cols: int,
                fusion: str = "") -> tuple[bool, list[tuple]]:
    """Whether a row op's `stage` call (of its `fusion` variant) over `rows` rows of `cols`
    takes the split backward (wgrad_split), and its workspace as carve lays it out: a
    [partials, cols] float32 row of partial sums per weight gradient, after the split
    backward's [rows, row_stats] per-row values where it takes that. A fused variant's
    split backward shares the op's wgrad_cols kernel."""
    sig = _row_sig(op, stage, fusion)
    if not sig.wgrads:
        return False, []
    if wgrad_split(op, dtype, cols, fusion):
        by_cols = op.kernel("backward", dtype, part="cols").geometry
        groups = by_cols.launch(rows, cols).partials
        return True, [(rows, by_cols.row_stats)] + [(groups, cols)] * len(sig.wgrads)
    kernel = row_kernel(op, stage, dtype, cols, fusion=fusion)
    partials = kernel.geometry.launch(rows, cols).partials
    return False, [(partials, cols)] * len(sig.wgrads)


def _embedding_layout(op: OpEntry, n: int, rows: int) -> list[tuple[int]]:
    """The backward's workspace for n ids into a table of `rows`, as carve lays it out:
    int64 sort keys, tiled and merged; an int32 first-key rank per table row; and the int32
    list of the runs longer than the geometry's long_run keys (a count, then their ids)."""
    long_run = op.kernel("backward", "f32", part="wte_long").geometry.long_run
    return [(2 * n,), (2 * n,), (rows,), (1 + n // (long_run + 1),)]


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
        """Attention kernels are launched by runtime/engine/attention.py (flash tiling, strided q/k/v)."""
        from eulergen.runtime.engine.attention import AttentionKernels
        key = (op.name, str(op.cuda), op.cuda_sha256)
        if key not in self._attention:
            self._attention[key] = AttentionKernels.from_op(op)
        return self._attention[key]

    def forward(self, op: OpEntry, inputs: tuple, out, params: dict, pos0: int = 0,
                fusion: str = "") -> tuple:
        """`fusion`: the op's fused variant of that name (ops.py)."""
        if op.kind == "pointwise" and fusion:
            return bias_call(self, op, "forward", inputs, out, params)
        if op.kind == "pointwise":
            return self._pointwise(op, "forward", inputs, out, params)
        if op.kind == "row":
            return self._row(op, "forward", inputs, out, params, fusion=fusion)
        if op.kind == "pair":
            return self._pair(op, "forward", inputs, out, params, pos0)
        if op.kind == "embedding":
            return self._embedding_forward(op, inputs, out)
        if op.kind == "attention":
            from eulergen.runtime.engine.attention import attention_forward
            o, lse = (None, None) if out is None else out
            return attention_forward(self.attention(op), *inputs, out=o, lse=lse, **params)
        raise EulerError(f"op {op.name!r}: kind {op.kind!r} has no CUDA forward",
                         file=op.spec, key="kind")

    def backward(self, op: OpEntry, args: tuple, out, params: dict, pos0: int = 0,
                 workspace=None, accumulate: tuple = (), fusion: str = "") -> tuple:
        """`workspace`: a float32 buffer of workspace_elements(op, 'backward', …) elements
        for the kernels' temporaries (a planned buffer); None: the library's own.
        `accumulate`: per gradient, add into `out` rather than overwrite (embedding only).
        `fusion`: the op's fused variant of that name (ops.py)."""
        if op.kind == "pointwise" and fusion:
            return bias_call(self, op, "backward", args, out, params, workspace)
        if op.kind == "pointwise":
            return self._pointwise(op, "backward", args, out, params)
        if op.kind == "row":
            return self._row(op, "backward", args, out, params, workspace, fusion)
        if op.kind == "pair":
            return self._pair(op, "backward", args, out, params, pos0)
        if op.kind == "embedding":
            return self._embedding_backward(op, args, out, workspace,
                                            accumulate or (False,) * len(op.grads))
        if op.kind == "attention":
            from eulergen.runtime.engine.attention import attention_backward
            delta = None
            if workspace is not None:
                B, T, H, _ = args[0].shape
                (delta,) = carve(op, workspace, [(B, H, T)])
            return attention_backward(self.attention(op), *args, out=out, delta=delta, **params)
        raise EulerError(f"op {op.name!r}: kind {op.kind!r} has no CUDA backward",
                         file=op.spec, key="kind")

    def decode(self, op: OpEntry, q, k_cache, v_cache, pos0: int, out, params: dict,
               keys: int | None = None, workspace=None):
        """New queries over a KV cache: runtime/engine/attention.py's attention_decode."""
        from eulergen.runtime.engine.attention import attention_decode
        return attention_decode(self.attention(op), q, k_cache, v_cache, pos0, out=out,
                                keys=keys, workspace=workspace, **params)

    def step(self, op: OpEntry, args: tuple, params: dict, control, copy=None) -> None:
        """An update op over flat buffers: state float32, grads in the storage dtype; every
        operand the same shape (the caller launches once per weight-decay range). `control`:
        the float32 device array of the kernel's control slots; `copy`: a bf16 array the
        bf16 kernel writes the updated weight into (None: not written)."""
        named = dict(zip((o.name for o in op.inputs), args))
        same_shape(op, "step", named, args[0].shape)
        grads = [a for o, a in zip(op.inputs, args) if o.role == "grad"]
        kernel = op.kernel("step", storage_dtype_name(grads[0]) if grads else "f32")
        # the pointer the signature has beyond the operands and control: the bf16 copy
        extra = [n for n, t in kernel.args if t.endswith("*") and n not in named and n != "control"]
        if copy is not None and (not extra or tuple(copy.shape) != tuple(args[0].shape)):
            raise EulerError(f"{op.name}.step: copy= wants bf16 grads and the weight's shape "
                             f"{tuple(args[0].shape)}, got {tuple(copy.shape)} for {kernel.name}",
                             file=op.spec, key="copy")
        n = args[0].size
        values = {**named, **params, "control": control, "n": n,
                  **{e: NULL if copy is None else copy for e in extra}}
        if n:
            self.launcher(op).launch(kernel, kernel.geometry.launch(n), values)

    def fused(self, op: OpEntry, args: tuple, out, params: dict) -> tuple:
        n_in, n_out = len(op.inputs), len(op.outputs)
        has_fwdbwd = bool(select(op.kernels.values(), "fwdbwd"))
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
        same_shape(op, stage, named, shape)
        dtype = storage_dtype_name(args[0])
        kernel = op.kernel(stage, dtype)
        writes = [f"d{g}" for g in op.grads] if stage == "backward" else outs
        results = outputs(kernel, writes, [shape] * len(writes), out, op, stage)
        values = {**named, **dict(zip(writes, results)), **params, "n": args[0].size}
        arg_names = {n for n, _ in kernel.args}
        if stage == "backward" and arg_names & set(outs):
            # The planner chose to read forward outputs in the backward: recompute them.
            values.update(zip(outs, self._pointwise(op, "forward", args[:len(ins)], None, params)))
        if args[0].size:
            self.launcher(op).launch(kernel, kernel.geometry.launch(args[0].size), values)
        return results

    # -- row: [..., cols] rows, weights [cols], one index or scalar per row -------------------

    def _row(self, op: OpEntry, stage: str, args: tuple, out, params: dict,
             workspace=None, fusion: str = "") -> tuple:
        sig = _row_sig(op, stage, fusion)
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
        split, layout = _row_layout(op, stage, dtype, rows, cols, fusion)
        part = "rows" if split else ""
        kernel = row_kernel(op, stage, dtype, cols, part=part, fusion=fusion)
        results = outputs(kernel, sig.writes, [by_role[r] for r in sig.write_roles], out, op,
                           stage)
        values = dict(zip(sig.names, args))
        values.update(zip(sig.writes, results))
        values.update(params)
        values["rows"], values["cols"] = rows, cols
        aligned = row_aligned([values[n].data.ptr for n in sig.row_ptrs],
                              [values[n].data.ptr for n in sig.weight_ptrs],
                              cols * x.itemsize, bool(sig.wgrads))
        if not aligned:
            kernel = row_kernel(op, stage, dtype, cols, aligned=False, part=part, fusion=fusion)
        if not rows:
            for g in sig.wgrads:
                values[g].fill(0)
            return results
        if workspace is not None:
            views = carve(op, workspace, layout)
        else:
            views = [self.own_workspace(op, n, shape) for n, shape in
                     zip((["rowstats"] if split else []) + list(sig.wgrads), layout)]
        if split:
            values["rowstats"] = views.pop(0)
        for g, view in zip(sig.wgrads, views):
            values[f"{g}_partials"] = view
        launcher = self.launcher(op)
        at = kernel.geometry.launch(rows, cols)
        launcher.launch(kernel, at, values)
        if split:
            cols_kernel = row_kernel(op, "backward", dtype, cols, aligned, part="cols")
            at = cols_kernel.geometry.launch(rows, cols)
            launcher.launch(cols_kernel, at, values)
        partials = at.partials
        red = op.kernel("backward", dtype, part="reduce") if sig.wgrads else None
        for g in sig.wgrads:
            launcher.launch(red, red.geometry.launch(cols), {
                "partials": values[f"{g}_partials"], "dw": values[g],
                "num_partials": partials, "cols": cols, "accumulate": 0})
        return results

    def own_workspace(self, op: OpEntry, name: str, shape: tuple):
        """A float32 buffer of the kernels' temporaries (a row weight's per-worker partial
        sums, the split backward's per-row values, the embedding's sort keys) when the
        caller gave no workspace; kept between calls: launches on one stream run in order,
        so each call's last kernel has read the buffer before the next call's first writes
        it."""
        import cupy
        key = (op.name, name, shape)
        if key not in self._workspaces:
            self._workspaces[key] = cupy.empty(shape, dtype=np.float32)
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
        same_shape(op, stage, named, x.shape)
        B, T, H, D = x.shape
        if B * T >= 2 ** 31:
            raise EulerError(f"{op.name}.{stage}: {B} x {T} tokens; at most 2^31 - 1 per call "
                             "(the kernels count tokens in 32 bits)", file=op.spec, key=names[0])
        kernel = op.kernel(stage, storage_dtype_name(x))
        writes = [f"d{g}" for g in op.grads] if stage == "backward" else outs
        results = outputs(kernel, writes, [x.shape] * len(writes), out, op, stage)
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
            self.launcher(op).launch(kernel, kernel.geometry.launch(B * T, H, D), values,
                                     contiguous=False)
        return results

    # -- embedding: out[b, t] = wte[ids[b, t]] (+ wpe[t]); deterministic backward ----------------

    def _embedding_check(self, op: OpEntry, call: str, ids, wte, wpe):
        """Shapes only. The ids' range is checked by the kernels (templates/embedding.cu.j2:
        an id outside the table traps, so the launch fails at the next synchronisation):
        reading the ids back here would cost a device-to-host sync every call. Ids that
        come from the host are checked there (GPT.load_tokens, the numpy backend)."""
        if ids.ndim < 1 or ids.dtype != np.int32:
            raise EulerError(f"{op.name}.{call}: ids must be int32 [..., T], got {ids.dtype} "
                             f"{tuple(ids.shape)}", file=op.spec, key="ids")
        if ids.size >= 2 ** 31:
            raise EulerError(f"{op.name}.{call}: {ids.size} ids; at most 2^31 - 1 per call",
                             file=op.spec, key="ids")
        if wte.ndim != 2:
            raise EulerError(f"{op.name}.{call}: wte must be [vocab, C], got {tuple(wte.shape)}",
                             file=op.spec, key="wte")
        T, C = ids.shape[-1], wte.shape[1]
        if wpe is not None and (wpe.ndim != 2 or wpe.shape[1] != C or wpe.shape[0] < T):
            raise EulerError(f"{op.name}.{call}: wpe has shape {tuple(wpe.shape)}, expected "
                             f"[≥ {T}, {C}]", file=op.spec, key="wpe")
        return T, C

    def _embedding_forward(self, op: OpEntry, inputs: tuple, out) -> tuple:
        ids, wte, wpe = inputs
        T, C = self._embedding_check(op, "forward", ids, wte, wpe)
        kernel = op.kernel("forward", storage_dtype_name(wte))
        (y,) = outputs(kernel, ["out"], [tuple(ids.shape) + (C,)], out, op, "forward")
        bt = ids.size
        if bt:
            self.launcher(op).launch(kernel, kernel.geometry.launch(bt), {
                "ids": ids, "wte": wte, "wpe": NULL if wpe is None else wpe, "out": y, "BT": bt,
                "T": T, "C": C, "V": wte.shape[0]})
        return (y,)

    def _embedding_backward(self, op: OpEntry, args: tuple, out, workspace,
                            accumulate: tuple) -> tuple:
        """(dwte, dwpe), each written or, where `accumulate` says so, added to. No host
        sync: the ids are sorted on the device by keys id << 32 | position (unique, so
        equal ids stay in token order), then every row of dwte is written as its id's run
        of dout rows summed (zeros where the id does not occur): by one kernel, and the
        runs longer than the geometry's long_run keys, which it lists, by a second. Each element
        has one writer and one summation order, np.add.at's: a rerun gives the same bits.
        The keys live in `workspace` (planned) or in the library's own buffer."""
        ids, wte, wpe, dout = args
        T, C = self._embedding_check(op, "backward", ids, wte, wpe)
        dtype = storage_dtype_name(wte)
        if tuple(dout.shape) != tuple(ids.shape) + (C,):
            raise EulerError(f"{op.name}.backward: dout has shape {tuple(dout.shape)}, expected "
                             f"{tuple(ids.shape) + (C,)}", file=op.spec, key="dout")
        names, shapes = ["dwte"], [wte.shape]
        if wpe is not None:
            names, shapes = names + ["dwpe"], shapes + [wpe.shape]
        given = None if out is None else tuple(g for g in out if g is not None)
        wte_k = op.kernel("backward", dtype, part="wte")
        grads = outputs(wte_k, names, shapes, given, op, "backward")
        add_wte, add_wpe = accumulate
        n = ids.size
        if wpe is not None and not add_wpe and wpe.shape[0] > (T if n else 0):
            grads[1][T if n else 0:].fill(0)   # positions the wpe kernel does not write
        if not n:
            if not add_wte:
                grads[0].fill(0)
            return grads + ((None,) if wpe is None else ())
        launcher = self.launcher(op)
        V = wte.shape[0]
        keys, first, runs = self._embedding_sort(op, dtype, ids, V, workspace)
        use_vec = (C % wte_k.geometry.vec == 0
                   and (dout.data.ptr | grads[0].data.ptr) % 16 == 0)
        sums = {"dout": dout, "keys": keys, "first": first, "runs": runs, "dwte": grads[0],
                "n": n, "C": C, "vec": int(use_vec), "accumulate": int(add_wte)}
        launcher.launch(wte_k, wte_k.geometry.launch(V, C, use_vec), dict(sums, V=V))
        long_k = op.kernel("backward", dtype, part="wte_long")
        launcher.launch(long_k, long_k.geometry.launch(runs.size - 1, C, use_vec), sums)
        if wpe is not None:
            wpe_k = op.kernel("backward", dtype, part="wpe")
            launcher.launch(wpe_k, wpe_k.geometry.launch(T * C), {
                "dout": dout, "dwpe": grads[1], "B": n // T, "T": T, "C": C,
                "accumulate": int(add_wpe)})
        return grads + ((None,) if wpe is None else ())

    def _embedding_sort(self, op: OpEntry, dtype: str, ids, rows: int, workspace):
        """The keys id << 32 | position of `ids`, sorted (int64 [n]); for each of the
        table's `rows` n - the rank of its first key (0: absent; int32 [rows]); and the long
        runs' list, its count cleared (int32). In `workspace` or the library's own buffer:
        each tile sorted in shared memory, then every key put at its rank. Two launches, no
        host read; an id outside [0, rows) traps."""
        n = ids.size
        layout = _embedding_layout(op, n, rows)
        if workspace is None:
            workspace = self.own_workspace(op, "keys", (elements(layout),))
        tiled, keys, first, runs = carve(op, workspace, layout)
        tiled, keys = tiled.view(np.int64), keys.view(np.int64)
        first, runs = first.view(np.int32), runs.view(np.int32)
        sort_k = op.kernel("backward", dtype, part="sort")
        merge_k = op.kernel("backward", dtype, part="merge")
        launcher = self.launcher(op)
        launcher.launch(sort_k, sort_k.geometry.launch(n),
                        {"ids": ids, "tiled": tiled, "first": first, "runs": runs, "n": n,
                         "V": rows})
        launcher.launch(merge_k, merge_k.geometry.launch(n),
                        {"tiled": tiled, "keys": keys, "first": first, "n": n})
        return keys, first, runs
