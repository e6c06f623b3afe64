"""Training throughput and peak memory: eulergen against PyTorch (eager and torch.compile)
with the same architecture, in one run on one GPU.

    python benchmarks/train.py              # gpt2 and nanoeuler presets, B=8, T=1024
    python benchmarks/train.py --quick      # fewer steps, no torch.compile (< 3 minutes)
    python benchmarks/train.py --dtype bf16 --batch 8,16   # one table per batch size
    python benchmarks/train.py --dtype bf16 --quick --eager   # also eulergen uncaptured

--dtype fp32 (the default): fp32 storage with TF32 GEMMs on both sides (eulergen:
cublasGemmEx with TF32 compute; torch: allow_tf32); ratios against torch eager.
--dtype bf16: eulergen's training.dtype=bf16 (bf16 activations and GEMM operands, fp32
accumulation, fp32 master weights and AdamW moments) against torch's bf16 autocast (fp32
parameters, bf16 matmuls, SDPA's flash kernel with enable_gqa), eager and torch.compile;
ratios against torch.compile, the bar a PyTorch user reaches in two lines.
A step is what a training loop does: forward, loss, backward, the loss read to the host,
global grad-norm clipping at 1.0, AdamW (betas 0.9/0.95, weight decay 0.1 on matrices;
torch: fused=True). eulergen runs it as the trainer does (runtime/train/step_graph.py: one CUDA
graph per stage, training.cuda_graph; --eager adds a row of the same kernels launched
without the graphs), its spike guard off as torch has none. Random tokens, fixed per run (ANCHORS.md's setup). tokens/s is B·T
over the median step time; MFU is tokens/s × FLOPs per token (runtime/train/metrics.py) over the
GPU's dense peak at the precision (TF32 or bf16). Peak memory: eulergen's CuPy pool after
the steps (the pool keeps every block it ever held, so that is its peak); torch's
max_memory_allocated. eulergen's plan: the bytes `eulergen plan` lays out for the same run;
the issue's target is the run's peak within 5% of it. dev/plan: the GPU memory the driver
reports in use after eulergen's steps less before its model was built (the pool's peak plus
what CuPy's pool does not see: the cuBLAS workspace, the kernel modules), over the plan.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("CUPY_TF32", "1")   # any cupy.matmul follows the same TF32 setting
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from common import say  # noqa: E402

PRESETS = ("gpt2", "nanoeuler")
LR = 6e-4


def config(preset: str, batch: int, seq: int, dtype: str, *overrides: str):
    """The benchmarked run's config; `overrides` come last (a device, a smaller model)."""
    from eulergen.runtime.train.config import load_config
    return load_config(None, [f"model.preset={preset}", f"training.batch_size={batch}",
                              f"training.seq_len={seq}", "training.device=cuda",
                              "training.weight_decay=0.1", "training.grad_clip=1.0",
                              "training.spike_factor=0", f"training.dtype={dtype}",
                              *overrides])


def _mfu(cfg, seconds: float) -> float | None:
    """Model FLOPs utilisation of one step, counted as the trainer counts it."""
    import cupy

    from eulergen.runtime.train import metrics
    from eulergen.runtime.model.arch import arch_of
    from eulergen.runtime.engine.backend import NUMPY
    from eulergen.runtime.engine.ops import OpLibrary
    from eulergen.runtime.train.trainer import flops_per_token
    t = cfg.training
    flops = flops_per_token(arch_of(cfg.model, OpLibrary(NUMPY)), t.seq_len)
    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    name = name.decode() if isinstance(name, bytes) else name
    peak = metrics.peak_flops(name, "bf16" if t.dtype == "bf16" else "tf32")
    return t.batch_size * t.seq_len / seconds * flops / peak if peak else None


def _tokens(cfg, seed=0):
    rng = np.random.default_rng(seed)
    t = cfg.training
    shape = (t.batch_size, t.seq_len)
    return rng.integers(0, cfg.model.vocab_size, shape), rng.integers(0, cfg.model.vocab_size, shape)


