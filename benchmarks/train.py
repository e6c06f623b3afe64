"""Training throughput, MFU and peak memory: eulergen against PyTorch's strongest
configuration (torch.compile, the best of its modes) and llm.c, in one run on one GPU.

    python benchmarks/train.py --dtype bf16 --batch 8,16          # 124M, all compile modes, llm.c
    python benchmarks/train.py --dtype bf16 --presets gpt2-medium,gpt2-large,gpt2-xl \\
        --modes default                                          # sizes, against one mode
    python benchmarks/train.py --dtype bf16 --presets nanoeuler,gpt2 --seq 4096,8192 \\
        --batch 2 --modes default --sdpa flash,cudnn             # long context
    python benchmarks/train.py --dtype bf16 --bf16-storage --modes default --llmc ''  # llm.c's recipe
    python benchmarks/train.py --dtype bf16 --presets gpt2-large,gpt2-xl --batch 16 \\
        --recompute --modes default --llmc ''                    # recompute's cost and saving
    python benchmarks/train.py --quick                            # few steps, torch eager only
    python benchmarks/train.py --dry-run                          # tiny, numpy and CPU torch
    python benchmarks/train.py --cpu                              # CPU default: numpy, CPU torch

Every configuration (preset, B, T, system) runs in a fresh process (benchmarks/measure.py,
through benchmarks/isolated.py): torch.compile(dynamic=False) after torch._dynamo.reset(),
no graph or allocator pool shared with another configuration (only inductor's on-disk
caches, which shorten a later configuration's compile, `first s`, not its steps), and a
failure is its row's reason while the rest go on; `--deadline` stops the run in time to
print its tables. Torch's modes (`--modes`): eager, default, reduce-overhead (CUDA graphs),
max-autotune-no-cudagraphs, max-autotune (CUDA graphs); each that ran is a row, each that
did not says why, and the fastest compile mode is the bar (torch eager where none ran).
llm.c's train_gpt2cu (benchmarks/llmc.py) is a second peer for gpt2 at T=1024 in bf16.

--cpu: `eulergen train`'s built-in CPU default (d 128, 3 layers, B=16, T=64, fp32, AdamW) on
numpy against torch eager on the CPU, the same model, each on 1 and on 2 threads (OpenBLAS's
threads, torch's intra-op threads); the bar is torch at the same threads. The machine's
1-minute load is printed before and after: on shared cores the figures move with it.

--dtype fp32: fp32 storage with TF32 GEMMs on both sides (eulergen: TF32 compute; torch:
allow_tf32). --dtype bf16: eulergen's training.dtype=bf16 in its default precision,
training.precision=autocast (bf16 activations and GEMM operands; what torch's autocast keeps
in fp32, the residual stream, its gradient, the norms' weights and the parameter gradients,
fp32 too; fp32 accumulation, master weights and AdamW moments) against torch's bf16 autocast
(fp32 parameters, residual stream and gradients, bf16 matmuls and SDPA) and llm.c's bf16 (bf16
weights, activations and gradients, fp32 master weights and moments); with --bf16-storage
also eulergen in training.precision=bf16 (llm.c's recipe: the stream and the gradients in
bf16 too), a row of its own; with --recompute also eulergen in training.recompute=blocks
(each block's forward run again in its backward: its tok/s cost, its peak and plan GiB the
saving; MFU counts the model's FLOPs, not the forwards run twice). How each is timed, and
how MFU counts attention: benchmarks/measure.py.
tok/s is B·T over the median of the repeats' median steps; `spread` the repeats' lowest
and highest tok/s. peak/plan: eulergen's pool against its plan (the target is within 5%);
dev/plan: the driver's bytes in use (the pool, the cuBLAS workspace, the kernel modules)
over the plan. llm.c's peak is its own driver-level figure, its CUDA context included.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import llmc  # noqa: E402
from common import say  # noqa: E402
from isolated import Deadline, emit, run_child  # noqa: E402
from measure import CPU_DEFAULT, MODES, SDPA, _mfu, config  # noqa: E402

PRESETS = ("gpt2", "nanoeuler")
COMPILE_MODES = MODES[1:]
# --dry-run: the same configurations at a size numpy and CPU torch run in seconds
TINY = ("training.device=numpy", "model.num_layers=2", "model.hidden_dim=64", "model.num_heads=1",
        "model.num_kv_heads=1", "model.vocab_size=256", "model.max_seq_len=32")


def systems(args, preset: str, seq: int) -> list[tuple[str, list[str]]]:
    """(row name, measure.py arguments) of every system a row group runs."""
    rows = [("eulergen", ["--system", "eulergen"])]
    if args.bf16_storage:
        rows.append(("eulergen bf16 storage", ["--system", "eulergen",
                                               "--set=training.precision=bf16"]))
    if args.recompute:
        rows.append(("eulergen recompute", ["--system", "eulergen",
                                            "--set=training.recompute=blocks"]))
    if args.eager:
        rows.append(("eulergen eager", ["--system", "eulergen-eager"]))
    for mode in args.modes.split(","):
        for sdpa in args.sdpa.split(","):
            name = "torch eager" if mode == "eager" else f"torch.compile {mode}"
            rows.append((name if sdpa == "auto" else f"{name} [{sdpa}]",
                         ["--system", "torch", "--mode", mode, "--sdpa", sdpa]))
    if preset == "gpt2" and (seq == 1024 or args.dry_run) and args.dtype == "bf16" and args.llmc:
        rows.append(("llm.c", []))
    return rows


def build_llmc(args) -> Path | str:
    """llm.c's binary, built once a run, or why there is none (every llm.c row's reason)."""
    work = Path(args.llmc_work)
    work.mkdir(parents=True, exist_ok=True)
    try:
        binary = llmc.build(work, Path(args.llmc), dry_run=args.dry_run)
    except llmc.LlmcError as err:
        return str(err)
    return "dry run: the build's commands printed, nothing built or run" if args.dry_run \
        else binary


def run_llmc(args, binary: Path | str, batch: int, seq: int, deadline: Deadline) -> dict:
    if isinstance(binary, str):
        return {"error": binary}
    shards = llmc.random_shards(binary.parent, 16 * 1024 * 4)
    try:
        r = llmc.measure(binary, shards, batch, seq, args.warmup, args.steps, args.repeats,
                         min(args.timeout, deadline.left() - 5))
    except llmc.LlmcError as err:
        return {"error": str(err)}
    return dict(r, mfu=_mfu(config("gpt2", batch, seq, "bf16"), r["seconds"], r["device_name"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--batch", default="8", help="batch sizes, comma-separated (8,16)")
    ap.add_argument("--seq", default="1024", help="sequence lengths, comma-separated")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                    help="fp32 (TF32 GEMMs) or bf16 mixed precision on every side")
    ap.add_argument("--modes", help=f"torch modes, comma-separated, of {', '.join(MODES)} "
                    f"[default: {','.join(COMPILE_MODES)}; --quick: eager; --dry-run: eager,default]")
    ap.add_argument("--sdpa", default="auto", help=f"torch SDPA backends, of {', '.join(SDPA)}")
    ap.add_argument("--eager", action="store_true",
                    help="also eulergen without CUDA graphs (training.cuda_graph=false)")
    ap.add_argument("--bf16-storage", action="store_true",
                    help="also eulergen in training.precision=bf16 (with --dtype bf16)")
    ap.add_argument("--recompute", action="store_true",
                    help="also eulergen in training.recompute=blocks")
    ap.add_argument("--llmc", default=str(llmc.SOURCE), help="llm.c's source ('' for none)")
    ap.add_argument("--llmc-work", default=str(Path(tempfile.gettempdir()) / "eulergen-llmc"))
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20, help="timed steps a repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=420, help="seconds a configuration may take")
    ap.add_argument("--deadline", type=float, default=570, help="seconds the whole run may take")
    ap.add_argument("--quick", action="store_true", help="few steps, one repeat, torch eager only")
    ap.add_argument("--dry-run", action="store_true",
                    help="a tiny model on numpy and CPU torch, llm.c's build command only")
    ap.add_argument("--cpu", action="store_true",
                    help="the built-in CPU default on numpy against torch eager on the CPU")
    ap.add_argument("--out", type=Path, help="also write every row as JSON lines to OUT/train.jsonl")
    args = ap.parse_args()
    if args.cpu:
        cpu_rows(args, Deadline(args.deadline))
        return
    if args.quick or args.dry_run:
        args.warmup, args.steps, args.repeats = 1, 3, 2
    args.modes = args.modes or ("eager" if args.quick else "eager,default" if args.dry_run
                                else ",".join(COMPILE_MODES))
    unknown = set(args.modes.split(",")) - set(MODES) or set(args.sdpa.split(",")) - set(SDPA)
    if unknown:
        ap.error(f"unknown --modes or --sdpa value: {', '.join(sorted(unknown))}")
    if args.bf16_storage and args.dtype != "bf16":
        ap.error("--bf16-storage is a bf16 precision: give --dtype bf16 too")
    tiny = list(TINY) if args.dry_run else []
    presets = args.presets.split(",")
    seqs = [min(int(s), 32) if args.dry_run else int(s) for s in args.seq.split(",")]
    for preset in presets:   # a typo is one line now, not a failed row per configuration
        config(preset, 1, 1, args.dtype, *tiny)
    deadline = Deadline(args.deadline)
    binary = build_llmc(args) if any(name == "llm.c" for preset in presets for seq in seqs
                                     for name, _ in systems(args, preset, seq)) else ""
    for seq in seqs:
        for batch in (int(b) for b in args.batch.split(",")):
            rows = []
            for preset in presets:
                for name, extra in systems(args, preset, seq):
                    say(f"{preset} B={batch} T={seq}: {name}")
                    r = run_llmc(args, binary, batch, seq, deadline) if name == "llm.c" \
                        else _measure(args, preset, batch, seq, extra, tiny, deadline)
                    r.update(preset=preset, system=name, batch=batch, seq=seq, dtype=args.dtype)
                    _record(args, r)
                    if "seconds" in r:
                        say(f"{preset} B={batch} T={seq}: {name} {r['tokens_per_s']:,.0f} tok/s")
                    rows.append(r)
            _table(rows, batch, seq, args.dtype)


def cpu_rows(args, deadline: Deadline) -> None:
    """--cpu: eulergen numpy and torch eager on the CPU default, on 1 and on 2 threads."""
    from eulergen.runtime.train.config import load_config
    t = load_config(None).training
    load = os.getloadavg()[0]
    rows = []
    for threads in (1, 2):
        env = {**os.environ, "OPENBLAS_NUM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
        for name, extra in (("eulergen numpy", ["--system", "eulergen"]),
                            ("torch eager", ["--system", "torch", "--mode", "eager"])):
            say(f"CPU default B={t.batch_size} T={t.seq_len}: {name}, {threads} thread(s)")
            r = _measure(args, CPU_DEFAULT, t.batch_size, t.seq_len, extra, [], deadline, env,
                         dtype="fp32")
            r.update(system=name, threads=threads)
            _record(args, r)
            rows.append(r)
    print(f"training step, the built-in CPU default (B={t.batch_size} T={t.seq_len}, fp32, "
          f"AdamW); 1-minute load {load:.2f} before, {os.getloadavg()[0]:.2f} after; bar: torch "
          "eager at the same threads")
    head = (f"{'system':<16} {'threads':>7} {'tok/s':>8} {'spread':>13} {'ms/step':>8} "
            f"{'vs bar':>6} {'loss':>7}")
    print(head)
    print("-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['system']:<16} {r['threads']:>7} failed: {r['error']}")
            continue
        bar = next((b for b in rows if b["system"] == "torch eager" and "seconds" in b
                    and b["threads"] == r["threads"]), None)
        tps = [t.batch_size * t.seq_len / s for s in r["medians"]]
        vs = f"{bar['seconds'] / r['seconds']:6.2f}" if bar else f"{'-':>6}"
        print(f"{r['system']:<16} {r['threads']:>7} {r['tokens_per_s']:8,.0f} "
              f"{f'{min(tps):,.0f}-{max(tps):,.0f}':>13} {1e3 * r['seconds']:8.1f} {vs} "
              f"{r['loss']:7.3f}")
    print(flush=True)


def _record(args, r: dict) -> None:
    """A row, also as a JSON line of OUT/train.jsonl where --out is given."""
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        emit(str(args.out / "train.jsonl"), r)


def _measure(args, preset, batch, seq, extra, tiny, deadline: Deadline, env=None,
             dtype=None) -> dict:
    argv = [sys.executable, str(Path(__file__).with_name("measure.py")), *extra,
            "--preset", preset, "--batch", str(batch), "--seq", str(seq),
            "--dtype", dtype or args.dtype, "--warmup", str(args.warmup), "--steps",
            str(args.steps), "--repeats", str(args.repeats), *(f"--set={o}" for o in tiny)]
    out = run_child(argv, min(args.timeout, deadline.left() - 5), env)
    if out.error or not out.records:
        return {"error": out.error or "no result written"}
    return out.records[-1]


def baseline(rows: list[dict], preset: str) -> dict | None:
    """The bar of a preset's rows: its fastest torch.compile row, else torch eager."""
    ran = [r for r in rows if r["preset"] == preset and "seconds" in r]
    for prefix in ("torch.compile", "torch eager"):
        best = [r for r in ran if r["system"].startswith(prefix)]
        if best:
            return min(best, key=lambda r: r["seconds"])
    return None


