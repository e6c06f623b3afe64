"""Where one eulergen training step's time goes: every tape node, forward and backward,
and the loss, grad norm, step control and the optimizer's update ops (AdamW; `--set
training.optimizer=muon`: Muon's phases and Newton-Schulz GEMMs per matrix, its FLOPs
counted, and AdamW for the rest; clipping and the bf16 weight copy are inside the update
kernels), each between two CUDA events.

    python benchmarks/step_profile.py --preset gpt2,nanoeuler --dtype bf16 --batch 8,16
    python benchmarks/step_profile.py --json profile.json   # the tables as JSON too
    EULERGEN_GEMM=cublas python benchmarks/step_profile.py  # cublasGemmEx, no bias epilogues

The step is the trainer's (benchmarks/measure.py's `eulergen_stepper`: tokens, forward, loss,
backward, grad norm, step control with clip at 1.0, the update), on random tokens; plain steps
(replayed as CUDA graphs, as `train` runs them), timed for the wall time, alternate with
instrumented ones (the same kernels launched eagerly, on a Stepper of their own). The
instrumentation lives in step_spans.py: the tape's nodes are wrapped in timed stand-ins and
a few of the model's and the tape's methods are shadowed on their instances (GEMMs, the
gradient adds inside a node, the loss between forward and backward), so the runtime runs
unchanged and pays nothing when nobody profiles it.
A span's time is its events' elapsed time less the spans timed inside it; those nested
spans (a Linear's GEMMs, an op's gradient add) get lines of their own, and what is left
of the outer span is its `rest` line. Lines of the blocks' layers are summed into one
(h.*.), `n` saying how many calls it holds. Times are medians over the steps.

GEMM and attention lines give TFLOP/s against the GPU's dense peak at the step's GEMM
precision (bf16, or TF32 for fp32 storage; runtime/train/metrics.py); attention counts causal
flash FLOPs (forward 2 GEMMs, backward 5 with the recompute, half the T×T square each).
Memory-bound lines give the bytes their arrays hold (each input and output once: the
fewest a kernel can move) against a device-to-device copy measured in the same run.
The host's share: the uninstrumented step's wall time against the GPU time the lines
add up to; what is left is the GPU waiting for launches and host reads.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("CUPY_TF32", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from common import copy_gbps, say  # noqa: E402
from measure import config, eulergen_stepper  # noqa: E402
from step_spans import KINDS, Line, Spans, instrument  # noqa: E402



# -- one configuration -------------------------------------------------------------------


def profile(cfg, steps: int, warmup: int, copy: float | None = None) -> dict:
    """One configuration's lines and wall time; `copy`: the copy bandwidth, GB/s."""
    from eulergen.runtime.engine import bf16, gemm
    from eulergen.runtime.train import metrics
    from eulergen.runtime.engine.backend import get_backend
    from eulergen.runtime.model.gpt import build
    from eulergen.runtime.engine.ops import OpLibrary
    from eulergen.runtime.model.optimizer_plan import update_ops
    from eulergen.runtime.train.optimizer import Optimizer

    t = cfg.training
    backend = get_backend(t.device)
    lib = OpLibrary(backend)
    dtype = bf16.plan_dtype(t.dtype, backend)
    ops = update_ops(lib, t.optimizer)
    model = build(cfg.model, lib, t.batch_size, t.seq_len, tf32=True, dtype=dtype,
                  precision=t.precision, recompute=t.recompute, optimizer=ops)
    model.init_weights(0)
    optim = Optimizer(model, ops, t)
    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, cfg.model.vocab_size, (t.batch_size, t.seq_len)) for _ in "xy")
    _, graphed = eulergen_stepper(model, optim, t, cuda_graph=backend.is_gpu)
    _, eager = eulergen_stepper(model, optim, t, cuda_graph=False)

    def step():
        graphed(x, y)

    start, done = time.perf_counter(), 0
    while done < warmup or time.perf_counter() - start < 1.0:   # clocks settle after compiling
        step()
        backend.synchronize()
        done += 1
    spans, walls, per_step = Spans(backend), [], []
    for _ in range(steps):
        # plain and timed steps alternate, so both meet the same clocks and temperature
        start = time.perf_counter()
        step()
        backend.synchronize()
        walls.append(1e3 * (time.perf_counter() - start))
        undo = instrument(model, spans)
        eager(x, y)
        per_step.append(spans.collect())
        undo()
    keys = list(dict.fromkeys(k for s in per_step for k in s))
    lines = []
    for name, kind in keys:
        rows = [s.get((name, kind), [0.0, 0, 0.0, 0.0]) for s in per_step]
        ms = statistics.median(r[0] for r in rows)
        calls, flops, nbytes = max(rows, key=lambda r: r[1])[1:]
        lines.append(Line(name, kind, calls, ms, flops, nbytes))
    device = backend.device
    precision = "bf16" if dtype == "bf16" else "tf32"
    return dict(preset=cfg.model.preset, batch=t.batch_size, seq=t.seq_len, dtype=t.dtype,
                recipe=t.precision if dtype == "bf16" else "-",
                device=device, gemm=gemm.describe(backend),
                peak_flops=metrics.peak_flops(device, precision),
                precision=precision, copy_gbps=copy,
                wall_ms=statistics.median(walls), lines=[asdict(r) for r in lines])


