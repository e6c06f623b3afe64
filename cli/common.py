"""What the commands share: the --ops option, warnings, the console tables print on, the
built-in default's name, a run's op library, and numpy's BLAS threads."""
from __future__ import annotations

import sys
from pathlib import Path

import click

# Integer options' types: a count of absurd size or length is one line here, never a crash
# or a hang downstream. COUNT: 32-bit, as the kernels index; SEED: the draw's 64-bit hash
# (chat adds the turn); RANKS: past any machine's GPUs or cores, which --nproc is checked
# against next.
COUNT = click.IntRange(1, 2**31 - 1)
SEED = click.IntRange(0, 2**63 - 1)
RANKS = click.IntRange(1, 1 << 16)

ops_option = click.option(
    "--ops", "ops_dirs", multiple=True, type=click.Path(path_type=Path),
    help="Extra directory of op specs (repeatable); also EULERGEN_OPS_PATH.")


def warn(message: str, bar=None) -> None:
    """One warning line on stderr; above `bar` (progress.Bar) while one runs."""
    line = f"warning: {message}"
    if bar is not None:
        bar.print(line)
    else:
        click.echo(line, err=True)


def console():
    """rich's Console on stdout; piped or captured, 120 columns wide (never rich's 80, which
    cuts names short)."""
    from rich.console import Console
    out = Console()
    return out if out.is_terminal else Console(width=120)


def default_named(cfg) -> str:
    """', the built-in GPU default' (or CPU): which one a run without a file took."""
    return f", the built-in {cfg.default.upper()} default" if cfg.default else ""


def precision_label(t) -> str:
    """A run's training.dtype, with training.precision where that says more (bf16 runs)."""
    return f"{t.dtype} ({t.precision})" if t.dtype == "bf16" and t.precision != "bf16" else t.dtype


def library(cfg, ops_dirs, names=None):
    """The OpLibrary for a run: its ops (or `names`: a sweep's, of all its runs) regenerated
    first where stale, then the built-in manifest and the user ops' manifests loaded over
    the chosen backend. On a GPU the kernels the disk cache lacks (the model's ops' and the
    runtime's own) start compiling now, side by side, while the run starts
    (runtime/engine/compile.py prefetch): the first launches then find them compiled. An op
    that must be derived is, on a GPU, derived in a second process while this one starts
    CuPy and cuBLASLt (generator/build_ahead.py)."""
    from eulergen.generator import build_ahead
    from eulergen.generator.build import ensure_built
    from eulergen.runtime.engine import gemm
    from eulergen.runtime.engine.backend import get_backend
    from eulergen.runtime.engine.ops import OpLibrary
    from eulergen.runtime.model.arch import ops_used

    names = names or ops_used(cfg.model, cfg.training.optimizer)
    ahead = build_ahead.start(names, ops_dirs) if _may_find_gpu(cfg) else None
    backend = get_backend(cfg.training.device)
    if ahead is not None:
        gemm.warm(backend)
        build_ahead.finish(ahead)
    manifests = ensure_built(names, ops_dirs) or []
    lib = OpLibrary(backend, manifests)
    if lib.backend.is_gpu:
        from eulergen.runtime.engine.compile import prefetch
        from eulergen.runtime.engine.kinds.support import NAMES
        # a name that is no op is left to arch_of, which names the config key at fault
        ops = [lib.ops[n] for n in (*names, "embedding", *NAMES) if n in lib.ops]
        rests = [op.rest for op in ops if op.rest is not None]
        prefetch(ops + [lib.ops[n] for n in rests if n in lib.ops])
    return lib


def _may_find_gpu(cfg) -> bool:
    """Whether the run's backend may be CuPy's, asked without importing it."""
    from importlib.util import find_spec
    return cfg.training.device == "cuda" or (cfg.training.device == "auto"
                                             and find_spec("cupy") is not None)


def limit_blas_threads() -> None:
    """One BLAS thread on numpy: on a 2-core machine a second OpenBLAS thread makes the
    model's small GEMMs 10-50x slower whenever the other core is busy. Must run before
    numpy loads OpenBLAS; a user's own setting wins."""
    import os
    if "numpy" not in sys.modules:
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

