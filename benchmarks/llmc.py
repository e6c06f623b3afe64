"""llm.c's `train_gpt2cu` (bf16) as a peer: built from source with nvcc, run on random
tokens, its step times parsed (benchmarks/train.py runs it beside GPT-2 124M).

    python benchmarks/llmc.py --batch 8,16          # build (once) and measure
    python benchmarks/llmc.py --dry-run             # the build command only (`make -n`)

The source is llm.c's checkout at .peers/llm.c in the repository root (not ours: never
committed; a device call carries it). It is copied to --work and built there with
`make train_gpt2cu NO_MULTI_GPU=1 NO_USE_MPI=1 USE_CUDNN=0 GPU_COMPUTE_CAPABILITY=<cc>`:
no NCCL, MPI or cuDNN (its attention is then its own kernels), one call patched for CUDA 13
(PATCHES). cuBLAS and NVML are linked
from where they are: the CUDA toolkit, else the nvidia-* Python wheels (headers and
libraries), else the libraries the dynamic loader knows; unversioned names the linker
needs are symlinked into --work/lib. A build is kept for its source (sizes and mtimes).

A run: `-e d12` (GPT-2 124M, random init), B x T, `-r 0` (no recompute: its fastest),
no sampling (`-s 0`), one validation batch at the start and end; the train shard is random
GPT-2 token ids written as an llm.c shard. llm.c prints each step's milliseconds (its
events around the step, the host's next batch inside); the first is `first_s`, then
`warmup` are dropped and the rest cut into `repeats` runs of `steps`, each run's median
kept, as benchmarks/measure.py times the others. Peak memory is llm.c's own "device memory
usage" line (the driver's bytes in use after its allocations, its CUDA context included).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

from eulergen import PACKAGE_DIR

SOURCE = PACKAGE_DIR / ".peers" / "llm.c"
MAKE_VARS = ("NO_MULTI_GPU=1", "NO_USE_MPI=1", "USE_CUDNN=0")
LIBS = ("cublas", "cublasLt", "nvidia-ml")
# CUDA 13's cudaMemAdvise takes a cudaMemLocation, not a device id, so llm.c's fallback to
# managed memory when cudaMalloc runs out does not compile; the copy built here drops that
# fallback (an out-of-memory run stops instead: managed memory past the free memory can
# hang the lent GPU). A run that fits never takes it: the timed code is llm.c's own.
PATCHES = {"llmc/cuda_utils.cuh": (
    ("if(err == cudaErrorMemoryAllocation) {", "if (false) {  // patched by eulergen"),
    ("cudaCheck_(cudaMemAdvise(*out, bytes, cudaMemAdviseSetPreferredLocation, "
     "cudaCpuDeviceId), file, line);", ""))}
STEP = re.compile(r"^step\s+(\d+)/(\d+) \| loss (\S+) .*\| ([\d.]+) ms \|", re.M)
DEVICE = re.compile(r"^\| device\s+\| (.+?)\s+\|", re.M)
MEMORY = re.compile(r"^device memory usage: (\d+) MiB / (\d+) MiB", re.M)


class LlmcError(Exception):
    """llm.c could not be built or run: one line saying why."""


def _source_key(src: Path) -> str:
    files = [src / "Makefile", src / "train_gpt2.cu", *sorted((src / "llmc").glob("*"))]
    key = hashlib.sha256()
    for f in files:
        st = f.stat()
        key.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return key.hexdigest()[:12]


def _compute_capability() -> str:
    """The GPU's, as the Makefile would ask nvidia-smi; 90 (Hopper) where there is none."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.split()
        return out[0].replace(".", "") if out else "90"
    except (OSError, subprocess.TimeoutExpired):
        return "90"


