"""The embedding: out[b, t] = wte[ids[b, t]] (+ wpe[t]), and a deterministic backward that
writes or adds into (`accumulate`) the table gradients. No generated numpy module (no
formula): its numpy reference is here."""
from __future__ import annotations

from math import prod

import numpy as np

from eulergen.errors import EulerError
from eulergen.runtime.engine.kernels import NULL, storage_dtype_name
from eulergen.runtime.engine.kinds.base import OpKind
from eulergen.runtime.engine.launch_args import carve, elements, outputs
from eulergen.runtime.engine.manifest import OpEntry


class Embedding(OpKind):
    name = "embedding"
    accumulates = True

    def module(self, op):
        return _Numpy if op.numpy is None else super().module(op)

    def forward(self, cuda, op, inputs, out, params, fusion="", **keywords):
        return _forward(cuda, op, inputs, out)

    def backward(self, cuda, op, args, out, params, workspace=None, accumulate=(), fusion="",
                 **keywords):
        return _backward(cuda, op, args, out, workspace, accumulate or (False,) * len(op.grads))

    def workspace_elements(self, op, stage, shape, dtype, *, table_rows=0, fusion=""):
        return elements(_layout(op, prod(shape), table_rows)) if stage == "backward" else 0

    def export_launch(self, op, fn, sizes):
        kernel = op.kernel("forward", "f32")
        return kernel, kernel.geometry.launch(sizes["BT"]), {}


KIND = Embedding()


def _layout(op: OpEntry, n: int, rows: int) -> list[tuple[int]]:
    """The backward's workspace for n ids into a table of `rows`, as carve lays it out:
    int64 sort keys, tiled and merged; an int32 first-key rank per table row; and the int32
    list of the runs longer than the geometry's long_run keys (a count, then their ids)."""
    long_run = op.kernel("backward", "f32", part="wte_long").geometry.long_run
    return [(2 * n,), (2 * n,), (rows,), (1 + n // (long_run + 1),)]


def _check(op: OpEntry, call: str, ids, wte, wpe):
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


def _forward(cuda, op: OpEntry, inputs: tuple, out) -> tuple:
    ids, wte, wpe = inputs
    T, C = _check(op, "forward", ids, wte, wpe)
    kernel = op.kernel("forward", storage_dtype_name(wte))
    (y,) = outputs(kernel, ["out"], [tuple(ids.shape) + (C,)], out, op, "forward")
    bt = ids.size
    if bt:
        cuda.launcher(op).launch(kernel, kernel.geometry.launch(bt), {
            "ids": ids, "wte": wte, "wpe": NULL if wpe is None else wpe, "out": y, "BT": bt,
            "T": T, "C": C, "V": wte.shape[0]})
    return (y,)


def _backward(cuda, op: OpEntry, args: tuple, out, workspace, accumulate: tuple) -> tuple:
    """(dwte, dwpe), each written or, where `accumulate` says so, added to. No host
    sync: the ids are sorted on the device by keys id << 32 | position (unique, so
    equal ids stay in token order), then every row of dwte is written as its id's run
    of dout rows summed (zeros where the id does not occur): by one kernel, and the
    runs longer than the geometry's long_run keys, which it lists, by a second. Each element
    has one writer and one summation order, np.add.at's: a rerun gives the same bits.
    The keys live in `workspace` (planned) or in the library's own buffer."""
    ids, wte, wpe, dout = args
    T, C = _check(op, "backward", ids, wte, wpe)
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
    launcher = cuda.launcher(op)
    V = wte.shape[0]
    keys, first, runs = sort_keys(cuda, op, dtype, ids, V, workspace)
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


def sort_keys(cuda, op: OpEntry, dtype: str, ids, rows: int, workspace):
    """The keys id << 32 | position of `ids`, sorted (int64 [n]); for each of the
    table's `rows` n - the rank of its first key (0: absent; int32 [rows]); and the long
    runs' list, its count cleared (int32). In `workspace` or the library's own buffer:
    each tile sorted in shared memory, then every key put at its rank. Two launches, no
    host read; an id outside [0, rows) traps."""
    n = ids.size
    layout = _layout(op, n, rows)
    if workspace is None:
        workspace = cuda.own_workspace(op, "keys", (elements(layout),))
    tiled, keys, first, runs = carve(op, workspace, layout)
    tiled, keys = tiled.view(np.int64), keys.view(np.int64)
    first, runs = first.view(np.int32), runs.view(np.int32)
    sort_k = op.kernel("backward", dtype, part="sort")
    merge_k = op.kernel("backward", dtype, part="merge")
    launcher = cuda.launcher(op)
    launcher.launch(sort_k, sort_k.geometry.launch(n),
                    {"ids": ids, "tiled": tiled, "first": first, "runs": runs, "n": n,
                     "V": rows})
    launcher.launch(merge_k, merge_k.geometry.launch(n),
                    {"tiled": tiled, "keys": keys, "first": first, "n": n})
    return keys, first, runs


class _Numpy:
    """The embedding op on numpy. It has no formula (DESIGN.md: pure data movement), so no
    generated module: out = wte[ids] (+ wpe[:T]); the backward adds rows in token order
    (np.add.at is sequential), the order the GPU kernel sums each id's rows in. The ids
    are on the host here, so their range is checked before use (np.take would wrap a
    negative id)."""

    @staticmethod
    def _check(ids, wte, call: str) -> None:
        if ids.size and (ids.min() < 0 or ids.max() >= wte.shape[0]):
            raise EulerError(f"embedding.{call}: ids span [{ids.min()}, {ids.max()}], the table "
                             f"has {wte.shape[0]} rows", key="ids")

    @staticmethod
    def forward(ids, wte, wpe, *, _out=None):
        """wte[ids] (+ wpe[:T]), into _out[0] where given (mode clip: the ids are checked)."""
        _Numpy._check(ids, wte, "forward")
        y = np.take(wte, ids, axis=0, out=None if _out is None else _out[0], mode="clip")
        if wpe is not None:
            y += wpe[: ids.shape[-1]]
        return y

    @staticmethod
    def backward(ids, wte, wpe, dout, *, out=None, accumulate=(False, False)):
        """(dwte, dwpe): into `out` where given (added to where `accumulate` says), else new."""
        _Numpy._check(ids, wte, "backward")
        out = out or (None, None)
        for name, g, w in zip(("dwte", "dwpe"), out, (wte, wpe)):
            if g is not None and w is not None and g.shape != w.shape:
                raise EulerError(f"embedding.backward: out {name} has shape {g.shape}, "
                                 f"expected {w.shape}", key="out")
        C = wte.shape[1]
        dwte = out[0] if out[0] is not None else np.zeros_like(wte)
        if not accumulate[0]:
            dwte[...] = 0
        np.add.at(dwte, ids.reshape(-1), dout.reshape(-1, C))
        if wpe is None:
            return dwte, None
        T = ids.shape[-1]
        dwpe = out[1] if len(out) > 1 and out[1] is not None else np.zeros_like(wpe)
        if accumulate[1]:
            dwpe[:T] += dout.reshape(-1, T, C).sum(axis=0)
        else:
            dwpe[T:] = 0
            np.sum(dout.reshape(-1, T, C), axis=0, out=dwpe[:T])
        return dwte, dwpe
