"""The training program of `eulergen export-c --train` (docs/internals.md, "export-c
--train"): what continues a run's checkpoint in C, as the numpy trainer would have, and
writes checkpoints eulergen reads.

The Run it is written from is the numpy trainer's own (runtime/train/continued.py): its
model for the run's batch, the checkpoint's weights and optimizer state in its arenas, its
optimizer's launches and state tensors. Written here: training.h (the run's sizes, its
schedule's and the step control's settings as its config resolved them, the Training
arenas), plan.h (every planned buffer's pointer), training.c (the arenas, weights.bin into
the params arena, the optimizer's launches, the tables a checkpoint is written from),
forward.c and backward.c (the tape, c_train_tape.py), train_ops.h and train_state.bin (the
step, the update count, the spike guard, the data position and the optimizer arena).
templates/c/ holds the hand-written rest: train.c (the loop), data.c (the token files and
numpy's batch order), checkpoint.c, train_cpu.c (the products and sums); files.c is the
sampling program's (c_export.PROGRAM), which both read files through.

Refused before anything is loaded, in one line: a run this program cannot continue as the
numpy trainer would (bf16, data parallel or ZeRO, recompute), and an op, of the model or
the optimizer, whose kind prints no C of training.
"""
from __future__ import annotations

import json
import re
import struct
import textwrap
from dataclasses import dataclass

from eulergen.errors import EulerError
from eulergen.runtime.interop.c_model import (SLOTS, Call, bound, literal, prototypes,
                                               weight_tables, wrapped)
from eulergen.runtime.interop.c_train_tape import Buffers, arena_sizes, buffer_macros, tape_text
from eulergen.runtime.model.params import parameters

STATE_MAGIC, STATE_VERSION, STATE_WORDS = b"EGS1\0\0\0\0", 1, 16
# the ops the tape calls, by their config key: the C each needs besides its forward's
_TRAINED = {**SLOTS, "loss": "model"}


@dataclass(frozen=True)
class Run:
    """What `export-c --train` continues: a checkpoint of a run (runtime/train/checkpoint.py)
    loaded as the numpy trainer loads it to resume (runtime/train/continued.py)."""
    cfg: object                 # its RunConfig, resolved
    config: dict                # as state.json holds it
    step: int
    updates: int                # the optimizer's update count
    guard: dict                 # the spike guard's loss_mean, norm_mean, seen
    data: dict                  # the loader's position
    tokenizer_digest: str | None
    files: tuple[str, ...]      # the token files the loader reads, in its order
    model: object               # a GPT on numpy: the weights and optimizer state in its arenas
    launches: tuple             # the Optimizer's: (op, arrays, copy, own slots, params)
    states: tuple               # (checkpoint name, state buffer, offset, shape): Optimizer's
    slots: tuple[str, ...]      # the optimizer's control array's
    rule: object                # step_control.StepRule: where decide writes in it
    spike: tuple[int, float]    # step_control's SPIKE_WARMUP and SPIKE_DECAY


def check_run(cfg, data: dict) -> None:
    """EulerError for a run this program cannot continue as the numpy trainer would."""
    t = cfg.training
    if t.dtype == "bf16":
        raise EulerError("export-c --train writes a float32 trainer: a bf16 run is not covered",
                         key="training.dtype")
    ranks = int(data.get("world_size", 1))
    if ranks != 1 or t.zero:
        raise EulerError(f"export-c --train writes a one-process trainer: a run of {ranks} "
                         "data-parallel ranks (or ZeRO) is not covered", key="training.zero")
    if t.recompute != "none":
        raise EulerError(f"export-c --train writes the tape of training.recompute none: "
                         f"{t.recompute!r} is not covered", key="training.recompute")
    if int(data.get("seed", t.seed)) != t.seed:   # as DataLoader.restore refuses it
        raise EulerError(f"data position was saved with seed {data['seed']}, the run's is "
                         f"{t.seed}", key="data")


def check_ops(a, optimizer) -> None:
    """EulerError naming the first op the tape or the optimizer (UpdateOps) calls whose kind
    has no C printer of it: of its training, or (an update op) of its step."""
    for slot, key in _TRAINED.items():
        op = getattr(a.ops, slot)
        if op is not None and (op.c is None or op.c_train is None):
            raise EulerError(f"op {op.name!r} ({op.kind} kind) has no C printer of its "
                             "training: export-c --train writes only ops whose kind prints it",
                             file=str(op.manifest), key=key)
    for op in optimizer.ops:
        if op.c is None:
            raise EulerError(f"op {op.name!r} ({op.kind} kind) has no C printer of its step (a "
                             "matrix step's GEMMs are the runtime's): export-c --train writes "
                             "only optimizers whose steps print C", file=str(op.manifest),
                             key="training.optimizer")


