"""Training on real text side by side: eulergen bf16 in its default precision
(eulergen-autocast, training.precision=autocast: what autocast keeps in fp32, eulergen does),
eulergen bf16 with llm.c's bf16 storage (eulergen-bf16, training.precision=bf16), eulergen fp32
(TF32 GEMMs) as the reference, and PyTorch bf16 autocast + torch.compile from two
initialisations, each side in its own process (benchmarks/converge_side.py), the same
tokens, weights and hyper-parameters; val loss at every evaluation and the wall time each
side takes to reach PyTorch's final val loss.

    python benchmarks/converge.py --preset gpt2 --out $OUT        # one preset, five sides
    python benchmarks/converge.py --preset nanoeuler --sides eulergen-bf16,torch-s0
    python benchmarks/converge.py --sides eulergen-autocast --out $OUT   # one side more, then
    python benchmarks/converge.py --report saved/converge.jsonl $OUT/converge.jsonl   # both
    python benchmarks/converge.py --dry-run                        # tiny, numpy and CPU torch

Data: the running Python's standard library (`builtin:stdlib`'s files,
runtime/data/loader.py: every 10th file held out), written as two .jsonl files, a
byte-level BPE of --vocab ids trained on the training files by `eulergen tokenizer train`,
and both tokenized into llm.c shards by `eulergen prepare` (the held-out files first: the
first --val-tokens are the validation shard, the rest train). All of it is cached under
--cache, so a second run (or a warm machine) starts training at once.

Estimates on one H200 at 124M, 2000 steps of 8x1024 (each side adds ~10-20 s of start-up,
its evaluations and, for the trainer, its final checkpoint): eulergen bf16 storage ~18.7
ms/step (~40 s), autocast precision 19.5 ms/step, torch.compile ~21 ms/step and ~25 s to compile (~70 s, twice), eulergen fp32/TF32
~45-55 ms/step (~110 s); the BPE and prepare ~40 s on 16 cores once: one preset with all
sides ~7 minutes, within --deadline (a side still running at the deadline is stopped and
reported; the table is printed with what there is).

Targets (issue 31): eulergen bf16's (and autocast's) val loss within the two PyTorch seeds'
spread, or 0.5% of torch-s0's if wider, at every evaluation after the first 10% of the run;
eulergen bf16 reaching torch-s0's final val loss at least 1.25x sooner.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import say  # noqa: E402
from converge_side import SIDES  # noqa: E402
from isolated import Deadline, emit, read_records, run_child  # noqa: E402

TINY = dict(files=120, vocab=512, steps=20, warmup=2, eval_every=10, eval_steps=2, batch=2,
            seq=64, val_tokens=20_000,
            overrides=["model.num_layers=2", "model.hidden_dim=64", "model.num_heads=2",
                       "model.max_seq_len=64"])


def write_corpus(folder: Path, files: int | None) -> tuple[Path, Path]:
    """The stdlib's .py files as val.jsonl (every 10th) and train.jsonl (the rest), one
    document a line; files that are not UTF-8 (a few test fixtures) are left out."""
    from eulergen.runtime.data.loader import STDLIB_VAL_EVERY, stdlib_files
    val, train = folder / "val.jsonl", folder / "train.jsonl"
    if val.is_file() and train.is_file():
        return val, train
    with open(val, "w", encoding="utf-8") as v, open(train, "w", encoding="utf-8") as t:
        for i, path in enumerate(stdlib_files()[:files], 1):
            try:
                text = path.read_bytes().decode("utf-8")
            except UnicodeDecodeError:
                continue
            (v if i % STDLIB_VAL_EVERY == 0 else t).write(json.dumps({"text": text}) + "\n")
    return val, train


def _eulergen(*argv: str) -> float:
    """Run an eulergen command as a user would; its seconds."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "eulergen", *argv], check=True)
    return time.perf_counter() - start