def _library_dirs() -> list[Path]:
    """Where headers and libraries may be: the CUDA toolkit (CUDA_HOME, CUDA_PATH, beside
    nvcc, /usr/local/cuda), then the nvidia-* wheels of this Python."""
    nvcc = shutil.which("nvcc")
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
             nvcc and Path(os.path.realpath(nvcc)).parent.parent, "/usr/local/cuda"]
    roots = [Path(r).resolve() for r in roots if r and Path(r).is_dir()]
    dirs = [d for r in dict.fromkeys(roots) for d in (r, r / "targets" / "x86_64-linux")]
    try:
        import nvidia
        dirs += [p for base in nvidia.__path__ for p in sorted(Path(base).iterdir()) if p.is_dir()]
    except ImportError:
        pass
    return dirs


def _find(name: str, dirs: list[Path]) -> Path | None:
    for d in dirs:
        for sub in ("lib64", "lib", "lib64/stubs", "lib/stubs"):
            found = sorted((d / sub).glob(f"lib{name}.so*")) if (d / sub).is_dir() else []
            if found:
                return found[0]
    ldconfig = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    match = re.search(rf"lib{re.escape(name)}\.so[.\d]* .*=> (\S+)", ldconfig)
    return Path(match[1]) if match else None


def _include(dirs: list[Path], header: str) -> Path | None:
    return next((d / "include" for d in dirs if (d / "include" / header).is_file()), None)


def _link(link: Path, target: Path) -> None:
    link.unlink(missing_ok=True)
    link.symlink_to(target)


def make_command(src: Path, work: Path) -> list[str]:
    """The make command line, with the include and link flags cuBLAS and NVML need here:
    their headers (alone: a wheel's include folder holds another CUDA's runtime headers
    too) and unversioned library names symlinked into work/include and work/lib."""
    dirs = _library_dirs()
    cublas, nvml = _include(dirs, "cublas_v2.h"), _include(dirs, "nvml.h")
    if cublas is None:
        raise LlmcError(f"cublas_v2.h is in none of {', '.join(map(str, dirs)) or 'no CUDA found'}")
    include, lib = work / "include", work / "lib"
    include.mkdir(parents=True, exist_ok=True)
    lib.mkdir(parents=True, exist_ok=True)
    for header in [*cublas.glob("cublas*.h"), *([nvml / "nvml.h"] if nvml else [])]:
        _link(include / header.name, header)   # without nvml.h llm.c leaves NVML out
    rpaths = []
    for name in LIBS:
        found = _find(name, dirs)
        if found is None:
            raise LlmcError(f"lib{name}.so is nowhere here (CUDA toolkit, nvidia wheels, ldconfig)")
        _link(lib / f"lib{name}.so", found)
        if "stubs" not in found.parts:   # a stub links; the driver's library runs
            rpaths.append(str(found.parent))
    ldflags = " ".join([f"-L{lib}", *(f"-Xlinker -rpath={p}" for p in dict.fromkeys(rpaths)),
                        *(f"-l{name}" for name in LIBS)])
    return ["make", "-C", str(src), "train_gpt2cu", *MAKE_VARS,
            f"GPU_COMPUTE_CAPABILITY={_compute_capability()}", f"NVCC_INCLUDES=-I{include}",
            f"NVCC_LDFLAGS={ldflags}"]


def build(work: Path, src: Path = SOURCE, dry_run: bool = False) -> Path:
    """The train_gpt2cu binary of `src`, built under `work` (kept for its source); with
    `dry_run`, make -n only (prints the commands, builds nothing)."""
    if not (src / "train_gpt2.cu").is_file():
        raise LlmcError(f"no llm.c source at {src} (a checkout of karpathy/llm.c belongs there)")
    tree = work / f"llm.c-{_source_key(src)}"
    binary = tree / "train_gpt2cu"
    if binary.is_file() and not dry_run:
        return binary
    if not tree.is_dir():
        shutil.copytree(src, tree, ignore=shutil.ignore_patterns(".git", "build", "train_gpt2cu"))
    for name, edits in PATCHES.items():   # idempotent: a copy patched before stays so
        text = (tree / name).read_text()
        for old, new in edits:
            text = text.replace(old, new)
        (tree / name).write_text(text)
    cmd = make_command(tree, work)
    if dry_run:
        cmd.insert(1, "-n")
    out = subprocess.run(cmd, capture_output=True, text=True)
    (work / "build.log").write_text(out.stdout + out.stderr)
    if dry_run:
        print(out.stdout + out.stderr)
    if out.returncode != 0:
        errors = [line for line in (out.stdout + out.stderr).splitlines()
                  if "error" in line.lower()] or (out.stdout + out.stderr).splitlines()[-1:]
        raise LlmcError(f"build failed ({work / 'build.log'}): {errors[0].strip()[:200]}")
    return binary


