"""Seconds from `eulergen train` to the end of its first step (issue 23's start-up target:
≤ 5 s on a GPU with the other kernels cached and one op just edited, ≤ 15 s from a cold
cache). Each measurement is a fresh process, timed from its launch.

    python benchmarks/startup.py                      # warm cache, as a second run finds it
    python benchmarks/startup.py --edit               # one op's YAML just edited, then as it is
    python benchmarks/startup.py --cold               # a fresh install: empty $EULERGEN_CACHE
    python benchmarks/startup.py --device numpy --repeat 3

--edit copies ops/gelu.yaml into a folder of its own with one constant changed (a new value
each time, so it is always stale) and trains with `--ops DIR --set model.activation=<it>`:
the generator derives it and the runtime compiles its kernels, every other op comes from
the caches; then the same command again, the op unchanged (its build and kernels cached:
no sympy, no NVRTC), each line its own time. --cold points EULERGEN_CACHE at a new empty
folder (kernels, tokenized data).
"""
from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eulergen import OPS_DIR

MARK = "eulergen-startup: first step done"
# The child: `eulergen train`, with a print when the first train_step has finished.
CHILD = f"""
import sys
from eulergen.runtime.train import trainer as train
step = train.Trainer.train_step
def first(self):
    out = step(self)
    self.lib.backend.synchronize()
    if not getattr(self, "_startup_said", False):
        self._startup_said = True
        print({MARK!r}, file=sys.stderr, flush=True)
    return out
train.Trainer.train_step = first
from eulergen.cli import main
profile, sys.argv = sys.argv[1], ["eulergen", "train", *sys.argv[2:]]
if profile != "-":    # --profile: the whole command under cProfile, saved there
    import cProfile
    cProfile.run("main(standalone_mode=False)", profile)
else:
    main()
"""


def measure(args: list[str], env: dict, stats: Path | None = None) -> float:
    """Seconds to the child's first step; `stats`: where its cProfile stats go (None: none)."""
    started = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(stats or "-"), *args], env=env,
                             text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    seconds, tail = None, []
    for line in child.stderr:
        if seconds is None and MARK in line:
            seconds = time.perf_counter() - started
        tail = (tail + [line])[-5:]
    if child.wait() != 0 or seconds is None:
        sys.exit("eulergen train failed:\n" + "".join(tail))
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "numpy"])
    ap.add_argument("--edit", action="store_true", help="train on a just-edited copy of gelu")
    ap.add_argument("--cold", action="store_true", help="an empty EULERGEN_CACHE")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--profile", metavar="DIR", help="run each child under cProfile and print "
                    "its 40 largest cumulative times (stats saved in DIR)")
    opts = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="eulergen-startup-"))
    for n in range(opts.repeat):
        env = dict(os.environ)
        args = ["--device", opts.device, "--run-dir", str(work / f"run{n}"),
                "--set", "training.total_steps=1", "--set", "training.warmup_steps=1",
                "--set", "training.eval_every=0", "--set", "training.sample_tokens=0"]
        if opts.cold:
            env["EULERGEN_CACHE"] = str(work / f"cache{n}")
        if opts.edit:
            ops = work / f"ops{n}"
            ops.mkdir()
            text = (OPS_DIR / "gelu.yaml").read_text().replace("name: gelu", "name: gelu_edit")
            text = text.replace("0.044715", f"0.0447{random.randrange(10**6):06d}")
            (ops / "gelu_edit.yaml").write_text(text)
            args += ["--ops", str(ops), "--set", "model.activation=gelu_edit"]
        what = ", ".join(w for w, on in (("cold cache", opts.cold), ("edited op", opts.edit)) if on)
        _report(f"{opts.device}{', ' + what if what else ', warm cache'}", args, env, opts,
                f"run{n}")
        if opts.edit:   # the same op again, as a second run finds it
            args[args.index("--run-dir") + 1] = str(work / f"run{n}-again")
            _report(f"{opts.device}, the same op unchanged", args, env, opts, f"run{n}-again")


def _report(label: str, args: list[str], env: dict, opts, name: str) -> None:
    """One measured start, printed; with --profile, its stats saved as <name>.prof and their
    40 largest cumulative times printed (they include the run after its first step)."""
    stats = None
    if opts.profile:
        Path(opts.profile).mkdir(parents=True, exist_ok=True)
        stats = Path(opts.profile) / f"{name}.prof"
    print(f"{label}: first step done after {measure(args, env, stats):.2f} s", flush=True)
    if stats is not None:
        import pstats
        pstats.Stats(str(stats)).sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()
