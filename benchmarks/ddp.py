"""Data-parallel throughput: tokens/s per GPU at 1, 2, … N GPUs for eulergen (NCCL, the
gradient buckets overlapped with the backward; and with ZeRO-1) and PyTorch DDP (bf16
autocast + torch.compile), in one run on one machine, with each system's scaling
efficiency (tokens/s per GPU over its own at one GPU, the same batch a GPU) and eulergen
over PyTorch DDP at each size.

    python benchmarks/ddp.py                            # gpt2, bf16, B=8 T=1024 a GPU, 1..all
    python benchmarks/ddp.py --gpus 1,2,8 --preset nanoeuler --dtype fp32

Each world size is one set of processes under torchrun's variables (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT; NCCL_NVLS_ENABLE=0), which run the systems one after
another on random tokens (a rank's own); rank 0 reports each system's median step. At one
GPU eulergen also runs without a collective: what the data-parallel path costs there.
The step is benchmarks/measure.py's (the trainer's Stepper: clip at 1.0, AdamW, the loss
read back; the spike guard off).
Targets (issue 26): efficiency >= 0.95 at 2 GPUs and >= 0.90 at 8, and >= PyTorch DDP's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import say  # noqa: E402
from measure import (_median_step, _tokens, config, eulergen_stepper, torch_model,  # noqa: E402
                     torch_step)

SYSTEMS = ("eulergen", "eulergen ZeRO-1", "torch DDP compile")
ALONE = "eulergen, no collective"
RESULT = "RESULT "


def run_eulergen(cfg, collective, zero: bool, warmup: int, iters: int) -> float:
    """Median seconds of a data-parallel step as the trainer runs it (the Stepper, CUDA
    graphs with the NCCL calls inside; collective None: the plain step)."""
    import cupy

    from eulergen.runtime.model.optimizer_plan import update_ops
    from eulergen.runtime.train.optimizer import Optimizer
    from eulergen.runtime.model.arch import arch_of
    from eulergen.runtime.engine.backend import get_backend
    from eulergen.runtime.distributed.buckets import plan_buckets
    from eulergen.runtime.distributed.data_parallel import DataParallel
    from eulergen.runtime.model.gpt import build
    from eulergen.runtime.engine.ops import OpLibrary
    t = cfg.training
    lib = OpLibrary(get_backend("cuda"))
    ranks = collective.world_size if collective is not None else 1
    plan = None if collective is None else plan_buckets(
        arch_of(cfg.model, lib), ranks, zero=zero, bucket_mb=t.bucket_mb,
        itemsize=2 if t.dtype == "bf16" else 4)
    ops = update_ops(lib, t.optimizer)
    model = build(cfg.model, lib, t.batch_size, t.seq_len, tf32=True, buckets=plan,
                  dtype="bf16" if t.dtype == "bf16" else "float32", optimizer=ops)
    model.init_weights(0)
    model.set_accumulation(1, ranks)
    dp = DataParallel(model, collective, plan) if plan is not None else None
    optim = Optimizer(model, ops, t, dp if zero else None)
    stepper, step = eulergen_stepper(model, optim, t, dp=dp)
    x, y = _tokens(cfg, seed=collective.rank if collective is not None else 0)
    seconds = _median_step(lambda: step(x, y), warmup, iters,
                           cupy.cuda.get_current_stream().synchronize)
    del model, optim, dp, stepper
    cupy.get_default_memory_pool().free_all_blocks()
    return seconds


def run_torch_ddp(cfg, rank: int, world: int, port: int, warmup: int, iters: int) -> float:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    model, optim = torch_model(cfg)
    ddp = DistributedDataParallel(model, device_ids=[rank], gradient_as_bucket_view=True)
    forward = torch.compile(ddp)
    x, y = (torch.as_tensor(a, device="cuda") for a in _tokens(cfg, seed=rank))
    seconds = _median_step(lambda: torch_step(forward, model, optim, x, y, cfg.training).item(),
                           warmup, iters, torch.cuda.synchronize)
    dist.destroy_process_group()
    return seconds


def worker(args) -> None:
    """One rank: every system in turn; rank 0 prints a RESULT line for each."""
    from eulergen.runtime.distributed.collective import Rendezvous
    from eulergen.runtime.distributed.nccl import NcclCollective
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cfg = config(args.preset, args.batch, args.seq, args.dtype)
    warmup, iters = args.warmup, args.iters

    def report(system: str, fn) -> None:
        try:
            out = {"seconds": fn()}
        except Exception as err:  # noqa: BLE001 - reported in the table, the others still run
            out = {"error": f"{type(err).__name__}: {str(err).strip()[:160]}"}
        if rank == 0:
            print(RESULT + json.dumps({"system": system, "gpus": world, **out}), flush=True)

    rv = Rendezvous(rank, world, int(os.environ["LOCAL_RANK"]), os.environ["MASTER_ADDR"],
                    int(os.environ["MASTER_PORT"]))
    collective = NcclCollective(rv)
    try:
        if world == 1:
            report(ALONE, lambda: run_eulergen(cfg, None, False, warmup, iters))
        report(SYSTEMS[0], lambda: run_eulergen(cfg, collective, False, warmup, iters))
        report(SYSTEMS[1], lambda: run_eulergen(cfg, collective, True, warmup, iters))
    finally:
        collective.close()
    report(SYSTEMS[2], lambda: run_torch_ddp(cfg, rank, world, args.torch_port, warmup, iters))


def launch(args, world: int) -> list[dict]:
    """The world's processes; rank 0's results (a failed world: one error row)."""
    from eulergen.runtime.distributed.collective import free_port
    from eulergen.runtime.distributed.nccl import ENV as NCCL_ENV
    env = {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), **NCCL_ENV}
    cmd = [sys.executable, __file__, "--worker", "--torch-port", str(free_port()),
           *(f"--{k}={v}" for k, v in (("preset", args.preset), ("batch", args.batch),
                                       ("seq", args.seq), ("dtype", args.dtype),
                                       ("warmup", args.warmup), ("iters", args.iters)))]
    procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL, text=True)
             for r in range(world)]
    try:
        out, _ = procs[0].communicate(timeout=args.timeout)
        for p in procs[1:]:
            p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        return [{"system": "all", "gpus": world, "error": f"timed out after {args.timeout} s"}]
    return [json.loads(line[len(RESULT):]) for line in out.splitlines() if line.startswith(RESULT)]


def table(rows: list[dict], args) -> None:
    tokens = args.batch * args.seq
    one = {r["system"]: r["seconds"] for r in rows if r["gpus"] == 1 and "seconds" in r}
    torch = {r["gpus"]: r["seconds"] for r in rows
             if r["system"] == SYSTEMS[2] and "seconds" in r}
    head = (f"{'system':<24} {'GPUs':>4} {'tok/s':>11} {'tok/s/GPU':>10} {'ms/step':>8} "
            f"{'efficiency':>10} {'vs torch DDP':>12}")
    print(f"data-parallel training step, {args.preset}, {args.dtype}, B={args.batch} "
          f"T={args.seq} a GPU")
    print(head)
    print("-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['system']:<24} {r['gpus']:>4} failed: {r['error']}")
            continue
        s, n = r["seconds"], r["gpus"]
        base = one.get(r["system"])
        eff = f"{base / s:10.3f}" if base else f"{'-':>10}"
        vs = f"{torch[n] / s:12.2f}" if n in torch else f"{'-':>12}"
        print(f"{r['system']:<24} {n:>4} {n * tokens / s:11,.0f} {tokens / s:10,.0f} "
              f"{1e3 * s:8.1f} {eff} {vs}")
    print("targets: efficiency >= 0.95 at 2 GPUs, >= 0.90 at 8, and >= torch DDP's", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", help="world sizes, comma-separated (default 1..all visible)")
    ap.add_argument("--preset", default="gpt2")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=400.0, help="seconds a world size may take")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--torch-port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    import cupy
    visible = cupy.cuda.runtime.getDeviceCount()
    worlds = [int(n) for n in args.gpus.split(",")] if args.gpus else list(range(1, visible + 1))
    if max(worlds) > visible:
        sys.exit(f"--gpus {max(worlds)}: {visible} GPUs are visible")
    rows = []
    for world in worlds:
        say(f"{world} GPU(s) ...")
        rows += launch(args, world)
    table(rows, args)


if __name__ == "__main__":
    main()
