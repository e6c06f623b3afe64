"""The path from `eulergen train` to its first step holds nothing slow that the run does not
need: no torch, transformers or matplotlib imported by then (tensorboardX would import
torch: runtime/train/metrics.py keeps it out), no sympy where every op is built (only a
spec that changed is derived), and TensorBoard events are written all the same."""
from __future__ import annotations

import json
import os
import subprocess
import sys

HEAVY = ("torch", "transformers", "matplotlib", "datasets", "pyarrow", "tiktoken", "sympy")
CHILD = """
import json, sys
from eulergen.runtime.train import trainer as train
step = train.Trainer.train_step
def first(self):
    if not hasattr(self, "_loaded"):
        self._loaded = sorted(m for m in %r if m in sys.modules)
        print("LOADED " + json.dumps(self._loaded), file=sys.stderr)
    return step(self)
train.Trainer.train_step = first
from eulergen.cli import main
sys.argv = ["eulergen", "train", *sys.argv[1:]]
main()
""" % (HEAVY,)


def test_nothing_heavy_is_imported_before_the_first_step(tmp_path):
    env = {**os.environ, "EULERGEN_CACHE": str(tmp_path / "cache")}
    run = tmp_path / "run"
    got = subprocess.run(
        [sys.executable, "-c", CHILD, "--device", "numpy", "--run-dir", str(run),
         "--set", "training.total_steps=1", "--set", "training.warmup_steps=1",
         "--set", "training.eval_every=0", "--set", "training.sample_tokens=0"],
        env=env, capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr
    loaded = next(json.loads(line[len("LOADED "):]) for line in got.stderr.splitlines()
                  if line.startswith("LOADED "))
    assert loaded == []
    assert list((run / "tb").glob("events.out.tfevents.*")), "no TensorBoard events written"
