"""Run configuration: frozen ModelConfig / TrainingConfig / DataConfig values read from
NanoEuler-style JSON or YAML, presets, and `--set section.key=value` overrides.

Resolution order for every key: the built-in default (the CPU's, or presets.GPU_DEFAULT on a GPU
when no file is given), then the preset named by `model.preset`, then the file, then the
overrides. Hyper-parameters never reach the kernels, so nothing here is hashed into a build.
"""
from __future__ import annotations

import dataclasses
import math
import re
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eulergen.errors import EulerError, suggest
from eulergen.runtime.data.tokenizer import tokenizer_file
from eulergen.runtime.model.recompute import MODES as RECOMPUTE
from eulergen.runtime.train.config_read import locate, read_file, show, typed
from eulergen.runtime.train.presets import DEFAULTS, PRESETS
from eulergen.signature import PRECISIONS
from eulergen.userfiles import load_yaml


# The dataclass defaults are the built-in default on the CPU (presets.GPU_DEFAULT, on a GPU),
# sized by measurement for `eulergen train` with no arguments: benchmarks/RESULTS.md, "The
# default run". Head dim 64: the CUDA attention kernels exist for 64 and 128 only.
@dataclass(frozen=True)
class ModelConfig:
    preset: str | None = None
    hidden_dim: int = 128
    num_layers: int = 3
    num_heads: int = 2               # head dim 64: a size the CUDA attention kernels take
    num_kv_heads: int = 2
    vocab_size: int = 256
    max_seq_len: int = 64
    mlp_hidden: int = 512
    norm: str = "layernorm"          # any row op name
    activation: str = "gelu"         # any pointwise op name; two inputs make the MLP gated
    attention: str = "causal_attention"
    positions: str = "learned"       # "learned" | "rope"
    rope_base: float = 10000.0
    bias: bool = True
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_dim // self.num_heads


@dataclass(frozen=True)
class TrainingConfig:
    batch_size: int = 16
    seq_len: int = 64                # not given: model.max_seq_len
    learning_rate: float = 3e-3
    min_lr: float = 3e-4             # not given: learning_rate / 10
    warmup_steps: int = 20
    total_steps: int = 650           # ends within 150 s where this model trains at 3.3k tok/s
    schedule: str = "cosine"         # "cosine" | "linear" | "constant"
    gradient_accumulation: int = 1
    optimizer: str = "adamw"         # any update op (ops/adamw.yaml, lion, sgd_momentum, muon)
    weight_decay: float = 0.1        # the op's weight_decay on the matrices; 0 on the rest
    beta1: float | None = None       # the op's beta1, beta2 and eps where it has them;
    beta2: float | None = None       # None: its own (adamw.yaml: 0.9, 0.95, 1e-8)
    adam_eps: float | None = None
    grad_clip: float = 1.0           # 0 turns clipping off
    spike_factor: float = 4.0        # skip an update when loss or grad norm > factor x running mean; 0 = off
    eval_every: int = 100            # 0 = never
    eval_steps: int = 16
    checkpoint_every: int = 100      # 0 = only at the end
    keep_checkpoints: int = 3
    log_every: int = 10
    seed: int = 1337
    dtype: str = "auto"              # "auto" (bf16 on a GPU with bf16 tensor cores, else fp32)
                                     # | "fp32" | "bf16" (mixed precision: runtime/model/gpt.py)
    precision: str = "autocast"      # what a bf16 run stores in bf16 (runtime/model/plan.py's
                                     # Precision): "autocast" (as torch.autocast: the residual
                                     # stream, the gradients and the norms' weights float32;
                                     # the default: it reaches autocast's loss, bf16 does not,
                                     # benchmarks/RESULTS.md) | "bf16" (as llm.c: those too)
    recompute: str = "none"          # "none" | "blocks": keep a block's input only, run its
                                     # forward again in the backward (runtime/model/recompute.py)
    tf32: bool = True
    cuda_graph: bool = True          # GPU: capture the step as CUDA graphs; false: launch eagerly
    device: str = "auto"             # "auto" | "cuda" | "numpy"
    sample_tokens: int = 200
    zero: int = 0                    # 1: ZeRO-1, a data-parallel rank updates its share
    bucket_mb: float = 25.0          # data parallel: MiB of gradients a collective reduces


