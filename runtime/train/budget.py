"""What a run may ask for, checked before anything is planned in full or allocated.

Two kinds of bound. Fixed ones, whatever the machine: the sizes the kernels index in 32
bits, the layers the planner lays out one by one, the tokens one optimizer step may
accumulate. And the machine's: a run's memory plan must fit the memory it would be
allocated from (the GPU's free memory on CUDA, the host's available memory on numpy).
The plan's bytes are counted from the plans of one and of two layers (every layer's
buffers are alike), so pricing a million-layer model takes two small plans, not a
million-layer one; docs/spec.md and the README state the limits.
"""
from __future__ import annotations

import dataclasses

from eulergen.errors import EulerError
from eulergen.runtime.model.memory import format_bytes

MAX_LAYERS = 1024              # GPT-3 has 96 and Llama 3 405B 126
MAX_INDEX = 2**31 - 1          # rows, columns and token ids are 32-bit ints in the kernels
MAX_TOKENS_PER_STEP = 2**25    # B·T·accumulation: 8x the largest batches published (4M)

# the keys a model's size grows with, and their built-in defaults (for naming the culprit)
_SIZE_KEYS = ("model.num_layers", "model.hidden_dim", "model.mlp_hidden", "model.vocab_size",
              "model.max_seq_len")


def check_config(cfg) -> None:
    """The fixed bounds on a RunConfig's sizes."""
    m, t = cfg.model, cfg.training
    if m.num_layers > MAX_LAYERS:
        raise EulerError(f"{m.num_layers:,} layers: at most {MAX_LAYERS:,}",
                         key="model.num_layers")
    from eulergen.runtime.model.params import padded_vocab
    for key, value in (("model.hidden_dim", m.hidden_dim), ("model.mlp_hidden", m.mlp_hidden),
                       ("model.vocab_size", padded_vocab(m.vocab_size)),
                       ("model.max_seq_len", m.max_seq_len)):
        if value > MAX_INDEX:
            raise EulerError(f"{value:,} is past {MAX_INDEX:,}: the kernels index it in 32 bits",
                             key=key)
    from eulergen.runtime.generate.sample import MAX_NEW_TOKENS
    if t.sample_tokens > MAX_NEW_TOKENS:   # drawn after the last step, as `sample` draws them
        raise EulerError(f"{t.sample_tokens:,} tokens: at most {MAX_NEW_TOKENS:,}",
                         key="training.sample_tokens")
    tokens = t.batch_size * t.seq_len * t.gradient_accumulation
    if tokens > MAX_TOKENS_PER_STEP:
        raise EulerError(f"an optimizer step of {tokens:,} tokens (batch_size {t.batch_size} x "
                         f"seq_len {t.seq_len} x gradient_accumulation "
                         f"{t.gradient_accumulation}): at most {MAX_TOKENS_PER_STEP:,}",
                         key="training.gradient_accumulation" if t.gradient_accumulation > 1
                         else "training.batch_size")


def plan_bytes(arch, plan_of) -> int:
    """The bytes of `plan_of(arch)` (a Plan), from the plans of one and two layers."""
    one = plan_of(dataclasses.replace(arch, layers=1)).total_bytes
    if arch.layers == 1:
        return one
    two = plan_of(dataclasses.replace(arch, layers=2)).total_bytes
    return one + (arch.layers - 1) * (two - one)


def check_fits(cfg, arch, backend, plan_of, *, what: str, batch: tuple[str, int, int]) -> None:
    """Refuse, before the plan is made, a model whose plan (`plan_of(arch)`) needs more
    memory than `backend` has free. `batch` is (key, value, default) of the batch size as
    the command names it (training.batch_size, --num-samples)."""
    need = plan_bytes(arch, plan_of)
    have, where = available(backend)
    if have is None or need <= have:
        return
    key = _culprit(cfg, batch)
    raise EulerError(f"the {what} plan needs {format_bytes(need)}; this machine has "
                     f"{format_bytes(have)} of {where} free (see `eulergen plan`)", key=key)


def check_batch(cfg, arch, backend, plan_of, *, what: str, batch: tuple[str, int, int],
                seq: int) -> None:
    """A command's batch of rows of `seq` tokens (`batch` as check_fits takes it): at most
    MAX_INDEX tokens, and a plan that fits, both before anything is planned in full."""
    key, rows, _ = batch
    if rows * seq > MAX_INDEX:
        raise EulerError(f"{rows:,} rows of {seq} tokens: at most {MAX_INDEX:,} tokens in one "
                         "batch", key=key)
    check_fits(cfg, arch, backend, plan_of, what=what, batch=batch)


def available(backend) -> tuple[int | None, str]:
    """Free bytes where `backend` allocates, and what that memory is called."""
    if backend.is_gpu:
        free, _ = backend.xp.cuda.runtime.memGetInfo()
        return free + backend.xp.get_default_memory_pool().free_bytes(), "GPU memory"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "memory"
    except OSError:
        pass
    try:
        import os
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "memory"
    except (ValueError, OSError, AttributeError):
        return None, "memory"


def _culprit(cfg, batch: tuple[str, int, int]) -> str:
    """The size key furthest above its built-in default: the one to lower."""
    from eulergen.runtime.train.config import load_config
    preset = cfg.model.preset
    default = load_config(None, [f"model.preset={preset}"] if preset else [])
    ratios = {key: _get(cfg, key) / _get(default, key) for key in _SIZE_KEYS}
    ratios["training.seq_len"] = cfg.training.seq_len / default.training.seq_len
    ratios[batch[0]] = batch[1] / batch[2]
    return max(ratios, key=ratios.get)


def _get(cfg, key: str) -> int:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)
