"""The model's parameters, named and shaped as torch names them (nn.Linear: weight [out,
in]), so a state dict moves between eulergen, checkpoints and benchmarks/torch_gpt.py
unchanged; their place in the params arena; loading a state dict into them."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from eulergen.errors import EulerError
from eulergen.runtime.engine.bf16 import to_bf16
from eulergen.runtime.model.memory import Planner, upload

VOCAB_MULTIPLE = 64


def padded_vocab(vocab_size: int) -> int:
    """Rows of the token embedding and the tied LM head: the tokenizer's vocab rounded up
    to a multiple of 64 (50257 -> 50304, 256 stays), so the head's GEMM and the logits
    rows are aligned. Padded ids never occur in data (the loaders refuse ids past
    model.vocab_size) and the sampler never draws them."""
    return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    init: str   # 'normal' | 'residual' (normal scaled by 1/sqrt(2·layers)) | 'ones' | 'zeros'
    linear: bool = False   # a Linear's weight: what a matrix step (Muon) takes, unlike the
                           # embeddings (wte is the tied head too) and the 1-D parameters

    @property
    def decay(self) -> bool:
        """AdamW decays matrices only (GPT-2 / nanoGPT): not biases, not norm weights."""
        return len(self.shape) >= 2


def parameters(a) -> list[ParamSpec]:
    """Every parameter of an Arch (runtime/model/gpt.py) in model order."""
    ps = [ParamSpec("wte.weight", (a.vocab_rows, a.d), "normal")]
    if not a.rope:
        ps.append(ParamSpec("wpe.weight", (a.max_seq, a.d), "normal"))

    def norm(prefix):
        return [ParamSpec(f"{prefix}.{w}", (a.d,), "ones" if w == "weight" else "zeros")
                for w in a.norm_weights]

    def linear(prefix, out, inp, init="normal"):
        ps = [ParamSpec(f"{prefix}.weight", (out, inp), init, linear=True)]
        return ps + ([ParamSpec(f"{prefix}.bias", (out,), "zeros")] if a.bias else [])

    fc_rows = 2 * a.ffn if a.gated else a.ffn
    for layer in range(a.layers):
        h = f"h.{layer}"
        ps += norm(f"{h}.ln_1")
        ps += linear(f"{h}.attn.c_attn", a.q_dim + 2 * a.kv_dim, a.d)
        ps += linear(f"{h}.attn.c_proj", a.d, a.q_dim, "residual")
        ps += norm(f"{h}.ln_2")
        ps += linear(f"{h}.mlp.c_fc", fc_rows, a.d)
        ps += linear(f"{h}.mlp.c_proj", a.d, a.ffn, "residual")
    return ps + norm("ln_f")


def param_count(a) -> int:
    return sum(math.prod(p.shape) for p in parameters(a))


@dataclass(frozen=True)
class ParamLayout:
    """The params arena of an Arch, laid out once (its `param_layout`) and the same for
    every model of it (so a sampler can read the weights of the training model it sits
    beside): decayed matrices first, then the rest, so AdamW runs as two launches over two
    ranges. Offsets are in elements: the same in every dtype."""
    entries: tuple[tuple[ParamSpec, int], ...]   # (parameter, its offset), arena order
    total: int                                   # elements of the arena


def param_layout(a) -> ParamLayout:
    """An Arch's ParamLayout (Arch makes it; everyone else reads `a.param_layout`)."""
    specs = parameters(a)
    p = Planner()
    entries = tuple((s, p.add("params", s.name, s.shape).offset)
                    for s in [s for s in specs if s.decay] + [s for s in specs if not s.decay])
    return ParamLayout(entries, p.plan().arena("params").size)


def plan_params(p: Planner, a, dtype: str) -> None:
    """The params arena of a model's plan: the Arch's param_layout in `dtype`."""
    for spec, _ in a.param_layout.entries:
        p.add("params", spec.name, spec.shape, dtype)


def load_params(params: dict, state: dict) -> None:
    """Copy a state dict (name -> host array) into a model's parameter views. Every name
    and shape is checked before anything is written: a checkpoint of another architecture
    (or an unpadded vocab) is one error naming the tensor and both shapes, and the model
    keeps its weights."""
    missing = [name for name in params if name not in state]
    extra = sorted(set(state) - set(params))
    if missing or extra:
        what = f"missing {missing[0]!r}" if missing else f"unexpected {extra[0]!r}"
        raise EulerError(f"weights do not fit this model: {what}", key="model")
    for name, view in params.items():
        shape = tuple(np.shape(state[name]))
        if shape != tuple(view.shape):
            raise EulerError(f"{name} has shape {shape}, the model wants {tuple(view.shape)} "
                             "(a checkpoint of another architecture?)", key="model")
    for name, view in params.items():
        value = state[name]
        if view.dtype == np.uint16 and np.asarray(value).dtype != np.uint16:
            value = to_bf16(np.asarray(value, dtype=np.float32))   # bf16 weights: rounded once
        upload(view, value)
