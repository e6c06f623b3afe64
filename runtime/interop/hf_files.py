"""The files of a transformers `save_pretrained` folder: config.json, the safetensors
weights (one file, or shards listed by model.safetensors.index.json), and writing such a
folder atomically.

The safetensors reader is our own (the format is an 8-byte header length, a JSON header
of name -> dtype, shape, byte offsets, then the bytes) so that a truncated or inconsistent
file is one error naming the file and the tensor, where the library says only that the
buffer is short.
"""
from __future__ import annotations

import json
import os
import shutil
from math import prod
from pathlib import Path

import numpy as np

from eulergen.errors import EulerError
from eulergen.runtime.data.tokenizer import HF_TOKENIZER_FILE

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER = HF_TOKENIZER_FILE
_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"),
           "F64": np.dtype("<f8")}
_MAX_HEADER = 100 << 20   # the format's own limit on the JSON header


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise EulerError("not found", file=str(path))
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise EulerError(f"invalid JSON: {err}", file=str(path)) from None
    if not isinstance(data, dict):
        raise EulerError("expected a JSON object", file=str(path))
    return data


def weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, from the index when the weights are
    sharded. Every file the index names must exist."""
    single, index = folder / WEIGHTS, folder / INDEX
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise EulerError("weight_map: missing or empty", file=str(index))
        for name, file in weight_map.items():
            if not (folder / str(file)).is_file():
                raise EulerError(f"weight_map: {name} is in {file}, which is missing",
                                 file=str(index))
        return {name: folder / file for name, file in weight_map.items()}
    if single.is_file():
        return {name: single for name in _header(single)[0]}
    raise EulerError(f"no {WEIGHTS} or {INDEX} (pytorch_model.bin is not read: it is pickle)",
                     file=str(folder))


def read_tensors(files: dict[str, Path]) -> dict[str, np.ndarray]:
    """Every tensor of `files` (name -> file) as float32 (f16 and bf16 widen exactly)."""
    out: dict[str, np.ndarray] = {}
    for path in dict.fromkeys(files.values()):
        header, base = _header(path)
        data = np.memmap(path, dtype=np.uint8, mode="r")
        for name, (dtype, shape, begin) in header.items():
            if files.get(name) != path:
                raise EulerError(f"{name} is here but the index puts it in "
                                 f"{files[name].name if name in files else 'no file'}",
                                 file=str(path))
            raw = np.frombuffer(data, dtype=dtype, count=prod(shape), offset=base + begin)
            if dtype == _DTYPES["BF16"]:
                out[name] = (raw.astype(np.uint32) << 16).view(np.float32).reshape(shape)
            else:
                out[name] = raw.astype(np.float32).reshape(shape)
    missing = sorted(set(files) - set(out))
    if missing:
        raise EulerError(f"{missing[0]} is not in this file, where the index puts it",
                         file=str(files[missing[0]]))
    return out


def _header(path: Path) -> tuple[dict[str, tuple[np.dtype, tuple[int, ...], int]], int]:
    """(name -> (dtype, shape, begin offset), where the data starts), every tensor's bytes
    checked to lie inside the file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length < 0 or length > min(size - 8, _MAX_HEADER):
            raise EulerError(f"truncated or not safetensors: a {size}-byte file whose header "
                             f"claims {max(length, 0)} bytes", file=str(path))
        try:
            raw = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise EulerError("not safetensors: the header is not JSON", file=str(path)) from None
    base = 8 + length
    header = {}
    for name, info in raw.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = info["dtype"], tuple(int(n) for n in info["shape"])
            begin, end = (int(n) for n in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise EulerError(f"{name}: malformed header entry {info!r}", file=str(path)) from None
        if dtype not in _DTYPES:
            raise EulerError(f"{name}: dtype {dtype} is not a float type "
                             f"({', '.join(_DTYPES)})", file=str(path))
        want = prod(shape) * _DTYPES[dtype].itemsize
        if end - begin != want:
            raise EulerError(f"{name}: its offsets span {end - begin} bytes, shape {list(shape)} "
                             f"of {dtype} is {want}", file=str(path))
        if base + end > size:
            raise EulerError(f"truncated: {name} ends at byte {base + end}, the file has "
                             f"{size}", file=str(path))
        header[name] = (_DTYPES[dtype], shape, begin)
    return header, base


# -- writing a folder ---------------------------------------------------------------------

def write_folder(out: Path, files: dict[str, bytes | dict[str, np.ndarray]],
                 owned: frozenset[str]) -> None:
    """Write `files` (name -> bytes, or a tensor dict for safetensors) into a temp folder
    beside `out`, then put it in place of `out`. An existing `out` is replaced only when it
    is empty or holds nothing but files of `owned` (an earlier export): a folder with
    anything else in it is refused, untouched."""
    from safetensors.numpy import save_file

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise EulerError("exists and is not a folder", file=str(out), key="--out")
    if out.is_dir():
        foreign = sorted(p.name for p in out.iterdir() if p.name not in owned)
        if foreign:
            raise EulerError(f"holds {foreign[0]!r}, which export did not write: not "
                             "overwritten (name a new or empty folder)", file=str(out), key="--out")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-export-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        for name, content in files.items():
            if isinstance(content, dict):
                save_file({k: np.ascontiguousarray(v) for k, v in content.items()},
                          str(tmp / name), metadata={"format": "pt"})
            else:
                (tmp / name).write_bytes(content)
        if out.is_dir():
            old = out.parent / f".tmp-export-old-{out.name}-{os.getpid()}"
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
