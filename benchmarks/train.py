"""Training throughput and peak memory: eulergen against PyTorch (eager and torch.compile)
with the same architecture, in one run on one GPU.

    python benchmarks/train.py            # gpt2 and nanoeuler presets, B=8, T=1024
    python benchmarks/train.py --quick    # fewer steps, no torch.compile (< 3 minutes)

fp32 storage with TF32 GEMMs on both sides (eulergen: cublasGemmEx with TF32 compute;
torch: allow_tf32). A step is what a training loop does: forward, loss, backward, the
loss read to the host, global grad-norm clipping at 1.0, AdamW (betas 0.9/0.95, weight
decay 0.1 on matrices). Random tokens, fixed per run (ANCHORS.md's setup). tokens/s is
B·T over the median step time. Peak memory: eulergen's CuPy pool after the steps (the
pool keeps every block it ever held, so that is its peak); torch's max_memory_allocated.
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


def _config(preset: str, batch: int, seq: int):
    from eulergen.runtime.config import load_config
    return load_config(None, [f"model.preset={preset}", f"training.batch_size={batch}",
                              f"training.seq_len={seq}", "training.device=cuda",
                              "training.weight_decay=0.1", "training.grad_clip=1.0"])


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


def run_eulergen(cfg, warmup: int, iters: int) -> dict:
    import cupy

    from eulergen.runtime.backend import get_backend
    from eulergen.runtime.model import build
    from eulergen.runtime.ops import OpLibrary
    from eulergen.runtime.train import AdamW

    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    base = pool.total_bytes()
    t = cfg.training
    lib = OpLibrary(get_backend("cuda"))
    model = build(cfg.model, lib, t.batch_size, t.seq_len, tf32=True)
    model.init_weights(0)
    model.set_accumulation(1)
    optim = AdamW(model, t)
    x, y = _tokens(cfg)
    grads = model.mem.arenas["grads"]

    def step():
        model.load_tokens(x, y)
        loss = float(model.loss_and_grad()[0])
        norm = model.grad_norm()   # cuBLAS into a host scalar: cupy.dot would allocate
        if norm > t.grad_clip:
            cupy.multiply(grads, t.grad_clip / norm, out=grads)
        optim.step(LR)
        return loss

    seconds = _median_step(step, warmup, iters, cupy.cuda.get_current_stream().synchronize)
    result = dict(seconds=seconds, peak=pool.total_bytes() - base,
                  plan=model.mem.plan.total_bytes, loss=step())
    del model, optim, grads
    gc.collect()
    pool.free_all_blocks()
    return result


def run_torch(cfg, warmup: int, iters: int, compiled: bool) -> dict:
    import torch

    import torch_gpt

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    t = cfg.training
    # fp32 SDPA has no fused GQA path: repeat the KV heads (torch_gpt.py's fastest fp32 form)
    model = torch_gpt.TorchGPT(cfg.model, repeat_kv=True).cuda()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                               {"params": rest, "weight_decay": 0.0}], lr=LR,
                              betas=(t.beta1, t.beta2), eps=t.adam_eps, fused=True)
    forward = torch.compile(model) if compiled else model
    x, y = (torch.as_tensor(a, device="cuda") for a in _tokens(cfg))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()

    def step():
        _, loss = forward(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optim.step()
        optim.zero_grad(set_to_none=True)
        return loss.item()

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
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--presets", default=",".join(PRESETS))
    args = ap.parse_args()
    warmup, iters = (2, 5) if args.quick else (3, 10)
    rows = []
    for preset in args.presets.split(","):
        cfg = _config(preset, args.batch, args.seq)
        systems = [("eulergen", lambda: run_eulergen(cfg, warmup, iters)),
                   ("torch eager", lambda: run_torch(cfg, warmup, iters, compiled=False))]
        if not args.quick:
            systems.append(("torch.compile", lambda: run_torch(cfg, warmup, iters, compiled=True)))
        results = {}
        for system, fn in systems:
            say(f"{preset}: {system}")
            results[system] = _attempt(fn)
            if "seconds" in results[system]:
                say(f"{preset}: {system} {args.batch * args.seq / results[system]['seconds']:,.0f} tok/s")
        rows += [(preset, system, r, results["torch eager"]) for system, r in results.items()]
    gib = 1024 ** 3
    head = (f"{'preset':<10} {'system':<14} {'tok/s':>9} {'ms/step':>8} {'peak GiB':>9} "
            f"{'plan GiB':>9} {'tok/s vs eager':>15} {'mem vs eager':>13} {'loss':>7}")
    print(f"training step, B={args.batch} T={args.seq}, fp32 storage, TF32 GEMMs")
    print(head)
    print("-" * len(head))
    for preset, system, r, eager in rows:
        if "error" in r:
            print(f"{preset:<10} {system:<14} failed: {r['error']}")
            continue
        plan = f"{r['plan'] / gib:9.2f}" if "plan" in r else f"{'-':>9}"
        speed, mem = (f"{eager['seconds'] / r['seconds']:15.2f}", f"{r['peak'] / eager['peak']:13.2f}") \
            if "seconds" in eager else (f"{'-':>15}", f"{'-':>13}")
        print(f"{preset:<10} {system:<14} {args.batch * args.seq / r['seconds']:9,.0f} "
              f"{1e3 * r['seconds']:8.1f} {r['peak'] / gib:9.2f} {plan} {speed} {mem} "
              f"{r['loss']:7.3f}")
    print("targets: eulergen tok/s vs eager >= 1.00, mem vs eager <= 0.90")


if __name__ == "__main__":
    main()
