"""A bad-input case and what cases share: command lines, shared fixtures, special files, and
builders of hostile bytes (YAML bombs, shards, safetensors headers, tokenizer JSON).

`files` maps a path in the case's folder to its text (str), its bytes, or a Special: FIFO
(a named pipe), link(target) (a symlink), sparse(size) (a file of that size, holes only),
GONE (a fixture's file taken away); `uses` copies shared fixtures in (tests/test_bad_inputs.py:
"shard" as data/text_train.bin, "run" a finished two-step run, "nanrun" that run with a NaN
weight, "tokrun" that run recording a tok.json tokenizer other than the one a case brings,
"hf" a GPT-2 folder as transformers saves one, with a byte-level tokenizer.json).
`where` is the file, key or flag the message must name (the first path in `files` when
not given); `says` a fragment of it. `new_files`: the command may create files, never
change one that was there. `seconds`: the bound it must answer within. `fault`: the class
of failure the case guards against (FAULTS), `surface` what it feeds (set per module)."""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field, replace

import numpy as np

FAULTS = ("traceback", "hang", "data loss", "silent", "wrong")   # the classes, and
# "wrong": a plain wrong value, answered in one line


@dataclass(frozen=True)
class Special:
    kind: str          # "fifo", "link", "sparse", "gone"
    arg: object = None


FIFO, GONE = Special("fifo"), Special("gone")


def link(target: str) -> Special:
    return Special("link", target)


def sparse(size: int) -> Special:
    return Special("sparse", size)


@dataclass(frozen=True)
class Case:
    id: str
    args: tuple[str, ...]
    says: str
    files: dict = field(default_factory=dict)
    uses: tuple[str, ...] = ()
    where: str | None = None
    code: int = 2
    env: dict = field(default_factory=dict)
    stdin: bytes | None = None
    new_files: bool = False
    fault: str = "wrong"
    seconds: float = 10.0
    surface: str = ""


def surface(name: str, cases: list[Case]) -> list[Case]:
    assert all(c.fault in FAULTS for c in cases), [c.id for c in cases if c.fault not in FAULTS]
    return [replace(c, surface=name) for c in cases]


QUICK = ("--device", "numpy", "--set", "training.total_steps=2", "--set",
         "training.warmup_steps=1", "--set", "training.eval_every=0", "--set",
         "training.sample_tokens=0", "--set", "model.max_seq_len=16", "--set",
         "training.batch_size=2", "--set", "model.hidden_dim=32", "--set", "model.num_heads=1",
         "--set", "model.num_kv_heads=1", "--set", "model.num_layers=1")
ON_SHARD = ("--set", "data.dataset=data/text_train.bin", "--set", "data.val_dataset=null")
TRAIN = ("train", "--run-dir", "out", *QUICK)
PLAN_OPS = ("plan", "--ops", "ops")
OK_ACT = "inputs: [x]\noutputs:\n  y: x * sigmoid(x)\n"
SAMPLE = ("sample", "run", "--device", "numpy", "--max-new-tokens", "2")
LONG = "9" * 5000    # past Python's 4300-digit int limit
HUGE = "9" * 400     # an int, but no float


def bomb(levels: int = 8) -> str:
    """The billion laughs: 10**levels values from a few hundred bytes."""
    items = ["&a0 [x, x, x, x, x, x, x, x, x, x]"]
    items += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels)]
    return "[" + ", ".join(items) + "]"


def spec(body: str, name: str = "myact") -> dict:
    return {f"ops/{name}.yaml": f"name: {name}\nkind: pointwise\n{body}"}


def shard_bytes(magic: int, version: int, count: int, body: bytes) -> bytes:
    header = np.zeros(256, dtype="<i4")
    header[:3] = (magic, version, count)
    return header.tobytes() + body


def ids(n: int, value: int = 65) -> bytes:
    """An llm.c shard of `n` tokens, all `value`."""
    return shard_bytes(20240520, 1, n, np.full(n, value, dtype="<u2").tobytes())


def safetensors(header, body: bytes = b"", length: int | None = None) -> bytes:
    """A safetensors file of this header (any JSON), its length field `length` if given."""
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + body


def tensor(dtype: str = "F32", shape=(2,), offsets=(0, 8)) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def words(vocab: dict, eot: bool = False) -> str:
    """A WordLevel tokenizer.json over `vocab` (word -> id), with <|endoftext|> when `eot`."""
    if eot:
        vocab = {**vocab, "<|endoftext|>": len(vocab)}
    return json.dumps({"version": "1.0", "truncation": None, "padding": None,
                       "added_tokens": [], "normalizer": None,
                       "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None,
                       "decoder": None, "model": {"type": "WordLevel", "vocab": vocab,
                                                  "unk_token": next(iter(vocab))}})


WORDS = words({"[UNK]": 0, "a": 1, "b": 2})
GPT2_CONFIG = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 32,
               "n_layer": 1, "n_head": 1, "n_inner": 128, "n_positions": 16, "vocab_size": 256,
               "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
               "tie_word_embeddings": True}
LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 32,
                "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
                "intermediate_size": 64, "max_position_embeddings": 16, "vocab_size": 256,
                "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": True}


def config(base: dict, **changes) -> str:
    """A config.json: `base` with keys changed (a value of None removes the key)."""
    merged = {**base, **changes}
    return json.dumps({k: v for k, v in merged.items() if v is not None})