def prepare_data(cache: Path, files: int | None, vocab: int, val_tokens: int) -> tuple[Path, Path]:
    """(the tokenizer, the prepared folder), made once under `cache`."""
    from eulergen.runtime.data.loader import stdlib_files
    n = len(stdlib_files()[:files])
    folder = cache / f"stdlib-py{sys.version.split()[0]}-{n}files-bpe{vocab}"
    folder.mkdir(parents=True, exist_ok=True)
    val, train = write_corpus(folder, files)
    tok, data = folder / "tokenizer.json", folder / "data"
    if not tok.is_file():
        say(f"converge: BPE of {vocab} ids on {train.stat().st_size / 1e6:.1f} MB, "
            f"trained in {_eulergen('tokenizer', 'train', str(train), '--vocab-size', str(vocab), '--out', str(tok)):.1f} s")
    if not (data / "prepare.json").is_file() or not json.loads(
            (data / "prepare.json").read_text()).get("done"):
        seconds = _eulergen("prepare", str(val), str(train), "--tokenizer", str(tok), "--out",
                            str(data), "--val-tokens", str(val_tokens), "--name", "stdlib",
                            "--quiet")
        say(f"converge: prepared in {seconds:.1f} s")
    return tok, data


def time_to(records: list[dict], target: float) -> float | None:
    """The training seconds at the first evaluation at or below `target`."""
    return next((r["train_s"] for r in records if r["val_loss"] <= target), None)


# the sides the target is about: each gets a column of its distance to torch-s0 and verdict
JUDGED = {"eulergen-bf16": "bf16", "eulergen-autocast": "autocast"}


def report(records: list[dict]) -> None:
    """Per preset: val loss at every evaluation by side, the spread and the target's
    verdict for each judged side; then each side's final loss, speed and time to
    torch-s0's final val loss."""
    for preset in dict.fromkeys(r["preset"] for r in records):
        mine = [r for r in records if r["preset"] == preset]
        evals = {s: [r for r in mine if r["side"] == s and "val_loss" in r] for s in SIDES}
        ends = {r["side"]: r for r in mine if "done" in r or "error" in r}
        sides = [s for s in SIDES if evals[s] or s in ends]
        judged = [s for s in JUDGED if evals[s]]
        width = {s: max(14, len(s)) for s in sides}
        print(f"converge: {preset}, val loss at each evaluation")
        head = f"{'step':>6} " + " ".join(f"{s:>{width[s]}}" for s in sides) + \
            f" {'seed spread':>12}" + \
            "".join(f" {JUDGED[s] + ' - s0':>13} {'within':>7}" for s in judged)
        print(head)
        print("-" * len(head))
        steps = sorted({r["step"] for s in sides for r in evals[s]})
        at = {s: {r["step"]: r["val_loss"] for r in evals[s]} for s in sides}
        for step in steps:
            cells = " ".join(f"{at[s][step]:{width[s]}.4f}" if step in at[s]
                             else f"{'-':>{width[s]}}" for s in sides)
            s0, s1 = (at.get(s, {}).get(step) for s in ("torch-s0", "torch-s1"))
            spread = abs(s0 - s1) if s0 is not None and s1 is not None else None
            verdicts = ""
            for side in judged:
                ours = at[side].get(step)
                if s0 is None or ours is None:
                    verdicts += f" {'-':>13} {'-':>7}"
                    continue
                allowed = max(spread or 0.0, 0.005 * s0)
                verdict = ("yes" if abs(ours - s0) <= allowed else "NO") \
                    if step > 0.1 * steps[-1] else "(warm)"
                verdicts += f" {ours - s0:+13.4f} {verdict:>7}"
            print(f"{step:6d} {cells} " +
                  (f"{spread:12.4f}" if spread is not None else f"{'-':>12}") + verdicts)
        target = evals["torch-s0"][-1]["val_loss"] if evals["torch-s0"] else None
        ref = time_to(evals["torch-s0"], target) if target is not None else None
        print(f"\n{'side':<17} {'final val':>9} {'ms/step':>8} {'first step s':>12} "
              f"{'train s':>8} {'to torch-s0 final':>17} {'vs torch-s0':>11}")
        for s in sides:
            if s in ends and "error" in ends[s]:
                print(f"{s:<17} failed: {ends[s]['error']}")
            if not evals[s]:
                continue
            e, end = evals[s], ends.get(s, {})
            ms = 1e3 * (e[-1]["train_s"] - e[0]["train_s"]) / max(1, e[-1]["step"] - e[0]["step"])
            reach = time_to(e, target) if target is not None else None
            first = f"{end['first_s']:12.1f}" if end.get("first_s") else f"{'-':>12}"
            print(f"{s:<17} {e[-1]['val_loss']:9.4f} {ms:8.1f} {first} {e[-1]['train_s']:8.1f} "
                  + (f"{reach:17.1f}" if reach is not None else f"{'not reached':>17}")
                  + (f" {ref / reach:11.2f}" if reach and ref else f" {'-':>11}"))
        print("targets: bf16 (and autocast) within the seed spread (or 0.5%) after the first 10% "
              "of the run; bf16 reaches torch-s0's final val loss >= 1.25x sooner\n", flush=True)


