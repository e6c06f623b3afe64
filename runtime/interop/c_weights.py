"""weights.bin of `eulergen export-c`: the model's parameters in one file with a small header
(README.md of the folder and templates/c/weights.h document it; weights.c reads it).

    header  HEADER_INTS little-endian int32: FIELDS in order (floats as their float32 bits),
            then zeros
    table   TABLE_BYTES a tensor: its name (NAME_BYTES, NUL padded), int32 ndim, dim 0,
            dim 1 (0 for a vector)
    data    each tensor's float32 values, row-major, each at a multiple of ALIGN bytes

The program is exported for one model: model.c holds the header it expects (`header`) and
the table, so a file of another model, a truncated one or something else is refused.
"""
from __future__ import annotations

import struct
import zlib

import numpy as np

from eulergen.errors import EulerError
from eulergen.runtime.model.params import parameters

MAGIC = struct.unpack("<i", b"EGW1")[0]
VERSION = 1
FLOAT32 = 0
HEADER_INTS, TABLE_BYTES, NAME_BYTES, ALIGN = 256, 64, 52, 64


def op_names(a) -> str:
    """The ops the model runs, as the header's `ops` field hashes them."""
    ops = a.ops
    names = [ops.norm.name, ops.activation.name, ops.attention.name]
    return ",".join(names + ([ops.rope.name] if ops.rope else []))


def _bits(value: float) -> int:
    return struct.unpack("<i", struct.pack("<f", value))[0]


def header(a) -> list[tuple[str, int, bool]]:
    """(name, int32 value, a float's bits?) of each header field for an Arch."""
    ints = [("magic", MAGIC), ("version", VERSION), ("dtype", FLOAT32),
            ("layers", a.layers), ("hidden_dim", a.d), ("num_heads", a.heads),
            ("num_kv_heads", a.kv_heads), ("head_dim", a.head_dim), ("vocab_size", a.vocab),
            ("vocab_rows", a.vocab_rows), ("max_seq_len", a.max_seq), ("mlp_hidden", a.ffn),
            ("gated", int(a.gated)), ("rope", int(a.rope)), ("bias", int(a.bias)),
            ("norm_weights", len(a.norm_weights)), ("tensors", len(parameters(a))),
            ("ops (CRC-32 of their names)", struct.unpack("<i", struct.pack(
                "<I", zlib.crc32(op_names(a).encode())))[0])]
    floats = [("norm_eps", a.norm_params.get("eps", 0.0)),
              ("rope_base", a.rope_params.get("base", 0.0))]
    return [(n, v, False) for n, v in ints] + [(n, _bits(v), True) for n, v in floats]


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def weights_bytes(a, params: dict) -> bytes:
    """The file for an Arch's parameters (name -> float32 array, every one of them)."""
    specs = parameters(a)
    for spec in specs:
        if spec.name not in params:
            raise EulerError(f"the checkpoint has no {spec.name!r}", key="weights")
        shape = tuple(np.shape(params[spec.name]))
        if shape != spec.shape:
            raise EulerError(f"{spec.name} has shape {shape}, the model wants {spec.shape}",
                             key="weights")
    ints = [v for _, v, _ in header(a)]
    parts = [struct.pack(f"<{HEADER_INTS}i", *ints, *[0] * (HEADER_INTS - len(ints)))]
    for spec in specs:
        name = spec.name.encode()
        if len(name) >= NAME_BYTES:
            raise EulerError(f"tensor name {spec.name!r} is longer than {NAME_BYTES - 1} bytes",
                             key="weights")
        dims = (*spec.shape, 0)[:2]
        parts.append(name.ljust(NAME_BYTES, b"\0") + struct.pack("<3i", len(spec.shape), *dims))
    at = sum(map(len, parts))
    for spec in specs:
        pad = _aligned(at) - at
        data = np.ascontiguousarray(params[spec.name], dtype="<f4").tobytes()
        parts += [b"\0" * pad, data]
        at += pad + len(data)
    return b"".join(parts)
