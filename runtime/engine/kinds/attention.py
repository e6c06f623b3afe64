"""Attention ops: forward (o, lse), backward (dq, dk, dv from q, k, v, o, lse, do) and
`decode` (new queries over a KV cache), launched by runtime/engine/attention.py (flash
tiling, strided q/k/v) on a GPU; on numpy the materialised module."""
from __future__ import annotations

from math import prod

from eulergen.runtime.engine.attention import (AttentionKernels, attention_backward,
                                               attention_decode, attention_forward,
                                               decode_geometry, decode_splits)
from eulergen.errors import EulerError
from eulergen.runtime.engine.kinds.base import OpKind
from eulergen.runtime.engine.launch_args import carve, elements


class Attention(OpKind):
    name = "attention"
    calls = ("forward", "backward", "fused", "decode")

    def backward_names(self, op, side):
        """q, k, v, then the forward's outputs (o, lse) and o's gradient."""
        return ([o.name for o in side.inputs] + [o.name for o in side.outputs]
                + [f"d{side.outputs[0].name}"])

    def numpy_decode(self, module, q, k_cache, v_cache, pos0: int, params: dict, new=None):
        B, Tq, _, KVH, D, _ = decode_geometry(q, k_cache, v_cache, pos0)
        for cache, rows, name in zip((k_cache, v_cache), new or (), ("new k", "new v")):
            if tuple(rows.shape) != (B, Tq, KVH, D):
                raise EulerError(f"{name}: shape {tuple(rows.shape)}, expected "
                                 f"{(B, Tq, KVH, D)}", key=name)
            cache[:, pos0:pos0 + Tq] = rows
        return module.decode(q, k_cache, v_cache, pos0, **params)

    def forward(self, cuda, op, inputs, out, params, fusion="", **keywords):
        o, lse = (None, None) if out is None else out
        return attention_forward(_kernels(cuda, op), *inputs, out=o, lse=lse, **params)

    def backward(self, cuda, op, args, out, params, workspace=None, accumulate=(), fusion="",
                 **keywords):
        delta = None
        if workspace is not None:
            B, T, H, _ = args[0].shape
            (delta,) = carve(op, workspace, [(B, H, T)])
        return attention_backward(_kernels(cuda, op), *args, out=out, delta=delta, **params)

    def decode(self, cuda, op, q, k_cache, v_cache, pos0: int, out, params: dict,
               keys: int | None = None, workspace=None, new=None):
        return attention_decode(_kernels(cuda, op), q, k_cache, v_cache, pos0, out=out,
                                keys=keys, workspace=workspace, new=new, **params)

    def workspace_elements(self, op, stage, shape, dtype, *, table_rows=0, fusion=""):
        if stage != "backward":
            return 0
        B, T, H, _ = shape
        return elements([(B, H, T)])    # delta = rowsum(dO∘O), [B, H, T]

    def export_launch(self, op, fn, sizes):
        """The decode kernel, unsplit (sms 0: one split over the cache, planned for all its
        keys as the decoder plans it), so it needs no split workspace."""
        kernel = op.kernel("decode", "f32", head_dim=sizes["head_dim"])
        at = kernel.geometry.launch(sizes["batch"], sizes["tq"], sizes["n_heads"],
                                    sizes["n_kv_heads"])
        splits, split_keys = decode_splits(prod(at.grid), sizes["keys"], kernel.geometry.tile, 0)
        return kernel, at, {"part": "NULL", "counts": "NULL", "splits": str(splits),
                            "split_keys": str(split_keys), "kn": "NULL", "vn": "NULL",
                            **{f"{t}_{s}": "0" for t in ("kn", "vn") for s in ("sb", "st", "sh")}}


KIND = Attention()


def _kernels(cuda, op) -> AttentionKernels:
    return cuda.compiled(op, AttentionKernels.from_op)