def sources(run: Run) -> tuple[dict[str, bytes], list[Call]]:
    """{file: bytes} of the generated training files and train_state.bin, and the op calls
    forward.c, backward.c and training.c make (each op's files follow from them)."""
    model = run.model
    forward, backward, calls = tape_text(model)
    steps = _optimizer(run, Buffers(model), calls)
    texts = {"training.h": _header(run), "plan.h": _plan_h(model),
             "training.c": _training_c(run, steps),
             "forward.c": _function_c(
                 "forward", "the forward pass over a batch, node by node as the numpy trainer "
                 "runs it, and the loss", "float forward(Training* m)", forward),
             "backward.c": _function_c(
                 "backward", "the backward pass: the loss's, then the tape's nodes in reverse",
                 "void backward(Training* m, int accumulate)", backward),
             "train_ops.h": _ops_h(calls)}
    files = {name: text.encode() for name, text in texts.items()}
    return files | {"train_state.bin": _state_bytes(run)}, calls


def _arenas(model) -> dict[str, tuple[str, int]]:
    """The plan's arenas, and an empty `optimizer` where its optimizer keeps no state."""
    return {"optimizer": ("float", 0), **arena_sizes(model)}


def _state_bytes(run: Run) -> bytes:
    """train_state.bin: STATE_WORDS 8-byte little-endian words (the magic, the version, the
    optimizer arena's floats, step, updates, the guard's seen, the data position, the seed,
    the guard's loss_mean and norm_mean as float64, zeros), then the optimizer arena."""
    g, d, mem = run.guard, run.data, run.model.mem
    state = mem.arenas["optimizer"] if "optimizer" in mem.arenas else None
    words = struct.pack("<8s9q2d", STATE_MAGIC, STATE_VERSION,
                        0 if state is None else state.size, run.step, run.updates,
                        int(g["seen"]), int(d["epoch"]), int(d["shard"]), int(d["batch"]),
                        int(run.cfg.training.seed), float(g["loss_mean"]), float(g["norm_mean"]))
    words += b"\0" * (STATE_WORDS * 8 - len(words))
    return words + (b"" if state is None else state.astype("<f4").tobytes())


def _optimizer(run: Run, buf: Buffers, calls: list) -> list[str]:
    """The optimizer's launches (Optimizer.step's), each a call of its update op's C step:
    its operands' ranges of the arenas, the step's control, its params."""
    lines = []
    for op, arrays, _, _, params in run.launches:
        values = {o.name: buf.ptr(a) for o, a in zip(op.inputs, arrays)}
        values |= {"control": "control", "n": arrays[0].size}
        values |= {n: float(v) for n, v in {**op.params, **params}.items() if v is not None}
        lines += bound(op, op.c_function("step"), values, "  ", calls)
    return lines


def _c_string(text: str, width: int = 72) -> str:
    """A C string literal of ASCII `text` (JSON's escapes are C's), as adjacent literals a
    line, each ending after a ", " where the text runs past `width` characters."""
    pieces = [""]
    for part in re.split(r"(?<=, )", text):
        if pieces[-1] and len(pieces[-1]) + len(part) > width:
            pieces.append("")
        pieces[-1] += part
    return "\n    ".join(json.dumps(piece) for piece in pieces)