def _table(rows: list[dict], batch: int, seq: int, dtype: str) -> None:
    gib = 1024 ** 3
    head = (f"{'preset':<16} {'system':<44} {'tok/s':>9} {'spread':>17} {'ms/step':>8} "
            f"{'MFU':>6} {'peak GiB':>8} {'plan GiB':>8} {'peak/plan':>9} {'dev/plan':>8} "
            f"{'first s':>7} {'vs bar':>6} {'mem vs bar':>10} {'loss':>7}")
    precision = ("bf16: eulergen training.precision=autocast (unless a row says bf16 storage), "
                 "torch autocast, llm.c bf16"
                 if dtype == "bf16" else "fp32 storage, TF32 GEMMs")
    print(f"training step, B={batch} T={seq}, {precision}; bar: each preset's fastest "
          "torch.compile mode")
    print(head)
    print("-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['preset']:<16} {r['system']:<44} failed: {r['error']}")
            continue
        bar = baseline(rows, r["preset"])
        tps = [batch * seq / s for s in r["medians"]]
        spread = f"{min(tps):,.0f}-{max(tps):,.0f}"
        plan = (f"{r['plan'] / gib:8.2f} {r['peak'] / r['plan']:9.3f} "
                f"{r['device'] / r['plan']:8.3f}" if "device" in r else
                f"{r['plan'] / gib:8.2f} {'-':>9} {'-':>8}" if "plan" in r else
                f"{'-':>8} {'-':>9} {'-':>8}")
        mfu = f"{100 * r['mfu']:5.1f}%" if r.get("mfu") else f"{'-':>6}"
        peak = f"{r['peak'] / gib:8.2f}" if r.get("peak") else f"{'-':>8}"
        vs = f"{bar['seconds'] / r['seconds']:6.2f}" if bar else f"{'-':>6}"
        mem = f"{r['peak'] / bar['peak']:10.2f}" if bar and r.get("peak") and bar.get("peak") \
            else f"{'-':>10}"
        print(f"{r['preset']:<16} {r['system']:<44} {r['tokens_per_s']:9,.0f} {spread:>17} "
              f"{1e3 * r['seconds']:8.1f} {mfu} {peak} {plan} {r['first_s']:7.1f} {vs} {mem} "
              f"{r['loss']:7.3f}")
    print("targets: eulergen vs bar >= 1.25 (goal 1.5), mem vs bar <= 1.00, peak/plan <= 1.05; "
          "ahead of llm.c")
    print(flush=True)


if __name__ == "__main__":
    main()