# -- the tables --------------------------------------------------------------------------


def table(p: dict) -> str:
    lines = [Line(**r) for r in p["lines"]]
    gpu = sum(r.ms for r in lines)
    wall, peak, copy = p["wall_ms"], p["peak_flops"], p["copy_gbps"]
    title = (f"step profile: {p['preset']}, B={p['batch']} T={p['seq']}, {p['dtype']} "
             f"(training.precision={p['recipe']}) on {p['device']}")
    out = [title + (f"; GEMM peak {peak / 1e12:.1f} TFLOP/s ({p['precision']})" if peak else ""),
           f"GEMMs: {p['gemm']}",
           f"copy bandwidth (device-to-device, read+write): {copy:,.0f} GB/s" if copy
           else "copy bandwidth: - (no GPU)"]
    head = (f"{'line':<52} {'kind':<13} {'n':>3} {'ms':>8} {'share':>6} {'TFLOP/s':>8} "
            f"{'of peak':>7} {'GB/s':>7} {'of copy':>7}")
    out += [head, "-" * len(head)]
    for r in lines:
        tf = r.flops / r.ms / 1e9 if r.flops and r.ms > 0 else None
        gb = r.nbytes / r.ms / 1e6 if r.nbytes and r.ms > 0 else None
        cells = [f"{tf:8.1f}" if tf else f"{'':>8}",
                 f"{tf * 1e12 / peak:7.0%}" if tf and peak else f"{'':>7}",
                 f"{gb:7.0f}" if gb else f"{'':>7}",
                 f"{gb / copy:7.0%}" if gb and copy else f"{'':>7}"]
        out.append(f"{r.name[:52]:<52} {r.kind:<13} {r.calls:3d} {r.ms:8.3f} "
                   f"{r.ms / gpu:6.1%} {' '.join(cells)}")
    out += ["", f"{'kind':<14} {'ms':>8} {'of GPU':>7} {'of wall':>7} {'TFLOP/s':>8} {'GB/s':>7}"]
    for kind in KINDS:
        rows = [r for r in lines if r.kind == kind]
        if not rows:
            continue
        ms = sum(r.ms for r in rows)
        flops, nbytes = sum(r.flops for r in rows), sum(r.nbytes for r in rows)
        tf = f"{flops / ms / 1e9:8.1f}" if flops and ms > 0 else f"{'':>8}"
        gb = f"{nbytes / ms / 1e6:7.0f}" if nbytes and ms > 0 else f"{'':>7}"
        out.append(f"{kind:<14} {ms:8.3f} {ms / gpu:7.1%} {ms / wall:7.1%} {tf} {gb}")
    out += [f"{'GPU (sum)':<14} {gpu:8.3f}",
            f"wall step {wall:.3f} ms (uninstrumented, median); GPU time {gpu:.3f} ms; " + (
                f"host share {1 - gpu / wall:.1%} (the GPU idle, waiting for launches and "
                f"host reads)" if gpu <= wall else
                f"host share: none seen; the lines add up to {gpu - wall:.3f} ms more than "
                f"the uninstrumented step: read them as upper bounds")]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt2", help="gpt2, nanoeuler or both, comma-separated")
    ap.add_argument("--batch", default="8", help="batch sizes, comma-separated")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--dtype", default="bf16", help="bf16, fp32 or both, comma-separated")
    ap.add_argument("--device", default="cuda", choices=("cuda", "numpy"))
    ap.add_argument("--steps", type=int, default=7, help="timed steps (medians over them)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    metavar="SECTION.KEY=VALUE", help="a config override (a smaller model)")
    ap.add_argument("--json", type=Path, help="also write the profiles to this JSON file")
    args = ap.parse_args()
    profiles = []
    copy = copy_gbps() if args.device == "cuda" else None
    for preset in args.preset.split(","):
        for dtype in args.dtype.split(","):
            for batch in (int(b) for b in args.batch.split(",")):
                say(f"profiling {preset} {dtype} B={batch}")
                cfg = config(preset, batch, args.seq, dtype, f"training.device={args.device}",
                             *args.overrides)
                p = profile(cfg, args.steps, args.warmup, copy)
                print(table(p), "\n", flush=True)
                profiles.append(p)
                if args.json:   # after each one: a run cut off still leaves what it measured
                    from eulergen.files import write_atomic
                    write_atomic(args.json, json.dumps(profiles, indent=1).encode())


if __name__ == "__main__":
    main()
