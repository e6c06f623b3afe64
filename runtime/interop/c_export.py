"""`eulergen export-c`: a trained model as a folder that `make cpu` (cc, libm, optional
OpenMP) or `make cuda` (nvcc) builds into a program that generates text with no
Python: the weights (c_weights.py), the tokenizer (c_tokenizer.py), the model as C from its
graph (c_model.py), the generated C of exactly its ops (generated/c/) or their generated
CUDA (generated/cuda/) launched by kernels.cu (c_cuda.py), the hand-written rest of the
program (templates/c/: loading, the tokenizer, the draw, the backends, main), a Makefile
and a README. The folder holds nothing it reads from outside itself.

    no_cuda = export_c(arch, params, tokenizer, Path("gpt-c"), context=1024)

With a checkpoint's training state (`run`, c_train.Run) the folder also holds a training
program that continues the run (c_train.py; `make cpu` builds it, train_cpu).

Refused before anything is written: an op the model runs whose kind has no C printer (or,
training, no C of training), a run the training program does not cover, a tokenizer the
C tokenizer cannot be, an op whose file would be one of the program's, and an --out
holding files export-c did not write, a build among them (eulergen/outputs.py: the folder
is replaced whole, or not at all; `make clean` leaves an export as it was written).
"""
from __future__ import annotations

from pathlib import Path
from string import Template

from eulergen import TEMPLATES_DIR, outputs
from eulergen.errors import EulerError
from eulergen.runtime.engine.compile import BASE_OPTIONS, op_options
from eulergen.runtime.interop import c_cuda, c_model, c_tokenizer, c_train, c_weights

PROGRAM_DIR = TEMPLATES_DIR / "c"
# the hand-written program, as templates/c/ holds it
PROGRAM = ("main.c", "error.h", "error.c", "files.h", "files.c", "weights.h", "weights.c",
           "tokenizer.h", "tokenizer.c", "sample.h", "sample.c", "backend.h", "cpu.c", "cuda.cu")
HOST = ("main.c", "model.c", "weights.c", "tokenizer.c", "sample.c", "files.c", "error.c")
# the training program's, hand-written (templates/c/), and what train_cpu is built from
TRAIN_PROGRAM = ("train.c", "data.h", "data.c", "checkpoint.h", "checkpoint.c", "train_cpu.h",
                 "train_cpu.c")
TRAIN = ("train.c", "training.c", "forward.c", "backward.c", "data.c", "checkpoint.c",
         "train_cpu.c", "files.c", "weights.c", "error.c")


def check_c(a) -> None:
    """EulerError naming the first op the model's forward runs whose kind has no C printer."""
    for slot, key in c_model.SLOTS.items():
        op = getattr(a.ops, slot)
        if op is not None and op.c is None:
            raise EulerError(f"op {op.name!r} ({op.kind} kind) has no C printer: export-c writes "
                             "only ops whose kind prints C", file=str(op.manifest), key=key)


def export_c(a, params: dict, tokenizer, out: Path, *, context: int,
             run: c_train.Run | None = None) -> str:
    """Write the folder of an Arch (runtime/model/arch.py arch_of), its float32 `params` (a
    state dict) and its run's tokenizer into `out`, sampling in a context of `context`
    tokens (the run's training.seq_len, as `eulergen sample` does); with `run` (the
    checkpoint's, runtime/train/continued.py), the training program too. Returns why there
    is no CUDA build ('' where there is one)."""
    check_c(a)
    sources, calls = c_model.sources(a, context)
    used = list(dict.fromkeys(c.op for c in calls))
    files = {name: text.encode() for name, text in sources.items()}
    files |= {name: (PROGRAM_DIR / name).read_bytes() for name in PROGRAM}
    _add_ops(files, {f"{op.name}.c": op.c for op in used})
    trained = []
    if run is not None:
        train_files, train_calls = c_train.sources(run)
        files |= train_files | {n: (PROGRAM_DIR / n).read_bytes() for n in TRAIN_PROGRAM}
        trained = list(dict.fromkeys(c.op for c in train_calls))
        _add_ops(files, {f"{op.name}{'.train' if key == 'c_train' else ''}.c": path
                         for op in trained for key in ("c", "c_train")
                         if (path := getattr(op, key)) is not None})
    try:
        files["kernels.cu"] = c_cuda.kernels_source(calls, context).encode()
        files |= {f"{op.name}.cu": op.cuda.read_bytes() for op in used}
        common = used[0].cuda.parent / "eulergen_common.cuh"
        files[common.name] = common.read_bytes()
        no_cuda = ""
    except EulerError as err:
        no_cuda = err.message
    files["tokenizer.bin"] = c_tokenizer.tokenizer_bytes(tokenizer)
    files["weights.bin"] = c_weights.weights_bytes(a, params)
    files["Makefile"] = _makefile(used, no_cuda, trained).encode()
    files["README.md"] = (_readme(a, context, used, no_cuda)
                          + (_train_readme(run, trained) if run is not None else "")).encode()
    outputs.replace_folder(out, files, by="export-c", key="--out")
    return no_cuda


