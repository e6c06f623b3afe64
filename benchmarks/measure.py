"""One benchmarked training configuration, measured in this process, and the step code the
benchmarks share (benchmarks/train.py runs each configuration through this file in a
fresh process; ddp.py, step_profile.py and converge_side.py take its steps).

    python benchmarks/measure.py --system torch --mode max-autotune --preset gpt2 \\
        --batch 8 --dtype bf16 --result r.jsonl

A step is what a training loop does: forward, loss, backward, the loss read to the host,
global grad-norm clipping at 1.0, AdamW (betas 0.9/0.95, weight decay 0.1 on matrices;
torch: fused=True). eulergen runs it as the trainer does (runtime/train/step_graph.py: one
CUDA graph per stage; `eulergen-eager` launches the same kernels without the graphs), its
spike guard off as torch has none. PyTorch runs TorchGPT (benchmarks/torch_gpt.py) eager or
through torch.compile(mode=..., dynamic=False) after torch._dynamo.reset(), in bf16 under
autocast; `--sdpa flash|cudnn` holds SDPA to that backend for the whole run
(torch.nn.attention.sdpa_kernel; cuDNN gets the KV heads repeated, as its path checks no
head counts). Random tokens, fixed per run.

Timing: the first step alone (compiling, capturing: `first_s`), `--warmup` more, then
`--repeats` runs of `--steps` steps, each run's median step time (wall clock, the device
synchronised after every step). MFU: tokens/s × the trainer's FLOPs per token
(runtime/train/trainer.py's flops_per_token: 6 per matmul parameter plus attention's
12·L·H·hd·T, the full T×T square as PaLM's appendix and nanoGPT count it; the causal kernels
do about half of that) over the GPU's dense peak at the step's GEMM precision. Peak memory:
eulergen's CuPy pool after the steps (the pool keeps every block it held), torch's
max_memory_allocated; eulergen's plan is what `eulergen plan` lays out for the run, and
`device` the driver's bytes in use less before the model was built.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("CUPY_TF32", "1")   # any cupy.matmul follows the same TF32 setting
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from isolated import emit  # noqa: E402

LR = 6e-4
MODES = ("eager", "default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")
CPU_DEFAULT = "cpu-default"   # a --preset: the built-in CPU default (no model.preset)
SDPA = ("auto", "flash", "cudnn")


def config(preset: str, batch: int, seq: int, dtype: str, *overrides: str):
    """The benchmarked run's config; `overrides` come last (a device, a smaller model). A
    sequence longer than the preset's gets as many positions (model.max_seq_len).
    CPU_DEFAULT: `eulergen train`'s built-in CPU default on numpy (torch: on the CPU)."""
    from eulergen.runtime.train.config import load_config
    model = [] if preset == CPU_DEFAULT else [f"model.preset={preset}"]
    device = "numpy" if preset == CPU_DEFAULT else "cuda"
    given = [*model, f"training.batch_size={batch}",
             f"training.device={device}", "training.weight_decay=0.1", "training.beta1=0.9",
             "training.beta2=0.95", "training.adam_eps=1e-8", "training.grad_clip=1.0",
             "training.spike_factor=0", f"training.dtype={dtype}"]
    if seq > load_config(None, model + list(overrides)).model.max_seq_len:
        given.append(f"model.max_seq_len={seq}")
    return load_config(None, [*given, f"training.seq_len={seq}", *overrides])


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


def timed_steps(step, sync, warmup: int, steps: int, repeats: int) -> tuple[float, list[float]]:
    """(seconds of the first step, the median step of each of `repeats` runs of `steps`
    steps after `warmup` more)."""
    start = time.perf_counter()
    step()
    sync()
    first = time.perf_counter() - start
    return first, [_median_step(step, warmup if i == 0 else 0, steps, sync)
                   for i in range(repeats)]


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


def torch_model(cfg, params: dict | None = None, repeat_kv: bool | None = None):
    """The PyTorch model of a config on its device (cuda, or the CPU for a numpy run),
    its weights `params` (eulergen's names) or torch's own init, and its AdamW (fused on
    the GPU; weight decay on matrices only, as eulergen's). fp32 SDPA has no fused GQA
    path, so by default fp32 repeats the KV heads (torch_gpt.py's fastest fp32 form)."""
    import torch

    import torch_gpt

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    t = cfg.training
    device = torch_device(cfg)
    repeat = t.dtype != "bf16" if repeat_kv is None else repeat_kv
    model = torch_gpt.TorchGPT(cfg.model, repeat_kv=repeat)
    if params is not None:
        torch_gpt.load_eulergen_params(model, params)
    model = model.to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                               {"params": rest, "weight_decay": 0.0}], lr=LR,
                              betas=(t.beta1, t.beta2), eps=t.adam_eps,
                              fused=device == "cuda")
    return model, optim


def torch_device(cfg) -> str:
    return "cpu" if cfg.training.device == "numpy" else "cuda"