def _header(run: Run) -> str:
    t, a, rule, arenas = run.cfg.training, run.model.arch, run.rule, _arenas(run.model)
    schedule = {"constant": 0, "linear": 1, "cosine": 2}[t.schedule]
    constants = [
        ("BATCH", t.batch_size, "training.batch_size"), ("SEQ", t.seq_len, "training.seq_len"),
        ("MICRO_STEPS", t.gradient_accumulation, "training.gradient_accumulation"),
        ("VOCAB", a.vocab, "model.vocab_size"),
        ("PARAMS", arenas["params"][1], "floats of params and grads"),
        ("OPTIMIZER", arenas["optimizer"][1], "floats of the optimizer's state"),
        ("TENSOR_COUNT", len(parameters(a)), "weights.bin's tensors"),
        ("STATE_COUNT", len(run.states), "the optimizer state's tensors"),
        ("LEARNING_RATE", t.learning_rate, ""), ("MIN_LR", t.min_lr, ""),
        ("WARMUP_STEPS", t.warmup_steps, ""), ("TOTAL_STEPS", t.total_steps, ""),
        ("SCHEDULE", schedule, f"{t.schedule}: 0 constant, 1 linear, 2 cosine"),
        ("GRAD_CLIP", float(t.grad_clip), ""), ("SPIKE_FACTOR", float(t.spike_factor), ""),
        ("SPIKE_WARMUP", run.spike[0], "accepted steps before the guard trusts its means"),
        ("SPIKE_DECAY", run.spike[1], "the guard's running means are EMAs of this decay"),
        ("SEED", t.seed, "training.seed: the batch order's"),
        ("CHECKPOINT_EVERY", t.checkpoint_every, ""),
        ("CONTROL_SLOTS", len(run.slots), f"the optimizer's control: {', '.join(run.slots)}"),
        *((f"SLOT_{n.upper()}", at, f"where decide writes {n} (-1: no slot)")
          for n, at in (("skip", rule.skip_at), ("scale", rule.scale_at), ("lr", rule.lr_at),
                        ("step", rule.step_at)))]
    fields = [f"  {c}* {n};" for n, (c, _) in arenas.items()]
    return "\n".join([
        "// training.h: written by `eulergen export-c --train`: the run this program continues,",
        "// as its config resolved it (the numpy trainer's settings, in its names), and its",
        "// memory: the arenas of its memory plan (runtime/model/plan.py; plan.h's buffers).",
        "#pragma once", "", '#include "weights.h"', "",
        *(f"#define EG_{n} {v!r}" + (f"   /* {c} */" if c else "") for n, v, c in constants),
        "", "typedef struct {", *fields, "} Training;", "",
        "// weights.bin's header and tensors (weights.h), and where each tensor lies in params;",
        "// the optimizer's state tensors, as optim.safetensors names them, in its arena",
        "extern const HeaderField EG_HEADER[];", "extern const int EG_HEADER_FIELDS;",
        "extern const TensorSpec EG_TENSORS[EG_TENSOR_COUNT];",
        "extern const long long EG_PARAM_AT[EG_TENSOR_COUNT];",
        "extern const TensorSpec EG_STATES[EG_STATE_COUNT];",
        "extern const long long EG_STATE_AT[EG_STATE_COUNT];",
        "// the run's config (JSON, as state.json holds it), its tokenizer's digest ('': none)",
        "extern const char EG_RUN_CONFIG[];", "extern const char EG_TOKENIZER_DIGEST[];",
        "// the token files the run read, in the loader's order (export-c resolved them)",
        "extern const char* const EG_DATA_FILES[];", "extern const int EG_DATA_FILE_COUNT;", "",
        "// The arenas, zeroed, with the loss's seed (dloss) and the ones a bias gradient sums.",
        "Training* training_new(void);",
        "// weights.bin (refused unless it is this model's) into params.",
        "void training_load(Training* m, const char* path);",
        "// The token ids and targets [EG_BATCH, EG_SEQ] a step's micro-batch reads.",
        "int* training_ids(Training* m);", "int* training_targets(Training* m);",
        "// forward.c: the loaded batch's mean loss. backward.c: the gradients, each parameter's",
        "// added to what is there where `accumulate` (a step's later micro-batches).",
        "float forward(Training* m);", "void backward(Training* m, int accumulate);",
        f"// The optimizer ({run.cfg.training.optimizer}: its generated C) over every parameter,",
        "// reading the step's control (EG_CONTROL_SLOTS).",
        "void training_step(Training* m, const float* control);", ""])


def _plan_h(model) -> str:
    lines = [f"#define {n} {expr}   /* {what} */" for n, expr, what in buffer_macros(model)]
    return "\n".join([
        "// plan.h: written by `eulergen export-c --train`: each buffer of the training memory",
        "// plan (runtime/model/plan.py), as a pointer into the arenas of the Training `m` of",
        "// the function that names it: the weights, each one's gradient (D_), the values the",
        "// backward reads (per block: H_<layer>_), the workspace the blocks share.",
        "#pragma once", "", *lines, ""])


