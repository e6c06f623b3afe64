"""Pointwise ops on a GPU: every operand of one shape, one flat loop; and the `bias` variant
(generator/fuse.py): the op of x + b for inputs x [..., F] and biases b [F] broadcast over
the rows, and its backward, which also writes each bias's gradient, the column sums of dx:
the backward kernel's row groups write float32 partial rows, the op's reduce kernel sums
them in a fixed order (no float atomics), as the row ops' weight gradients are summed."""
from __future__ import annotations

from math import prod

from eulergen.errors import EulerError
from eulergen.runtime.engine.kernels import storage_dtype_name
from eulergen.runtime.engine.kinds.base import OpKind
from eulergen.runtime.engine.launch_args import carve, elements, outputs, same_shape
from eulergen.runtime.engine.manifest import OpEntry

BIAS = "bias"


class Pointwise(OpKind):
    name = "pointwise"

    def forward(self, cuda, op, inputs, out, params, fusion="", **keywords):
        if fusion:
            return _bias_call(cuda, op, "forward", inputs, out, params)
        return _call(cuda, op, "forward", inputs, out, params)

    def backward(self, cuda, op, args, out, params, workspace=None, accumulate=(), fusion="",
                 **keywords):
        if fusion:
            return _bias_call(cuda, op, "backward", args, out, params, workspace)
        return _call(cuda, op, "backward", args, out, params)

    def workspace_elements(self, op, stage, shape, dtype, *, table_rows=0, fusion=""):
        return elements(_bias_layout(op, stage, dtype, shape)) if fusion else 0

    def export_launch(self, op, fn, sizes):
        if not fn.fusion:
            kernel = op.kernel("forward", "f32")
            return kernel, kernel.geometry.launch(sizes["n"]), {}
        kernel = op.kernel("forward", "f32", fusion=BIAS, aligned=sizes["cols"] * 4 % 16 == 0)
        return kernel, kernel.geometry.launch(sizes["rows"], sizes["cols"]), {}


KIND = Pointwise()


def _call(cuda, op: OpEntry, stage: str, args: tuple, out, params: dict) -> tuple:
    ins = [o.name for o in op.inputs]
    outs = [o.name for o in op.outputs]
    names = ins + ([f"d{o}" for o in outs] if stage == "backward" else [])
    named = dict(zip(names, args))
    shape = args[0].shape
    same_shape(op, stage, named, shape)
    kernel = op.kernel(stage, storage_dtype_name(args[0]))
    writes = [f"d{g}" for g in op.grads] if stage == "backward" else outs
    results = outputs(kernel, writes, [shape] * len(writes), out, op, stage)
    values = {**named, **dict(zip(writes, results)), **params, "n": args[0].size}
    arg_names = {n for n, _ in kernel.args}
    if stage == "backward" and arg_names & set(outs):
        # The planner chose to read forward outputs in the backward: recompute them.
        values.update(zip(outs, _call(cuda, op, "forward", args[:len(ins)], None, params)))
    if args[0].size:
        cuda.launcher(op).launch(kernel, kernel.geometry.launch(args[0].size), values)
    return results


def _bias_grads(op: OpEntry) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The bias backward's row gradients and its bias gradients, by name."""
    side = op.fusions[BIAS].backward
    biases = {o.name for o in side.inputs if o.role == "bias"}
    rows = tuple(f"d{g}" for g in side.grads if g not in biases)
    return rows, tuple(f"d{g}" for g in side.grads if g in biases)


def _bias_layout(op: OpEntry, stage: str, dtype: str, shape) -> list[tuple[int, int]]:
    """The bias backward's workspace for inputs of `shape` [..., F], as carve lays it out: a
    [row groups, F] float32 block of partial sums per bias gradient (none for a forward)."""
    if stage != "backward":
        return []
    cols = shape[-1]
    kernel = op.kernel("backward", dtype, fusion=BIAS)
    groups = kernel.geometry.launch(prod(shape[:-1]), cols).partials
    return [(groups, cols)] * len(_bias_grads(op)[1])


def _bias_kernel(op: OpEntry, stage: str, dtype: str, itemsize: int, cols: int, arrays):
    """The stage's entry point for 16-byte access where every row of every operand takes it
    (whole vectors a row, each array on a 16-byte boundary), else the one for any."""
    aligned = (cols * itemsize % 16 == 0 and all(a.data.ptr % 16 == 0 for a in arrays))
    return op.kernel(stage, dtype, fusion=BIAS, aligned=aligned)


def _bias_call(cuda, op: OpEntry, stage: str, args: tuple, out, params: dict,
               workspace=None) -> tuple:
    """forward (x…, b…) -> outputs, or backward (x…, b…, d<outputs>…) -> (dx…, db…);
    `workspace` as for a row op's backward (None: `cuda`'s own)."""
    side = op.fusions[BIAS].forward
    names = [o.name for o in side.inputs]
    if stage == "backward":
        names += [f"d{o.name}" for o in side.outputs]
    named = dict(zip(names, args))
    x = args[0]
    if x.ndim < 1 or x.shape[-1] == 0:
        raise EulerError(f"{op.name}.{stage} (bias): input has shape {tuple(x.shape)}; the "
                         "bias runs along a last axis of length ≥ 1", file=op.spec, key="shape")
    shape, cols = tuple(x.shape), x.shape[-1]
    roles = {o.name: o.role for o in side.inputs}
    for n, a in named.items():
        want = (cols,) if roles.get(n) == "bias" else shape
        if tuple(a.shape) != want:
            raise EulerError(f"{op.name}.{stage} (bias): {n} has shape {tuple(a.shape)}, "
                             f"expected {want} for inputs of shape {shape}", file=op.spec, key=n)
    dtype = storage_dtype_name(x)
    row_grads, bias_grads = _bias_grads(op) if stage == "backward" else ((), ())
    writes = list(row_grads + bias_grads) if stage == "backward" else [o.name for o in side.outputs]
    results = outputs(op.kernel(stage, dtype, fusion=BIAS), writes,
                      [(cols,) if w in bias_grads else shape for w in writes], out, op,
                      f"{stage} (bias)")
    rows = x.size // cols
    if not rows:
        for g in bias_grads:
            results[writes.index(g)].fill(0)
        return results
    values = {**named, **dict(zip(writes, results)), **params, "rows": rows, "cols": cols}
    arrays = [values[n] for n in names] + [values[n] for n in row_grads or writes]
    kernel = _bias_kernel(op, stage, dtype, x.dtype.itemsize, cols, arrays)
    layout = _bias_layout(op, stage, dtype, shape)
    views = (carve(op, workspace, layout) if workspace is not None else
             [cuda.own_workspace(op, f"{g}_partials", s) for g, s in zip(bias_grads, layout)])
    values.update((f"{g}_partials", v) for g, v in zip(bias_grads, views))
    launcher = cuda.launcher(op)
    at = kernel.geometry.launch(rows, cols)
    launcher.launch(kernel, at, values)
    for g in bias_grads:   # the reduce of the gradient's own dtype (autocast: float32)
        reduce = op.kernel("backward", storage_dtype_name(values[g]), part="reduce", fusion=BIAS)
        launcher.launch(reduce, reduce.geometry.launch(cols), {
            "partials": values[f"{g}_partials"], "dw": values[g],
            "num_partials": at.partials, "cols": cols, "accumulate": 0})
    return results