@dataclass(frozen=True)
class DataConfig:
    dataset: str = "builtin:stdlib"  # a glob of llm.c shards, a nanoGPT train.bin, or builtin:stdlib
    val_dataset: str | None = None   # not given: derived from dataset (train -> val)
    tokenizer: str = "byte"          # "byte" | "gpt2" (tiktoken) | a path to a tokenizer.json
    tokenizer_path: str | None = None  # NanoEuler's key: a tokenizer.json (same as tokenizer=path)


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig
    training: TrainingConfig
    data: DataConfig
    run_dir: str
    # the device's built-in default ("cpu" or "gpu") that load_config chose for the keys
    # nobody gave (no file, finds_gpu given); None otherwise: the CPU's filled them, if any.
    # Not saved, not compared: a run's config.json gives every key.
    default: str | None = field(default=None, compare=False)


SECTIONS: dict[str, type] = {"model": ModelConfig, "training": TrainingConfig, "data": DataConfig}
TOP_LEVEL_KEYS = ("run_dir",)

CHOICES: dict[str, tuple[str, ...]] = {
    "model.positions": ("learned", "rope"),
    "training.schedule": ("cosine", "linear", "constant"),
    "training.dtype": ("auto", "fp32", "bf16"),
    "training.precision": ("bf16", *PRECISIONS),   # bf16: no kernel of another precision
    "training.recompute": RECOMPUTE,
    "training.device": ("auto", "cuda", "numpy"),
}

TOKENIZER_KINDS = ("byte", "gpt2")   # else a path: runtime/data/tokenizer.py reads all three
_OP_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = (), *,
                fresh_run_dir: bool = False,
                finds_gpu: typing.Callable[[], bool] | None = None) -> RunConfig:
    """Read `path` (JSON or YAML; None: the built-in default), apply `section.key=value`
    overrides (values parsed as YAML scalars), resolve presets and derived defaults, validate.
    `fresh_run_dir`: when neither the file nor an override names run_dir, a new folder
    runs/<stem>-YYYYmmdd-HHMMSS (a second run never meets the first one's checkpoints).
    `finds_gpu`: whether training.device auto finds a GPU here. Given, a run without a file
    takes the built-in default of its device (GPU_DEFAULT on cuda); not given, the CPU's
    whatever the device (for callers that name the sizes they test)."""
    raw: dict[str, Any] = {}
    where: dict[str, tuple[str, int | None]] = {}
    source = "<default>"
    if path is not None:
        source = str(path)
        path = locate(Path(path))
        raw, lines = read_file(path)
        where = {key: (source, line) for key, line in lines.items()}
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    for item in overrides:
        _apply_override(raw, item, where)
    default_run_dir = f"runs/{Path(path).stem if path is not None else 'default'}"
    if fresh_run_dir:
        default_run_dir = fresh_dir(default_run_dir)
    default = None
    if path is None and finds_gpu is not None:
        default = "gpu" if _on_gpu(raw, finds_gpu) else "cpu"
    return config_from_dict(raw, source=source, where=where, default_run_dir=default_run_dir,
                            default=default)


def _on_gpu(raw: dict[str, Any], finds_gpu: typing.Callable[[], bool]) -> bool:
    """Whether the run's training.device resolves to cuda (a value that is no device is
    left to validation, which names it)."""
    device = (raw.get("training") or {}).get("device", "auto")
    return device == "cuda" or (device == "auto" and finds_gpu())


