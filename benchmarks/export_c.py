"""`eulergen export-c`'s targets (issue 36), measured in one run on one machine: the export's
time and `make cpu`'s; the CPU build's greedy tokens/s at batch 1, one thread and over
OpenMP (2 threads, and one a core), against `eulergen sample` on numpy (one BLAS thread,
as the command runs it); with --device cuda, the CUDA build's against `eulergen sample`
on CuPy in fp32 (its CUDA graphs, after a warm-up run that compiles its kernels).

    python benchmarks/export_c.py                       # the CPU default model
    python benchmarks/export_c.py --preset gpt2         # GPT-2 124M
    python benchmarks/export_c.py --preset gpt2 --device cuda

The weights are a fresh init (speed does not depend on them); the prompt is bytes.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # as cli/common.limit_blas_threads

PRESETS = {"default": [], "gpt2": ["model.preset=gpt2"]}


def _program(binary: Path, tokens: int, env=None) -> float:
    """New tokens a second of one greedy run (the program's own timing, load excluded)."""
    done = subprocess.run([str(binary), "--prompt", "def ", "--temperature", "0", "--ids",
                           "--max-new-tokens", str(tokens)], capture_output=True, text=True,
                          check=True, env=env)
    made, took = re.search(r"and (\d+) new in ([\d.]+) s", done.stderr).groups()
    return int(made) / float(took)


def _sampler(arch, lib, params, seq: int, tokens: int) -> float:
    from eulergen.runtime.generate.sample import Sampler
    sampler = Sampler(arch, lib, seq_len=seq, dtype="float32", notify=lambda m: None)
    sampler.decoder.load_state_dict(params)
    sampler.samples(list(b"def "), 8, temperature=0)        # compile, capture
    start = time.perf_counter()
    (row,) = sampler.samples(list(b"def "), tokens, temperature=0)
    return len(row) / (time.perf_counter() - start)


def _make(out: Path, *args) -> float:
    start = time.perf_counter()
    subprocess.run(["make", *args], cwd=out, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument("--device", choices=["numpy", "cuda"], default="numpy")
    parser.add_argument("--tokens", type=int, default=200)
    args = parser.parse_args()

    from eulergen.runtime.data.tokenizer import ByteTokenizer
    from eulergen.runtime.engine.backend import NUMPY, get_backend
    from eulergen.runtime.engine.ops import OpLibrary
    from eulergen.runtime.interop.c_export import export_c
    from eulergen.runtime.model.arch import arch_of
    from eulergen.runtime.model.gpt import build
    from eulergen.runtime.train.config import load_config

    cfg = load_config(None, PRESETS[args.preset])
    seq = cfg.training.seq_len
    lib = OpLibrary(NUMPY)
    arch = arch_of(cfg.model, lib)
    model = build(cfg.model, lib, 1, 1, training=False)
    model.init_weights(0)
    params = model.state_dict()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "c"
        start = time.perf_counter()
        export_c(arch, params, ByteTokenizer(), out, context=seq)
        rows.append(("export-c", f"{time.perf_counter() - start:.2f} s"))
        rows.append(("make cpu", f"{_make(out, 'cpu'):.2f} s"))
        numpy = _sampler(arch, lib, params, seq, args.tokens)
        rows.append(("eulergen sample, numpy", f"{numpy:.1f} tok/s"))
        cpu = _program(out / "run_cpu", args.tokens)
        rows.append(("run_cpu, one thread", f"{cpu:.1f} tok/s ({cpu / numpy:.2f}x numpy)"))
        _make(out, "clean")
        _make(out, "cpu", "OPENMP=1")
        for threads in sorted({2, os.cpu_count()}):
            omp = _program(out / "run_cpu", args.tokens,
                           env={**os.environ, "OMP_NUM_THREADS": str(threads)})
            rows.append((f"run_cpu, OpenMP, {threads} threads",
                         f"{omp:.1f} tok/s ({omp / numpy:.2f}x numpy)"))
        if args.device == "cuda":
            rows.append(("make -j cuda", f"{_make(out, f'-j{os.cpu_count()}', 'cuda'):.2f} s"))
            cuda_lib = OpLibrary(get_backend("cuda"))
            gpu = _sampler(arch_of(cfg.model, cuda_lib), cuda_lib, params, seq, args.tokens)
            rows.append(("eulergen sample, CuPy fp32", f"{gpu:.1f} tok/s"))
            cuda = _program(out / "run_cuda", args.tokens)
            rows.append(("run_cuda", f"{cuda:.1f} tok/s ({cuda / gpu:.2f}x eulergen sample)"))
    print(f"{args.preset}: {arch.layers} layers of {arch.d}, vocab {arch.vocab}, context {seq}, "
          f"{args.tokens} greedy tokens at batch 1")
    for name, value in rows:
        print(f"  {name:<32} {value}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