def _add_ops(files: dict, ops: dict) -> None:
    """Each op's file (name -> its path) into `files`, refused where the program already
    has a file of its name (an op named `train` or `model`)."""
    for name, path in ops.items():
        data = path.read_bytes()
        if name in files and files[name] != data:
            raise EulerError(f"op {name.split('.')[0]!r} shares its file {name} with the "
                             "program's: rename the op", key="--out")
        files[name] = data


def _makefile(used, no_cuda: str, trained=()) -> str:
    """`trained`: the ops the training program calls (none: no training program)."""
    host = " ".join(HOST)
    ops_c = " ".join(f"{op.name}.c" for op in used)
    objects = " ".join([*(f"build/{n}.o" for n in HOST), "build/cuda.cu.o", "build/kernels.cu.o",
                        *(f"build/{op.name}.cu.o" for op in used)])
    fast = [f"build/{op.name}.cu.o: NVFLAGS += {' '.join(op_options(op))}"
            for op in used if op_options(op)]
    cuda = ([f"run_cuda: {objects}", "\t$(NVCC) -arch=$(ARCH) $^ -o $@ -lm", "",
             "build/%.cu.o: %.cu eulergen_common.cuh ops.h backend.h error.h | build",
             f"\t$(NVCC) {' '.join(BASE_OPTIONS)} -arch=$(ARCH) -O3 -include cstdio $(NVFLAGS) "
             "-c $< -o $@", *fast, "",
             "build/%.c.o: %.c $(HEADERS) | build",
             "\t$(CC) -std=c11 $(CFLAGS) -c $< -o $@", "", "build:", "\tmkdir -p build"]
            if not no_cuda else
            ["run_cuda:", f"\t@echo 'no CUDA build: {no_cuda.replace(chr(39), '')}' >&2; exit 1"])
    train = " ".join([*TRAIN, *(f"{op.name}.c" for op in trained if op.c),
                      *(f"{op.name}.train.c" for op in trained if op.c_train)])
    training = (["#   make cpu            also ./train_cpu, which continues the run's training",
                 "#   make train_cuda     refused: the training program has no CUDA build"]
                if trained else [])
    rules = ([f"train_cpu: {train} $(HEADERS)",
              f"\t$(CC) -std=c11 $(CFLAGS) -fopenmp-simd $(if $(OPENMP),-fopenmp) {train} "
              "-o $@ -lm", "", "train_cuda:",
              "\t@echo 'no CUDA training build: train_cpu (make cpu) is the training "
              "program' >&2; exit 1", ""] if trained else [])
    return "\n".join([
        "# Makefile: written by `eulergen export-c`.",
        "#   make cpu            the CPU build, ./run_cpu (one thread)",
        "#   make cpu OPENMP=1   the same over OpenMP's threads",
        "#   make cuda           the GPU build, ./run_cuda (nvcc; ARCH=sm_90 by default)",
        *training, "#   make clean",
        "CC ?= cc", "CFLAGS ?= -O3 -march=native", "NVCC ?= nvcc", "ARCH ?= sm_90",
        "HEADERS := $(wildcard *.h)", "",
        ".PHONY: cpu cuda clean" + (" train_cuda" if trained else ""),
        "cpu: run_cpu" + (" train_cpu" if trained else ""), "cuda: run_cuda", "",
        f"run_cpu: {host} cpu.c {ops_c} $(HEADERS)",
        f"\t$(CC) -std=c11 $(CFLAGS) -fopenmp-simd $(if $(OPENMP),-fopenmp) {host} cpu.c "
        f"{ops_c} -o $@ -lm", "", *rules, *cuda, "", "clean:",
        "\trm -rf build run_cpu run_cuda" + (" train_cpu" if trained else ""), ""])


def _readme(a, context: int, used, no_cuda: str) -> str:
    shape = (f"{a.layers} layers of width {a.d}, {a.heads} heads ({a.kv_heads} for keys and "
             f"values) of {a.head_dim}, an MLP of {a.ffn}, {a.vocab} token ids, "
             f"{'RoPE' if a.rope else 'learned positions'}, sampled in a context of "
             f"{context} tokens")
    ops = "\n".join(f"- `{op.name}.c` ({op.kind}, from {op.spec})" for op in used)
    fields = ", ".join(name for name, _, _ in c_weights.header(a))
    return Template((PROGRAM_DIR / "README.md.in").read_text()).substitute(
        shape=shape, ops=ops, fields=fields, header_ints=c_weights.HEADER_INTS,
        table_bytes=c_weights.TABLE_BYTES, name_bytes=c_weights.NAME_BYTES,
        align=c_weights.ALIGN,
        cuda=f"There is no CUDA build of this model: {no_cuda}." if no_cuda else
        "`make cuda` builds `run_cuda` from the generated CUDA of the same ops (`<op>.cu`), "
        "launched by `kernels.cu`.")


def _train_readme(run: c_train.Run, trained) -> str:
    t = run.cfg.training
    ops = "\n".join(f"  - `{op.name}.train.c` ({op.kind}, from {op.spec})" for op in trained
                     if op.c_train)
    return Template((PROGRAM_DIR / "README.train.md.in").read_text()).substitute(
        step=run.step, total=t.total_steps, batch=t.batch_size, seq=t.seq_len,
        micro=t.gradient_accumulation, schedule=t.schedule, optimizer=t.optimizer, ops=ops,
        files="\n".join(f"    {f}" for f in run.files))