def main() -> None:
    import eulergen
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt2", help="presets, comma-separated (gpt2, nanoeuler)")
    ap.add_argument("--sides", default=",".join(SIDES))
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--warmup", type=int, help="warmup steps [default: 5%% of --steps]")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-steps", type=int, default=32, help="validation batches an evaluation")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=1337, help="data order, and torch-s0's init")
    ap.add_argument("--vocab", type=int, default=50257, help="the BPE's ids")
    ap.add_argument("--files", type=int, help="only the first N stdlib files [default: all]")
    ap.add_argument("--val-tokens", type=int, default=512_000)
    ap.add_argument("--torch-mode", default="default", help="torch.compile's mode")
    ap.add_argument("--cache", type=Path, default=Path(eulergen.cache_dir()) / "converge")
    ap.add_argument("--out", type=Path, default=Path("converge-out"),
                    help="converge.jsonl goes here (every record of every side)")
    ap.add_argument("--side-timeout", type=float, default=300)
    ap.add_argument("--deadline", type=float, default=560, help="seconds for the whole run")
    ap.add_argument("--dry-run", action="store_true", help="a tiny model and corpus on numpy "
                    "and CPU torch (bf16 is refused there: that side's failure is reported)")
    ap.add_argument("--report", nargs="+", type=Path, help="print the table of saved runs only")
    args = ap.parse_args()
    if args.report:
        report([r for path in args.report for r in read_records(str(path))])
        return
    overrides = []
    if args.dry_run:
        vars(args).update({k: v for k, v in TINY.items() if k != "overrides"})
        overrides = TINY["overrides"]
    sides = args.sides.split(",")
    if set(sides) - set(SIDES):
        ap.error(f"unknown side in {args.sides} (sides: {', '.join(SIDES)})")
    deadline = Deadline(args.deadline)
    tok, data = prepare_data(args.cache, args.files, args.vocab, args.val_tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "converge.jsonl"
    records = []
    for preset in args.preset.split(","):
        for side in [s for s in SIDES if s in sides]:
            say(f"converge: {preset} {side}")
            argv = [sys.executable, str(Path(__file__).with_name("converge_side.py")),
                    "--side", side, "--preset", preset, "--data", str(data), "--tokenizer",
                    str(tok), "--vocab", str(args.vocab), "--steps", str(args.steps),
                    "--warmup", str(args.warmup or max(1, args.steps // 20)),
                    "--eval-every", str(args.eval_every), "--eval-steps", str(args.eval_steps),
                    "--batch", str(args.batch), "--seq", str(args.seq), "--seed", str(args.seed),
                    "--device", "numpy" if args.dry_run else "cuda",
                    "--torch-mode", args.torch_mode, *(f"--set={o}" for o in overrides)]
            out = run_child(argv, min(args.side_timeout, deadline.left() - 5))
            got = out.records + ([{"preset": preset, "side": side, "error": out.error}]
                                 if out.error else [])
            for r in got:
                emit(str(log), r)
            records += got
            say(f"converge: {preset} {side} " + (f"failed: {out.error}" if out.error else
                                                  f"done in {out.seconds:.0f} s"))
    report(records)


if __name__ == "__main__":
    main()