def random_shards(folder: Path, tokens: int, vocab: int = 50257) -> tuple[str, str]:
    """A train and a val shard of random GPT-2 ids (written once): their paths."""
    from eulergen.runtime.data.loader import write_shard
    train, val = folder / "random_train_000001.bin", folder / "random_val_000000.bin"
    if not train.is_file() or train.stat().st_size < 1024 + 2 * tokens:
        rng = np.random.default_rng(0)
        write_shard(val, rng.integers(0, vocab, tokens, dtype=np.uint16))
        write_shard(train, rng.integers(0, vocab, tokens, dtype=np.uint16))
    return str(train), str(val)


def parse(text: str) -> dict:
    """The step times (ms), last loss, device name and memory of a train_gpt2cu log."""
    steps = [(int(m[1]), float(m[4]), m[3]) for m in STEP.finditer(text)]
    device, memory = DEVICE.search(text), MEMORY.search(text)
    return dict(ms=[ms for _, ms, _ in steps], loss=float(steps[-1][2]) if steps else None,
                device_name=device[1] if device else None,
                peak=int(memory[1]) * 2**20 if memory else None)


def measure(binary: Path, shards: tuple[str, str], batch: int, seq: int, warmup: int,
            steps: int, repeats: int, timeout: float) -> dict:
    """One run of train_gpt2cu at B x T, timed as benchmarks/measure.py times the others."""
    total = 1 + warmup + steps * repeats
    cmd = [str(binary), "-i", shards[0], "-j", shards[1],
           "-e", "d12", "-b", str(batch), "-t", str(seq), "-x", str(total), "-r", "0",
           "-s", "0", "-v", "1000000", "-m", "1", "-l", "6e-4", "-c", "0.1", "-y", "0"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                             cwd=binary.parent)
    except subprocess.TimeoutExpired:
        raise LlmcError(f"timed out after {timeout:.0f} s") from None
    log = parse(out.stdout)
    if out.returncode != 0 or len(log["ms"]) < total:
        lines = (out.stdout + out.stderr).strip().splitlines()
        raise LlmcError(f"{lines[-1][:200] if lines else 'no output'} (exit {out.returncode}, "
                        f"{len(log['ms'])} of {total} steps)")
    ms = log.pop("ms")
    medians = [statistics.median(ms[1 + warmup + i * steps:1 + warmup + (i + 1) * steps]) / 1e3
               for i in range(repeats)]
    seconds = statistics.median(medians)
    return dict(log, first_s=ms[0] / 1e3, medians=medians, seconds=seconds,
                tokens_per_s=batch * seq / seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, default=SOURCE)
    ap.add_argument("--work", type=Path, default=Path("/tmp/eulergen-llmc"))
    ap.add_argument("--batch", default="8,16")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--dry-run", action="store_true", help="print the build commands (make -n)")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    try:
        binary = build(args.work, args.src, dry_run=args.dry_run)
        if args.dry_run:
            return
        batches = [int(b) for b in args.batch.split(",")]
        shards = random_shards(args.work, max(batches) * args.seq * 4)
        for b in batches:
            r = measure(binary, shards, b, args.seq, args.warmup, args.steps, args.repeats,
                        args.timeout)
            spread = ", ".join(f"{b * args.seq / s:,.0f}" for s in r["medians"])
            print(f"llm.c B={b} T={args.seq}: {r['tokens_per_s']:,.0f} tok/s ({spread}), "
                  f"{1e3 * r['seconds']:.1f} ms/step, {r['device_name']}", flush=True)
    except LlmcError as err:
        sys.exit(f"llm.c: {err}")


if __name__ == "__main__":
    main()
