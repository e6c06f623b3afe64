"""Every environment variable eulergen reads, each declared once here with its type and
range, and parsed here only: a bad value is one EulerError naming the variable, whichever
command meets it first (the CLI checks eulergen's own, EULERGEN_*, before any command
runs). A value is parsed once and the result kept, keyed by its text.

Besides its own, eulergen reads the launchers' rendezvous (torchrun's RANK, WORLD_SIZE,
LOCAL_RANK, SLURM's SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; MASTER_ADDR, MASTER_PORT)
and where a CUDA toolkit is (CUDA_PATH, CUDA_HOME). The variables it sets for the
libraries it loads (OPENBLAS_NUM_THREADS, TOKENIZERS_PARALLELISM, NCCL_NVLS_ENABLE) are
set where they are needed, never read.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from eulergen.errors import EulerError, suggest

MAX_SECONDS = 7 * 24 * 3600   # a week: past any wait a rank should make


@dataclass(frozen=True)
class Variable:
    name: str
    parse: Callable[[str], Any]   # the text -> the value; ValueError says what is wrong
    default: Any
    means: str


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError("not a number of seconds") from None
    if not (math.isfinite(value) and 0 < value <= MAX_SECONDS):
        raise ValueError(f"want seconds in (0, {MAX_SECONDS:,}]")
    return value


def _integer(lo: int, hi: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        text = text.strip()
        if not (text.isascii() and text.isdigit() and len(text) <= len(str(hi))) \
                or not lo <= int(text) <= hi:
            raise ValueError(f"want an integer in {lo}..{hi:,}")
        return int(text)
    return parse


def _choice(*options: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in options:
            raise ValueError(f"want one of {', '.join(options)}" + suggest(text, options))
        return text
    return parse


def _path(text: str) -> Path | None:
    return Path(text).expanduser() if text else None


def _paths(text: str) -> tuple[Path, ...]:
    return tuple(Path(p).expanduser() for p in text.split(os.pathsep) if p)


def _host(text: str) -> str:
    if not text or any(c.isspace() for c in text):
        raise ValueError("want a host name or address")
    return text


_RANK = _integer(0, 1 << 20)   # past any cluster's ranks: a typo, not a job
VARIABLES: dict[str, Variable] = {v.name: v for v in (
    Variable("EULERGEN_CACHE", _path, None,
             "the per-user cache: compiled kernels, user-op builds, built-in data "
             "(default ~/.cache/eulergen)"),
    Variable("EULERGEN_OPS_PATH", _paths, (), "folders of op specs, os.pathsep between them"),
    Variable("EULERGEN_COLLECTIVE_TIMEOUT", _seconds, 300.0,
             "seconds a data-parallel rank waits for another (a first step's kernel compiles "
             "fit in the default)"),
    Variable("EULERGEN_GEMM", _choice("auto", "lt", "cublas"), "auto",
             "the GPU's GEMM library: cuBLASLt where it works (auto), cuBLASLt or cuBLAS"),
    Variable("EULERGEN_GEMM_SEARCH", _choice("on", "off"), "on",
             "cuBLASLt's algorithm per GEMM shape: the fastest of its heuristic's first "
             "candidates, timed once a GPU and kept in the cache (on), or its first (off)"),
    Variable("EULERGEN_GEMV", _choice("on", "off"), "on",
             "the decoder's GEMMs of one or two rows: the gemv kernels (on) or the GEMM library"),
    Variable("EULERGEN_LAUNCHER_PID", _integer(1, 1 << 22), None,
             "set by `train --nproc` for its ranks: the launcher they die with"),
    Variable("RANK", _RANK, 0, "torchrun: this process's rank"),
    Variable("WORLD_SIZE", _RANK, None, "torchrun: the ranks in all"),
    Variable("LOCAL_RANK", _RANK, 0, "torchrun: the rank on this node (its GPU)"),
    Variable("SLURM_PROCID", _RANK, 0, "srun: this process's rank"),
    Variable("SLURM_NTASKS", _RANK, None, "srun: the ranks in all"),
    Variable("SLURM_LOCALID", _RANK, 0, "srun: the rank on this node"),
    Variable("MASTER_ADDR", _host, "127.0.0.1", "where rank 0 listens"),
    Variable("MASTER_PORT", _integer(1, 65535), None, "the TCP port rank 0 listens on"),
    Variable("CUDA_PATH", _path, None, "a CUDA toolkit (its include/ for NVRTC)"),
    Variable("CUDA_HOME", _path, None, "a CUDA toolkit, as CUDA_PATH"),
)}


def get(name: str, environ: Mapping[str, str] | None = None):
    """The value of variable `name` in `environ` (default: this process's), or its default
    when it is not set."""
    text = (os.environ if environ is None else environ).get(name)
    return VARIABLES[name].default if text is None else _parsed(name, text)


def is_set(name: str, environ: Mapping[str, str] | None = None) -> bool:
    return name in (os.environ if environ is None else environ)


@functools.lru_cache(maxsize=256)
def _parsed(name: str, text: str):
    try:
        return VARIABLES[name].parse(text)
    except ValueError as err:
        shown = repr(text) if len(text) <= 40 else f"{text[:20]!r}… ({len(text):,} characters)"
        raise EulerError(f"{shown}: {err}", key=name) from None


def check_own(environ: Mapping[str, str] | None = None) -> list[str]:
    """Parse every EULERGEN_* variable that is set (one error for a bad value); return a
    warning for each EULERGEN_* name that eulergen does not read (a typo is otherwise
    silently ignored)."""
    environ = os.environ if environ is None else environ
    own = [n for n in VARIABLES if n.startswith("EULERGEN_")]
    warnings = []
    for name in sorted(n for n in environ if n.startswith("EULERGEN_")):
        if name in VARIABLES:
            get(name, environ)
        else:
            # names share their prefix: only a near miss is a typo
            warnings.append(f"{name} is not a variable eulergen reads"
                            + suggest(name, own, "variable", cutoff=0.85))
    return warnings