def torch_step(forward, model, optim, x, y, t):
    """One PyTorch training step as a loop runs it (bf16: under autocast); the loss as a
    device tensor (`.item()` reads it back)."""
    import torch
    device = x.device.type
    bf16 = torch.autocast(device, dtype=torch.bfloat16) if t.dtype == "bf16" else None
    with bf16 or contextlib.nullcontext():
        _, loss = forward(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
    optim.step()
    optim.zero_grad(set_to_none=True)
    return loss.detach()


def compiled(model, mode: str):
    """`model` as torch.compile(mode, dynamic=False) makes it, after a reset of dynamo's
    caches (so no configuration inherits another's graphs); "eager": the model itself."""
    import torch
    torch._dynamo.reset()
    return model if mode == "eager" else torch.compile(model, mode=mode, dynamic=False)


def sdpa_backend(name: str):
    """A context holding SDPA to backend `name` ("auto": PyTorch's own choice)."""
    if name == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([{"flash": SDPBackend.FLASH_ATTENTION,
                         "cudnn": SDPBackend.CUDNN_ATTENTION}[name]])


def _mfu(cfg, seconds: float, device_name: str | None) -> float | None:
    """Model FLOPs utilisation of a step of `seconds`, counted as the trainer counts it."""
    from eulergen.runtime.engine.backend import NUMPY
    from eulergen.runtime.engine.ops import OpLibrary
    from eulergen.runtime.model.arch import arch_of
    from eulergen.runtime.train import metrics
    from eulergen.runtime.train.trainer import flops_per_token
    if device_name is None:
        return None
    t = cfg.training
    peak = metrics.peak_flops(device_name, "bf16" if t.dtype == "bf16" else "tf32")
    flops = flops_per_token(arch_of(cfg.model, OpLibrary(NUMPY)), t.seq_len)
    return t.batch_size * t.seq_len / seconds * flops / peak if peak else None


def run_eulergen(cfg, warmup: int, steps: int, repeats: int, cuda_graph: bool = True) -> dict:
    from eulergen.runtime.engine.backend import get_backend
    from eulergen.runtime.engine.ops import OpLibrary
    from eulergen.runtime.model.gpt import build
    from eulergen.runtime.model.optimizer_plan import update_ops
    from eulergen.runtime.train.optimizer import Optimizer

    t = cfg.training
    backend = get_backend(t.device)
    used = _device_used(backend)
    lib = OpLibrary(backend)
    ops = update_ops(lib, t.optimizer)
    model = build(cfg.model, lib, t.batch_size, t.seq_len, tf32=True,
                  dtype="bf16" if t.dtype == "bf16" else "float32", precision=t.precision,
                  recompute=t.recompute, optimizer=ops)
    model.init_weights(0)
    model.set_accumulation(1)
    optim = Optimizer(model, ops, t)
    _, one_step = eulergen_stepper(model, optim, t, cuda_graph)
    x, y = _tokens(cfg)
    loss = []
    sync = backend.xp.cuda.get_current_stream().synchronize if backend.is_gpu else lambda: None
    first, medians = timed_steps(lambda: loss.append(one_step(x, y)), sync, warmup, steps,
                                 repeats)
    result = dict(first_s=first, medians=medians, plan=model.mem.plan.total_bytes, loss=loss[-1])
    if backend.is_gpu:
        pool = backend.xp.get_default_memory_pool()
        result.update(peak=pool.total_bytes(), device=_device_used(backend) - used,
                      device_name=backend.device)
    return result


def _device_used(backend) -> int:
    """Bytes in use on the GPU, by anyone: what the driver reports, beyond CuPy's pool (the
    cuBLAS workspace, loaded kernel modules); 0 on numpy."""
    if not backend.is_gpu:
        return 0
    free, total = backend.xp.cuda.runtime.memGetInfo()
    return total - free


def run_torch(cfg, mode: str, sdpa: str, warmup: int, steps: int, repeats: int) -> dict:
    import torch

    grouped = cfg.model.num_kv_heads != cfg.model.num_heads
    model, optim = torch_model(cfg, repeat_kv=True if sdpa == "cudnn" and grouped else None)
    forward = compiled(model, mode)
    device = torch_device(cfg)
    x, y = (torch.as_tensor(a, device=device) for a in _tokens(cfg))
    gpu = device == "cuda"
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    loss = []
    with sdpa_backend(sdpa):
        first, medians = timed_steps(
            lambda: loss.append(torch_step(forward, model, optim, x, y, cfg.training).item()),
            sync, warmup, steps, repeats)
    result = dict(first_s=first, medians=medians, loss=loss[-1], threads=torch.get_num_threads())
    if gpu:
        result.update(peak=torch.cuda.max_memory_allocated(),
                      device_name=torch.cuda.get_device_name())
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--system", choices=("eulergen", "eulergen-eager", "torch"), required=True)
    ap.add_argument("--mode", choices=MODES, default="default", help="torch: eager or a compile mode")
    ap.add_argument("--sdpa", choices=SDPA, default="auto", help="torch: SDPA's backend")
    ap.add_argument("--preset", default="gpt2")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    metavar="SECTION.KEY=VALUE", help="config overrides (a smaller model, numpy)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--result", required=True, help="JSON lines file the record is added to")
    args = ap.parse_args()
    cfg = config(args.preset, args.batch, args.seq, args.dtype, *args.overrides)
    if args.system == "torch":
        r = run_torch(cfg, args.mode, args.sdpa, args.warmup, args.steps, args.repeats)
    else:
        r = run_eulergen(cfg, args.warmup, args.steps, args.repeats,
                         cuda_graph=args.system == "eulergen")
    seconds = statistics.median(r["medians"])
    r.update(seconds=seconds, tokens_per_s=args.batch * args.seq / seconds,
             mfu=_mfu(cfg, seconds, r.get("device_name")))
    emit(args.result, r)


if __name__ == "__main__":
    main()