def _median_step(step, warmup: int, iters: int, sync) -> float:
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def eulergen_stepper(model, optim, t, cuda_graph: bool = True, dp=None):
    """(a Stepper as the trainer makes it, its one-step call: launch, then the loss read
    back, so the step has ended). `dp`: a rank's DataParallel (runtime/distributed/data_parallel.py)."""
    from eulergen.runtime.train.step_control import StepRule
    from eulergen.runtime.train.step_graph import Stepper
    ranks = dp.ranks if dp is not None else 1
    rule = StepRule.of(t, optim.slots, ranks, zero=dp is not None and dp.zero)
    stepper = Stepper(model, optim, rule, cuda_graph=cuda_graph, dp=dp)
    steps = iter(range(1, 1 << 30))

    def step(x, y) -> float:
        stepper.launch(next(steps), [(x, y)], LR)
        return stepper.result().loss
    return stepper, step


def _device_used() -> int:
    """Bytes in use on the GPU, by anyone: what the driver reports, beyond CuPy's pool (the
    cuBLAS workspace, loaded kernel modules)."""
    import cupy
    free, total = cupy.cuda.runtime.memGetInfo()
    return total - free


def run_eulergen(cfg, warmup: int, iters: int, cuda_graph: bool = True) -> dict:
    import cupy

    from eulergen.runtime.train.adamw import AdamW
    from eulergen.runtime.engine.backend import get_backend
    from eulergen.runtime.model.gpt import build
    from eulergen.runtime.engine.ops import OpLibrary

    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    base = pool.total_bytes()
    used = _device_used()
    t = cfg.training
    lib = OpLibrary(get_backend("cuda"))
    model = build(cfg.model, lib, t.batch_size, t.seq_len, tf32=True,
                  dtype="bf16" if t.dtype == "bf16" else "float32")
    model.init_weights(0)
    model.set_accumulation(1)
    optim = AdamW(model, t)
    stepper, one_step = eulergen_stepper(model, optim, t, cuda_graph)
    x, y = _tokens(cfg)

    def step():
        return one_step(x, y)

    seconds = _median_step(step, warmup, iters, cupy.cuda.get_current_stream().synchronize)
    result = dict(seconds=seconds, peak=pool.total_bytes() - base,
                  plan=model.mem.plan.total_bytes, loss=step(), device=_device_used() - used)
    del model, optim, stepper
    gc.collect()
    pool.free_all_blocks()
    return result


def torch_model(cfg):
    """The PyTorch model of a config on the GPU, and its AdamW (fused; weight decay on
    matrices only, as eulergen's)."""
    import torch

    import torch_gpt

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    t = cfg.training
    # fp32 SDPA has no fused GQA path: repeat the KV heads (torch_gpt.py's fastest fp32
    # form); in bf16 the flash kernel takes enable_gqa
    model = torch_gpt.TorchGPT(cfg.model, repeat_kv=t.dtype != "bf16").cuda()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                               {"params": rest, "weight_decay": 0.0}], lr=LR,
                              betas=(t.beta1, t.beta2), eps=t.adam_eps, fused=True)
    return model, optim


