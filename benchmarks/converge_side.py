"""One side of benchmarks/converge.py, trained in this process; a JSON record to --result
at every evaluation and one at the end.

Sides: `eulergen-bf16`, `eulergen-autocast` (bf16 with training.precision=autocast: the
residual stream, its gradient, the norms' weights and the gradients in fp32, as autocast
keeps them) and `eulergen-fp32` (TF32 GEMMs) are the trainer itself
(runtime/train/trainer.py, its evaluation timed out of the training time), initialised from
training.seed; `torch-s0` and `torch-s1` are TorchGPT (benchmarks/torch_gpt.py) under bf16
autocast and torch.compile(dynamic=False), initialised with eulergen's init of training.seed
and of training.seed + 1 (the same weights as the eulergen sides, then another draw: the
run-to-run spread). Every side reads its batches from eulergen's loader with the same seed
(make_loaders), so all see the same tokens in the same order, and evaluates the same first
`eval_steps` batches of the validation shard. Same hyper-parameters: AdamW (0.9, 0.95,
eps 1e-8, weight decay 0.1 on matrices), the trainer's warmup + cosine schedule to lr/10,
global-norm clipping at 1.0, no spike guard. Torch is never synchronised between
evaluations (its loss stays on the GPU), as the trainer reads its losses a step late.

`train_s` at an evaluation is the wall time since the first step was launched, less the
evaluations before it: the first step's compiling (torch.compile, eulergen's kernels and
graph capture) counts, as it does for whoever trains.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from isolated import emit  # noqa: E402

# an eulergen side's precision; the torch sides train under bf16 autocast
PRECISION = {"eulergen-bf16": ["training.dtype=bf16", "training.precision=bf16"],
             "eulergen-autocast": ["training.dtype=bf16", "training.precision=autocast"],
             "eulergen-fp32": ["training.dtype=fp32"]}
SIDES = ("eulergen-bf16", "torch-s0", "torch-s1", "eulergen-fp32", "eulergen-autocast")


def side_config(args, run_dir: str):
    from eulergen.runtime.train.config import load_config
    return load_config(None, [
        f"model.preset={args.preset}", f"model.vocab_size={args.vocab}",
        f"training.batch_size={args.batch}", f"training.seq_len={args.seq}",
        f"training.total_steps={args.steps}", f"training.warmup_steps={args.warmup}",
        "training.learning_rate=6e-4", "training.min_lr=6e-5", "training.schedule=cosine",
        "training.weight_decay=0.1", "training.beta1=0.9", "training.beta2=0.95",
        "training.adam_eps=1e-8", "training.grad_clip=1.0", "training.spike_factor=0",
        f"training.eval_every={args.eval_every}", f"training.eval_steps={args.eval_steps}",
        f"training.log_every={args.eval_every}", "training.checkpoint_every=0",
        "training.keep_checkpoints=1", "training.sample_tokens=0", f"training.seed={args.seed}",
        *PRECISION.get(args.side, ["training.dtype=bf16"]), "training.tf32=true",
        f"training.device={args.device}",
        f"data.dataset={args.data}/stdlib_train_*.bin", f"data.val_dataset={args.data}/stdlib_val_*.bin",
        f"data.tokenizer={args.tokenizer}", f"run_dir={run_dir}", *args.overrides])


def run_eulergen(args, cfg, record) -> dict:
    from eulergen.runtime.engine.backend import get_backend
    from eulergen.runtime.engine.ops import OpLibrary
    from eulergen.runtime.train.metrics import read_metrics
    from eulergen.runtime.train.trainer import Trainer

    class Timed(Trainer):
        """The trainer, its evaluations timed out of the training time and recorded."""

        def run(self, stop_after=None):
            self.t0, self.eval_s = time.perf_counter(), 0.0
            return super().run(stop_after)

        def evaluate(self):
            start = time.perf_counter()
            val = super().evaluate()
            record(step=self.step, val_loss=val, train_loss=self.result.losses[self.step],
                   train_s=start - self.t0 - self.eval_s)
            self.eval_s += time.perf_counter() - start
            return val

    trainer = Timed(cfg, OpLibrary(get_backend(cfg.training.device)), progress=False,
                    tensorboard=False)
    trainer.run()
    first = next(r for r in read_metrics(cfg.run_dir) if r["step"] == 1)
    return {"first_s": first["ms_per_step"] / 1e3}


def eulergen_init(cfg, seed: int) -> dict:
    """eulergen's initial weights for `seed` (drawn on the host: the same on every backend)."""
    from eulergen.runtime.engine.backend import NUMPY
    from eulergen.runtime.engine.ops import OpLibrary
    from eulergen.runtime.model.gpt import build
    model = build(cfg.model, OpLibrary(NUMPY), 1, 1, training=False)
    model.init_weights(seed)
    return model.state_dict()


def run_torch(args, cfg, record) -> dict:
    import torch

    from eulergen.runtime.data.loader import make_loaders
    from eulergen.runtime.train.trainer import learning_rate
    from measure import compiled, torch_device, torch_model, torch_step

    t = cfg.training
    seed = t.seed + (1 if args.side == "torch-s1" else 0)
    model, optim = torch_model(cfg, eulergen_init(cfg, seed))
    forward = compiled(model, args.torch_mode)
    train, val = make_loaders(cfg)
    device = torch_device(cfg)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def batch(loader):
        x, y = loader.next_batch()
        pin = device == "cuda"
        return [torch.from_numpy(a).pin_memory().to(device, non_blocking=True) if pin
                else torch.from_numpy(a) for a in (x, y)]

    def evaluate() -> float:
        val.reset()
        with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):
            return float(torch.stack([model(*batch(val))[1] for _ in range(t.eval_steps)])
                         .double().mean())

    start, eval_s, first = time.perf_counter(), 0.0, None
    for step in range(1, t.total_steps + 1):
        for group in optim.param_groups:
            group["lr"] = learning_rate(t, step)
        loss = torch_step(forward, model, optim, *batch(train), t)
        if step == 1:
            sync()
            first = time.perf_counter() - start
        if step % t.eval_every == 0 or step == t.total_steps:
            sync()
            at = time.perf_counter()
            record(step=step, val_loss=evaluate(), train_loss=loss.item(),
                   train_s=at - start - eval_s)
            eval_s += time.perf_counter() - at
    return {"first_s": first}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--side", choices=SIDES, required=True)
    ap.add_argument("--preset", required=True)
    ap.add_argument("--data", required=True, help="the prepared folder (llm.c shards)")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--warmup", type=int, required=True)
    ap.add_argument("--eval-every", type=int, required=True)
    ap.add_argument("--eval-steps", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--device", choices=("cuda", "numpy"), default="cuda")
    ap.add_argument("--torch-mode", default="default")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--result", required=True)
    args = ap.parse_args()
    run_dir = tempfile.mkdtemp(prefix=f"converge-{args.side}-")
    os.rmdir(run_dir)   # the trainer makes it, and marks it as its own
    tag = {"preset": args.preset, "side": args.side}
    try:
        cfg = side_config(args, run_dir)
        run = run_torch if args.side.startswith("torch") else run_eulergen
        end = run(args, cfg, lambda **r: emit(args.result, {**tag, **r}))
        emit(args.result, {**tag, "done": True, **end})
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)   # its checkpoint: GBs at 124M


if __name__ == "__main__":
    main()
