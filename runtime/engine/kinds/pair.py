"""Pair ops on a GPU: [B, T, H, D] tensors, element k paired with k + D/2; strided views
allowed (each operand passes its batch, token and head strides). A call takes `pos0=`, the
position of the first token (decoding with a KV cache): a launch argument, and a keyword of
the generated numpy module, not a spec parameter."""
from __future__ import annotations

from eulergen.errors import EulerError
from eulergen.runtime.engine.kernels import storage_dtype_name
from eulergen.runtime.engine.kinds.base import OpKind
from eulergen.runtime.engine.launch_args import outputs, same_shape
from eulergen.runtime.engine.manifest import OpEntry


class Pair(OpKind):
    name = "pair"

    def keywords(self, params):
        return {"pos0": int(params.pop("pos0", 0))}

    def forward(self, cuda, op, inputs, out, params, fusion="", pos0: int = 0):
        return _call(cuda, op, "forward", inputs, out, params, pos0)

    def backward(self, cuda, op, args, out, params, workspace=None, accumulate=(), fusion="",
                 pos0: int = 0):
        return _call(cuda, op, "backward", args, out, params, pos0)

    def export_launch(self, op, fn, sizes):
        kernel = op.kernel("forward", "f32")
        return kernel, kernel.geometry.launch(sizes["B"] * sizes["T"], sizes["H"], sizes["D"]), {}


KIND = Pair()


def _call(cuda, op: OpEntry, stage: str, args: tuple, out, params: dict, pos0: int) -> tuple:
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
        values.update(zip(outs, _call(cuda, op, "forward", args[:len(ins)], None, params, pos0)))
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
        cuda.launcher(op).launch(kernel, kernel.geometry.launch(B * T, H, D), values,
                                 contiguous=False)
    return results