def torch_step(forward, model, optim, x, y, t) -> float:
    """One PyTorch training step as a loop runs it (bf16: under autocast); the loss."""
    import contextlib

    import torch
    bf16 = torch.autocast("cuda", dtype=torch.bfloat16) if t.dtype == "bf16" else None
    with bf16 or contextlib.nullcontext():
        _, loss = forward(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
    optim.step()
    optim.zero_grad(set_to_none=True)
    return loss.item()


def run_torch(cfg, warmup: int, iters: int, compiled: bool) -> dict:
    import torch

    model, optim = torch_model(cfg)
    forward = torch.compile(model) if compiled else model
    x, y = (torch.as_tensor(a, device="cuda") for a in _tokens(cfg))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()

    def step():
        return torch_step(forward, model, optim, x, y, cfg.training)

    seconds = _median_step(step, warmup, iters, torch.cuda.synchronize)
    result = dict(seconds=seconds, peak=torch.cuda.max_memory_allocated(), loss=step())
    del model, optim, forward
    gc.collect()
    torch.cuda.empty_cache()
    return result


def _attempt(fn) -> dict:
    """One system's figures, or the one line that says why it could not run (the other
    systems still run: a benchmark that stops at the first failure reports nothing)."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - reported in the table, not hidden
        import traceback
        traceback.print_exc()
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return {"error": f"{type(err).__name__}: {first}"[:160]}
    finally:   # a failed run's arrays die with its frames: hand their memory back
        import cupy
        import torch
        gc.collect()
        cupy.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps, no torch.compile")
    ap.add_argument("--batch", default="8", help="batch sizes, comma-separated (8,16)")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                    help="fp32 (TF32 GEMMs) or bf16 mixed precision on every side")
    ap.add_argument("--eager", action="store_true",
                    help="also eulergen without CUDA graphs (training.cuda_graph=false)")
    args = ap.parse_args()
    warmup, iters = (2, 5) if args.quick else (3, 10)
    eager = "torch eager autocast" if args.dtype == "bf16" else "torch eager"
    # the bar: torch eager in fp32; torch.compile in bf16 (eager with --quick)
    base = "torch.compile" if args.dtype == "bf16" and not args.quick else eager
    for batch in (int(b) for b in args.batch.split(",")):
        rows = []
        for preset in args.presets.split(","):
            cfg = config(preset, batch, args.seq, args.dtype)
            systems = [("eulergen", lambda: run_eulergen(cfg, warmup, iters))]
            if args.eager:
                systems.append(("eulergen eager",
                                lambda: run_eulergen(cfg, warmup, iters, False)))
            systems.append((eager, lambda: run_torch(cfg, warmup, iters, compiled=False)))
            if not args.quick:
                systems.append(("torch.compile",
                                lambda: run_torch(cfg, warmup, iters, compiled=True)))
            results = {}
            for system, fn in systems:
                say(f"{preset} B={batch}: {system}")
                results[system] = _attempt(fn)
                if "seconds" in results[system]:
                    results[system]["mfu"] = _mfu(cfg, results[system]["seconds"])
                    say(f"{preset} B={batch}: {system} "
                        f"{batch * args.seq / results[system]['seconds']:,.0f} tok/s")
            rows += [(preset, system, r, results[base]) for system, r in results.items()]
        _table(rows, batch, args, base)


def _table(rows, batch: int, args, base: str) -> None:
    gib = 1024 ** 3
    short = "compile" if base == "torch.compile" else "eager"
    head = (f"{'preset':<10} {'system':<20} {'tok/s':>9} {'ms/step':>8} {'MFU':>6} "
            f"{'peak GiB':>9} {'plan GiB':>9} {'peak/plan':>9} {'dev/plan':>8} "
            f"{f'tok/s vs {short}':>17} "
            f"{f'mem vs {short}':>15} {'loss':>7}")
    precision = ("bf16 mixed precision (bf16 activations and GEMMs, fp32 accumulation, "
                 "fp32 master weights)" if args.dtype == "bf16" else "fp32 storage, TF32 GEMMs")
    print(f"training step, B={batch} T={args.seq}, {precision}")
    print(head)
    print("-" * len(head))
    for preset, system, r, ref in rows:
        if "error" in r:
            print(f"{preset:<10} {system:<20} failed: {r['error']}")
            continue
        plan = (f"{r['plan'] / gib:9.2f} {r['peak'] / r['plan']:9.3f} "
                f"{r['device'] / r['plan']:8.3f}" if "plan" in r else f"{'-':>9} {'-':>9} {'-':>8}")
        mfu = f"{100 * r['mfu']:5.1f}%" if r.get("mfu") else f"{'-':>6}"
        speed, mem = (f"{ref['seconds'] / r['seconds']:17.2f}", f"{r['peak'] / ref['peak']:15.2f}") \
            if "seconds" in ref else (f"{'-':>17}", f"{'-':>15}")
        print(f"{preset:<10} {system:<20} {batch * args.seq / r['seconds']:9,.0f} "
              f"{1e3 * r['seconds']:8.1f} {mfu} {r['peak'] / gib:9.2f} {plan} {speed} {mem} "
              f"{r['loss']:7.3f}")
    if args.dtype == "bf16":
        print(f"targets: eulergen tok/s vs {short} >= 1.00 (goal 1.25), mem vs {short} <= 1.00, "
              "peak/plan <= 1.05")
    else:
        print("targets: eulergen tok/s vs eager >= 1.00, mem vs eager <= 0.90, peak/plan <= 1.05")
    print(flush=True)


if __name__ == "__main__":
    main()
