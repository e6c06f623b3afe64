"""The files of a transformers `save_pretrained` folder: their names, and the safetensors
weights (one file, or shards listed by model.safetensors.index.json), read through
eulergen/userfiles.py (regular files only, every header field typed and bounded)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from eulergen.errors import EulerError
from eulergen.runtime.data.tokenizer import HF_TOKENIZER_FILE
from eulergen.userfiles import Fields, opened, read_json, read_safetensors, safetensors_header

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER = HF_TOKENIZER_FILE
# the files of tokenizers eulergen does not read: a folder holding them but no
# tokenizer.json is refused naming them, never read as bytes
OTHER_TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer.model", "vocab.txt",
                         "spiece.model", "tokenizer_config.json", "special_tokens_map.json")


def weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, from the index when the weights are
    sharded. Every file the index names must be in the folder."""
    single, index = folder / WEIGHTS, folder / INDEX
    if index.exists():
        fields = Fields(read_json(index, "weights index"), str(index))
        weight_map = fields.fields("weight_map")
        if not weight_map.data:
            raise fields.error("weight_map", "empty: no tensor is in any file")
        files = {}
        for name in weight_map.data:
            file = weight_map.text(name)
            if Path(file).name != file or file in (".", ".."):
                raise weight_map.error(name, f"{file!r} is not a file name in this folder")
            if not (folder / file).exists():
                raise EulerError(f"weight_map: {name} is in {file}, which is missing",
                                 file=str(index))
            files[name] = folder / file
        return files
    if single.exists():
        with opened(single, "weights file") as f:
            names = safetensors_header(f, single)[0]
        if not names:
            raise EulerError("holds no tensors", file=str(single))
        return {name: single for name in names}
    raise EulerError(f"no {WEIGHTS} or {INDEX} (pytorch_model.bin is not read: it is pickle)",
                     file=str(folder))


def read_tensors(files: dict[str, Path], each=None) -> dict[str, np.ndarray]:
    """Every tensor of `files` (name -> file) as float32, each where the index puts it;
    `each()` after each tensor."""
    out: dict[str, np.ndarray] = {}
    for path in dict.fromkeys(files.values()):
        for name, tensor in read_safetensors(path, "weights file", each).items():
            if files.get(name) != path:
                raise EulerError(f"{name} is here but the index puts it in "
                                 f"{files[name].name if name in files else 'no file'}",
                                 file=str(path))
            out[name] = tensor
    missing = sorted(set(files) - set(out))
    if missing:
        raise EulerError(f"{missing[0]} is not in this file, where the index puts it",
                         file=str(files[missing[0]]))
    return out