def fresh_dir(base: str) -> str:
    """A folder name that does not exist yet: `base`-YYYYmmdd-HHMMSS (a run's, a sweep's)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name, n = f"{base}-{stamp}", 1
    while Path(name).exists():     # two runs started within one second
        n += 1
        name = f"{base}-{stamp}-{n}"
    return name


def config_from_dict(raw: dict[str, Any], *, source: str = "<dict>",
                     where: dict[str, tuple[str, int | None]] | None = None,
                     default_run_dir: str = "runs/default", default: str | None = None
                     ) -> RunConfig:
    """Build and validate a RunConfig from `{section: {key: value}, "run_dir": …}`, the keys
    not given from the built-in default named by `default` (DEFAULTS; None: the CPU's).
    `as_dict(cfg)` gives back such a mapping, so a run's saved config loads exactly."""
    where = where or {}

    def fail(key: str, message: str) -> typing.NoReturn:
        file, line = where.get(key, (source, None))
        raise EulerError(message, file=file, line=line, key=key)

    if not isinstance(raw, dict):
        raise EulerError("expected a mapping of sections (model, training, data)", file=source)
    for name, value in raw.items():
        if name in SECTIONS:
            if not isinstance(value, dict):
                fail(name, f"expected a mapping, got {show(value)}")
        elif name not in TOP_LEVEL_KEYS:
            fail(str(name), "unknown section" + suggest(str(name), [*SECTIONS, *TOP_LEVEL_KEYS]))
    given = {name: dict(raw.get(name) or {}) for name in SECTIONS}
    values = {name: typed(cls, given[name], name, fail) for name, cls in SECTIONS.items()}

    base = DEFAULTS[default or "cpu"]
    model = _resolve_model(values["model"], base.get("model", {}), fail)
    training = _resolve_training(values["training"], base.get("training", {}), model)
    data = _resolve_data(values["data"], fail)
    run_dir = raw.get("run_dir", default_run_dir)
    if not isinstance(run_dir, str) or not run_dir:
        fail("run_dir", f"expected a directory path, got {show(run_dir)}")
    cfg = RunConfig(model=ModelConfig(**model), training=TrainingConfig(**training),
                    data=DataConfig(**data), run_dir=run_dir, default=default)
    _validate(cfg, fail)
    return cfg


def as_dict(cfg: RunConfig) -> dict[str, Any]:
    """The JSON-ready mapping of a resolved config (every key explicit)."""
    return {"model": dataclasses.asdict(cfg.model), "training": dataclasses.asdict(cfg.training),
            "data": dataclasses.asdict(cfg.data), "run_dir": cfg.run_dir}


def _apply_override(raw: dict[str, Any], item: str, where: dict[str, tuple[str, int | None]]) -> None:
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise EulerError(f"expected section.key=value, got {item!r}", file="--set")
    try:
        value = load_yaml(text, "--set") if text.strip() else None
    except EulerError:
        value = text
    if isinstance(value, (dict, list)):
        raise EulerError(f"expected a scalar value, got {text!r}", file="--set", key=key)
    where[key] = ("--set", None)
    if key in TOP_LEVEL_KEYS:
        raw[key] = value
        return
    section, dot, name = key.partition(".")
    if not dot or not name:
        raise EulerError("expected section.key" + suggest(key, [*SECTIONS, *TOP_LEVEL_KEYS]),
                         file="--set", key=key)
    if section not in SECTIONS:
        raise EulerError("unknown section" + suggest(section, [*SECTIONS, *TOP_LEVEL_KEYS]),
                         file="--set", key=key)
    current = raw.get(section)
    raw[section] = dict(current) if isinstance(current, dict) else {}
    raw[section][name] = value


# -- derived defaults and validation -------------------------------------------------------

def _resolve_model(given: dict[str, Any], default: dict[str, Any], fail) -> dict[str, Any]:
    base = {**dataclasses.asdict(ModelConfig()), **default}
    preset = given.get("preset")
    if preset is not None:
        if preset not in PRESETS:
            fail("model.preset", f"unknown preset {preset!r}" + suggest(preset, list(PRESETS), "preset"))
        base.update(PRESETS[preset])
    model = {**base, **given}
    if "mlp_hidden" not in given:
        ratio = base["mlp_hidden"] / base["hidden_dim"]
        model["mlp_hidden"] = 8 * math.ceil(model["hidden_dim"] * ratio / 8)
    if "num_kv_heads" not in given:
        group = base["num_heads"] // base["num_kv_heads"]
        model["num_kv_heads"] = max(1, model["num_heads"] // group)
    return model


def _resolve_training(given: dict[str, Any], default: dict[str, Any],
                      model: dict[str, Any]) -> dict[str, Any]:
    training = {**dataclasses.asdict(TrainingConfig()), **default, **given}
    if "seq_len" not in given:
        training["seq_len"] = model["max_seq_len"]
    if "min_lr" not in given:
        training["min_lr"] = training["learning_rate"] / 10
    return training


def _resolve_data(given: dict[str, Any], fail) -> dict[str, Any]:
    data = {**dataclasses.asdict(DataConfig()), **given}
    path = data["tokenizer_path"]
    if path is not None:
        if "tokenizer" in given and given["tokenizer"] != path:
            fail("data.tokenizer", f"{given['tokenizer']!r} and data.tokenizer_path {path!r} "
                 "name different tokenizers: give one of them")
        data["tokenizer"] = path
    if data["tokenizer"] not in TOKENIZER_KINDS and Path(data["tokenizer"]).is_dir():
        data["tokenizer"] = str(tokenizer_file(data["tokenizer"]))   # an HF folder
    if "val_dataset" not in given:
        data["val_dataset"] = derive_val_dataset(data["dataset"])
    return data


def derive_val_dataset(dataset: str) -> str | None:
    """The validation set beside a training set: the built-in splits itself; otherwise
    the last 'train' in the path becomes 'val' (llm.c's *_train_*.bin, nanoGPT's train.bin)."""
    if dataset.startswith("builtin:"):
        return dataset
    head, sep, tail = dataset.rpartition("train")
    return f"{head}val{tail}" if sep else None


# -- validation -----------------------------------------------------------------------------

def _validate(cfg: RunConfig, fail) -> None:
    m, t, d = cfg.model, cfg.training, cfg.data
    positive = {
        "model.hidden_dim": m.hidden_dim, "model.num_layers": m.num_layers,
        "model.num_heads": m.num_heads, "model.num_kv_heads": m.num_kv_heads,
        "model.vocab_size": m.vocab_size, "model.max_seq_len": m.max_seq_len,
        "model.mlp_hidden": m.mlp_hidden, "model.rope_base": m.rope_base, "model.norm_eps": m.norm_eps,
        "training.batch_size": t.batch_size, "training.seq_len": t.seq_len,
        "training.learning_rate": t.learning_rate, "training.total_steps": t.total_steps,
        "training.gradient_accumulation": t.gradient_accumulation,
        "training.eval_steps": t.eval_steps, "training.keep_checkpoints": t.keep_checkpoints,
        "training.log_every": t.log_every, "training.bucket_mb": t.bucket_mb,
    }
    if t.adam_eps is not None:
        positive["training.adam_eps"] = t.adam_eps
    for key, value in positive.items():
        if value <= 0:
            fail(key, f"must be positive, got {value}")
    non_negative = {
        "training.min_lr": t.min_lr, "training.warmup_steps": t.warmup_steps,
        "training.weight_decay": t.weight_decay, "training.grad_clip": t.grad_clip,
        "training.spike_factor": t.spike_factor, "training.eval_every": t.eval_every,
        "training.checkpoint_every": t.checkpoint_every, "training.sample_tokens": t.sample_tokens,
        "training.seed": t.seed,   # numpy's generators take no negative seed
    }
    for key, value in non_negative.items():
        if value < 0:
            fail(key, f"must not be negative, got {value}")
    for key, choices in CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value not in choices:
            fail(key, f"{value!r} is not one of {', '.join(choices)}" + suggest(value, list(choices)))
    for key, name in [(f"model.{k}", getattr(m, k)) for k in ("norm", "activation", "attention")] \
            + [("training.optimizer", t.optimizer)]:
        if not _OP_NAME.match(name):
            fail(key, f"{name!r} is not an op name")
    if m.hidden_dim % m.num_heads:
        fail("model.num_heads", f"{m.num_heads} heads do not divide hidden_dim {m.hidden_dim}")
    if m.num_heads % m.num_kv_heads:
        fail("model.num_kv_heads", f"{m.num_kv_heads} KV heads do not divide num_heads {m.num_heads}")
    if m.positions == "rope" and m.head_dim % 2:
        fail("model.positions", f"rope needs an even head dim, got {m.head_dim} "
             f"(hidden_dim {m.hidden_dim} / num_heads {m.num_heads})")
    if t.zero not in (0, 1):
        fail("training.zero", f"{t.zero} is not 0 or 1 (1: ZeRO stage 1, the one there is)")
    if t.seq_len > m.max_seq_len:
        fail("training.seq_len", f"{t.seq_len} is longer than model.max_seq_len {m.max_seq_len}")
    if t.min_lr > t.learning_rate:
        fail("training.min_lr", f"{t.min_lr} is above learning_rate {t.learning_rate}")
    if t.warmup_steps > t.total_steps:
        fail("training.warmup_steps", f"{t.warmup_steps} is more than total_steps {t.total_steps}")
    for key, beta in (("training.beta1", t.beta1), ("training.beta2", t.beta2)):
        if beta is not None and not 0 <= beta < 1:
            fail(key, f"must be in [0, 1), got {beta}")
    if not d.dataset:
        fail("data.dataset", "must name a dataset (a glob, a .bin file or builtin:stdlib)")
    if d.tokenizer not in TOKENIZER_KINDS and not d.tokenizer.endswith(".json"):
        fail("data.tokenizer", f"{d.tokenizer!r} is not {', '.join(TOKENIZER_KINDS)} or a path to a "
             "tokenizer .json" + suggest(d.tokenizer, list(TOKENIZER_KINDS)))
