"""`eulergen prepare` throughput on local text: its worker processes against a plain
single-process loop (read a document, encode it, append EOT and ids, write each full
shard with data.write_shard) with the same tokenizer, in the same run, on this machine.

    python benchmarks/prepare.py                 # 200 MB of text, 2 workers
    python benchmarks/prepare.py --mb 50 --workers 4

The text is the Python standard library's .py files, repeated until it reaches --mb, as a
.jsonl file of one document a line (the FineWeb layout). The tokenizer is GPT-2's BPE when
tiktoken can load it, else a byte-level BPE of --vocab-size ids trained on the first 20 MB
by `eulergen tokenizer train`'s function; the report says which. Both paths run with
TOKENIZERS_PARALLELISM=false, so every process tokenizes on one thread.

The machine is shared: before each prepare run the script measures its parallel ceiling
(two pure-Python processes against one doing the same work in turn), which bounds what
prepare's ratio can show at that moment; on an idle 2-core machine it is about 2.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from common import say  # noqa: E402
from eulergen.errors import EulerError  # noqa: E402
from eulergen.runtime.data.loader import write_shard  # noqa: E402
from eulergen.runtime.data.prepare import Settings, prepare  # noqa: E402
from eulergen.runtime.data.sources import LocalFiles  # noqa: E402
from eulergen.runtime.data.tokenizer import TiktokenTokenizer, train_bpe  # noqa: E402

SHARD_TOKENS = 10_000_000     # several shards in a few hundred MB, as a real run writes them
VAL_TOKENS = 1_000_000


def _cpu() -> tuple[float, float]:
    """CPU seconds of this process, and of its finished children (prepare's workers)."""
    return time.process_time(), resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime \
        + resource.getrusage(resource.RUSAGE_CHILDREN).ru_stime


def _spin(n: int) -> int:
    total = 0
    for i in range(n):
        total += i * i
    return total


def parallel_ceiling(workers: int, n: int = 10_000_000) -> float:
    """How much faster `workers` processes finish `workers` equal CPU-bound jobs than one
    process does them in turn, right now: what the machine (and whatever else runs on it)
    leaves for prepare's ratio to reach."""
    import multiprocessing
    start = time.perf_counter()
    for _ in range(workers):
        _spin(n)
    serial = time.perf_counter() - start
    with multiprocessing.Pool(workers) as pool:
        start = time.perf_counter()
        pool.map(_spin, [n] * workers)
        parallel = time.perf_counter() - start
    return serial / parallel


def make_text(path: Path, megabytes: int) -> int:
    """A .jsonl of stdlib files (one a line) repeated to `megabytes`; returns its bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    lines = [json.dumps({"text": p.read_text(encoding="utf-8", errors="replace")}) + "\n"
             for p in files]
    written = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < megabytes * 1_000_000:
            for line in lines:
                f.write(line)
                written += len(line.encode("utf-8"))
                if written >= megabytes * 1_000_000:
                    break
    return written


def tokenizer_for(text: Path, vocab: int, folder: Path):
    try:
        return TiktokenTokenizer("gpt2"), "GPT-2 BPE (tiktoken)"
    except EulerError as err:
        say(f"GPT-2 BPE unavailable ({str(err)[:90]}…); training a byte-level BPE")
    sample = []
    with open(text, encoding="utf-8") as f:
        size = 0
        for line in f:
            sample.append(json.loads(line)["text"])
            size += len(line)
            if size > 20_000_000:
                break
    tok = train_bpe(sample, vocab, folder / "bpe.json")
    return tok, f"byte-level BPE, {vocab} ids (HF tokenizers, trained here)"


def plain_loop(text: Path, out: Path, tok) -> int:
    """What a first prepare script does: one process, encode, append, write full shards."""
    out.mkdir()
    buffer: list[int] = []
    shards, total = 0, 0

    def flush(tokens: list[int]) -> None:
        nonlocal shards
        write_shard(out / f"plain_{shards:06d}.bin", np.array(tokens, dtype=np.uint16))
        shards += 1

    cap = VAL_TOKENS
    with open(text, encoding="utf-8") as f:
        for line in f:
            text = json.loads(line)["text"]
            if not text:
                continue             # as prepare does: an empty document adds no EOT
            buffer.append(tok.eot)
            buffer.extend(tok.encode(text))
            while len(buffer) >= cap:
                flush(buffer[:cap])
                total += cap
                buffer = buffer[cap:]
                cap = SHARD_TOKENS
    if buffer:
        flush(buffer)
        total += len(buffer)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=200, help="megabytes of text")
    ap.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=2, help="runs of each; the fastest counts")
    args = ap.parse_args()
    if args.mb < 10:   # ~4 MB of this text is the 1M-token validation shard alone
        ap.error("--mb: at least 10, so that training shards follow the validation shard")
    load = os.getloadavg()   # other work on the machine takes cores from the workers
    with tempfile.TemporaryDirectory(prefix="eulergen-prepare-bench-") as tmp:
        folder = Path(tmp)
        text = folder / "text.jsonl"
        size = make_text(text, args.mb)
        say(f"text: {size / 1e6:.0f} MB in {text}")
        tok, which = tokenizer_for(text, args.vocab_size, folder)

        plain_s, prep_s, ceilings, cpu = [], [], [], {}
        for i in range(args.repeat):   # alternated, so a load change on the machine hits both
            start, clock = time.perf_counter(), _cpu()
            plain_tokens = plain_loop(text, folder / f"plain{i}", tok)
            plain_s.append(time.perf_counter() - start)
            cpu["plain"] = _cpu()[0] - clock[0]
            say(f"plain loop: {plain_tokens:,} tokens in {plain_s[-1]:.1f} s")
            ceilings.append(parallel_ceiling(args.workers))
            start, clock = time.perf_counter(), _cpu()
            state = prepare(LocalFiles([str(text)]), folder / f"prepared{i}", tok,
                            Settings(SHARD_TOKENS, VAL_TOKENS, name="d"), workers=args.workers)
            prep_s.append(time.perf_counter() - start)
            cpu["main"], cpu["workers"] = (b - a for a, b in zip(clock, _cpu()))
            say(f"prepare: {state.tokens:,} tokens in {prep_s[-1]:.1f} s "
                f"(ratio {plain_s[-1] / prep_s[-1]:.2f}x; the machine's parallel ceiling just "
                f"before: {ceilings[-1]:.2f}x)")
            assert state.tokens == plain_tokens, (state.tokens, plain_tokens)
        same = all((folder / "plain0" / f"plain_{i:06d}.bin").read_bytes()
                   == (folder / "prepared0" / s.file).read_bytes() for i, s in enumerate(state.shards))
        plain_times, prep_times = plain_s, prep_s
        plain_s, prep_s = min(plain_s), min(prep_s)

    plain_rate, prep_rate = plain_tokens / plain_s, state.tokens / prep_s
    print(f"tokenizer: {which}")
    print(f"text: {size / 1e6:.0f} MB of .jsonl, {plain_tokens:,} tokens, "
          f"{len(state.shards)} shards; {len(os.sched_getaffinity(0))} cores")
    print(f"load average before: {load[0]:.2f}; best of {args.repeat} runs each")
    print(f"plain single-process loop: {plain_rate / 1e6:.2f} M tokens/s ({plain_s:.1f} s)")
    print(f"eulergen prepare, {args.workers} workers: {prep_rate / 1e6:.2f} M tokens/s "
          f"({prep_s:.1f} s), shards byte-identical to the loop's: {same}")
    print(f"CPU seconds (last run): plain loop {cpu['plain']:.1f}; prepare's main process "
          f"{cpu['main']:.1f} + workers {cpu['workers']:.1f}; load average after: "
          f"{os.getloadavg()[0]:.2f}")
    print(f"ratio: {prep_rate / plain_rate:.2f}x (target >= 1.8x on 2 cores); pairs: "
          + ", ".join(f"{a / b:.2f}x" for a, b in zip(plain_times, prep_times)))
    print("parallel ceiling of the machine (two pure-Python processes vs one, measured before "
          "each prepare run): " + ", ".join(f"{c:.2f}x" for c in ceilings))


if __name__ == "__main__":
    main()