def _training_c(run: Run, step: list[str]) -> str:
    model, a = run.model, run.model.arch
    plan, mem = model.mem.plan, model.mem
    header, tensors = weight_tables(a)
    at = [plan.buffer(s.name).offset for s in parameters(a)]
    states = [f'  {{"{name}", {len(shape)}, {{{", ".join(map(str, (*shape, 0)[:2]))}}}}},'
              for name, _, _, shape in run.states]
    state_at = [str(plan.buffer(buf).offset + offset) for _, buf, offset, _ in run.states]
    allocs = [f"  m->{n} = calloc({max(size, 1)}, sizeof(*m->{n}));"
              for n, (_, size) in _arenas(model).items()]
    fills = [f"  for (long long i = 0; i < {mem['dloss'].size}; ++i) DLOSS[i] = "
             f"{literal(float(mem['dloss'][0]))};   /* the loss is the tokens' mean */"]
    if "ones" in mem:
        fills.append(f"  for (long long i = 0; i < {mem['ones'].size}; ++i) ONES[i] = 1.0f;")
    return "\n".join([
        "// training.c: written by `eulergen export-c --train`: the Training arenas, the",
        "// weights into them, the optimizer's step over them (training.h), and the tables a",
        "// checkpoint is written from.",
        "#include <stdlib.h>", "#include <string.h>", "",
        '#include "error.h"', '#include "plan.h"', '#include "train_ops.h"',
        '#include "training.h"', "",
        "const HeaderField EG_HEADER[] = {", *header, "};",
        "const int EG_HEADER_FIELDS = sizeof EG_HEADER / sizeof *EG_HEADER;",
        "const TensorSpec EG_TENSORS[EG_TENSOR_COUNT] = {", *tensors, "};",
        *wrapped("const long long EG_PARAM_AT[EG_TENSOR_COUNT] = ", list(map(str, at)), "", "{};"),
        "const TensorSpec EG_STATES[EG_STATE_COUNT] = {", *states, "};",
        *wrapped("const long long EG_STATE_AT[EG_STATE_COUNT] = ", state_at, "", "{};"),
        f"const char EG_RUN_CONFIG[] = {_c_string(json.dumps(run.config))};",
        f"const char EG_TOKENIZER_DIGEST[] = {_c_string(run.tokenizer_digest or '')};",
        *wrapped("const char* const EG_DATA_FILES[] = ", [_c_string(f) for f in run.files], "",
                 "{};"),
        f"const int EG_DATA_FILE_COUNT = {len(run.files)};", "",
        "Training* training_new(void) {",
        "  Training* m = calloc(1, sizeof *m);",
        '  if (!m) eg_fail("out of memory");', *allocs,
        *(f'  if (!m->{n}) eg_fail("out of memory for the {n} arena");' for n in _arenas(model)),
        *fills, "  return m;", "}", "",
        "void training_load(Training* m, const char* path) {",
        "  float* host[EG_TENSOR_COUNT];",
        "  weights_load(path, EG_HEADER, EG_HEADER_FIELDS, EG_TENSORS, EG_TENSOR_COUNT, host);",
        "  for (int i = 0; i < EG_TENSOR_COUNT; ++i) {",
        "    const TensorSpec* t = &EG_TENSORS[i];",
        "    const long long n = t->ndim == 1 ? t->shape[0] : (long long)t->shape[0] * t->shape[1];",
        "    memcpy(m->params + EG_PARAM_AT[i], host[i], sizeof(float) * (size_t)n);",
        "  }",
        "  free(host[0]);   /* weights_load's one allocation */", "}", "",
        "int* training_ids(Training* m) { return IDX; }",
        "int* training_targets(Training* m) { return TARGETS; }", "",
        "// runtime/train/optimizer.py's launches: a range of the parameters (and of their",
        "// gradients and state) each, with the params its config gives (weight_decay 0 off",
        "// the matrices)",
        "void training_step(Training* m, const float* control) {", *step, "}", ""])


def _function_c(name: str, what: str, signature: str, body: list[str]) -> str:
    about = (f"{name}.c: written by `eulergen export-c --train` from the numpy trainer's tape "
             f"(runtime/model/training_tape.py): {what}. Each node is commented with what it "
             "reads and writes; the ops are their generated C (train_ops.h), the products "
             "train_cpu.h's.")
    return "\n".join([
        *(f"// {line}" for line in textwrap.wrap(about, 88)),
        "#include <math.h>", "#include <stddef.h>", "",
        '#include "plan.h"', '#include "train_cpu.h"', '#include "train_ops.h"',
        '#include "training.h"', "", f"{signature} {{", *body, "}", ""])


def _ops_h(calls: list[Call]) -> str:
    return "\n".join([
        "// train_ops.h: written by `eulergen export-c --train`: the op functions forward.c,",
        "// backward.c and training.c call, printed from the ops' derived expressions: their",
        "// generated C (<op>.c, <op>.train.c; the optimizer's <op>.c).",
        "#pragma once", "", *prototypes(calls), ""])
