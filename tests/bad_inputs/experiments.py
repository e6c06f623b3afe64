"""Comparing and sweeping runs: `compare`, `plot` of several runs, `sweep`."""
from __future__ import annotations

import json

from bad_inputs.case import Case, surface


def fake_run(name: str, val: str) -> dict:
    """A run folder's config.json and metrics.jsonl, scoring the text `val`."""
    config = {"model": {"activation": "gelu"}, "training": {"seed": 1},
              "data": {"dataset": "data/text_train.bin", "val_dataset": val, "tokenizer": "byte"}}
    return {f"{name}/config.json": json.dumps(config),
            f"{name}/metrics.jsonl": '{"step": 1, "train_loss": 5.0, "val_loss": 5.1}\n'}


# a sweep of tiny runs that evaluate (QUICK's eval_every=0 and no validation set would not)
TINY_SWEEP = {"training.total_steps": 2, "training.warmup_steps": 1, "training.eval_every": 1,
              "training.eval_steps": 1, "training.sample_tokens": 0, "model.max_seq_len": 16,
              "training.batch_size": 2, "model.hidden_dim": 32, "model.num_heads": 1,
              "model.num_kv_heads": 1, "model.num_layers": 1,
              "data.dataset": "data/text_train.bin", "data.val_dataset": "data/text_train.bin"}


def sweep(*sets: str, **given) -> tuple[str, ...]:
    """`eulergen sweep` into sw/ of TINY_SWEEP's runs, with `sets` (KEY=VALUE, replacing
    TINY_SWEEP's) and other options (`seeds=2`)."""
    keys = {item.partition("=")[0] for item in sets}
    items = [f"{k}={v}" for k, v in TINY_SWEEP.items() if k not in keys] + list(sets)
    return ("sweep", "--out", "sw", "--device", "numpy", *(a for i in items for a in ("--set", i)),
            *(a for k, v in given.items() for a in (f"--{k}", str(v))))


EXPERIMENTS = surface("compare and sweep", [
    Case("compare-not-a-run", ("compare", "p"), "no config.json here", {"p/x.txt": "x"},
         where="p"),
    Case("compare-nothing-in-common", ("compare", "a", "b"), "nothing in common with a",
         {**fake_run("a", "data/text_train.bin"), **fake_run("b", "other_val.bin")},
         where="b"),
    Case("compare-out-not-eulergens", ("compare", "run", "--out", "mine.png"),
         "a file eulergen did not write: not overwritten", {"mine.png": "my picture"},
         uses=("run",), fault="data loss"),
    Case("compare-out-not-png", ("compare", "run", "--out", "table.txt"), "name a .png file",
         uses=("run",), where="table.txt"),
    Case("plot-runs-out-a-folder", ("plot", "run", "run", "--out", "pics.png"), "is a folder",
         {"pics.png/x": "x"}, uses=("run",), where="pics.png"),
    Case("sweep-value-not-an-op", sweep("model.activation=gelu,nosuchop"),
         "model.activation=nosuchop", uses=("shard",), where="--set"),
    Case("sweep-value-not-an-integer", sweep("model.mlp_hidden=32,lots"),
         'expected an integer, got "lots" (at the sweep\'s model.mlp_hidden=lots)',
         uses=("shard",), where="--set"),
    Case("sweep-folder-of-the-users-files", sweep("model.activation=gelu,relu2"),
         "holds files eulergen did not write", {"sw/notes.txt": "mine"}, uses=("shard",),
         where="sw", fault="data loss"),
    Case("sweep-into-a-sweep", sweep("model.activation=gelu,relu2"),
         "holds a sweep: continue it with `eulergen sweep --resume sw`",
         {"sw/.eulergen-run": "", "sw/sweep.json": "{}"}, uses=("shard",), where="sw",
         fault="data loss"),
    Case("sweep-resume-not-a-sweep", ("sweep", "--resume", "run"), "not a sweep folder",
         uses=("run",), where="run"),
    Case("sweep-resume-with-sets", ("sweep", "--resume", "run", "--set", "a.b=1"),
         "--resume continues a sweep", uses=("run",), where="--resume"),
    Case("sweep-without-evaluation", sweep("training.eval_every=0", seeds=2),
         "is 0, but a sweep compares the runs' final val losses", uses=("shard",),
         where="training.eval_every", fault="silent"),
    Case("sweep-key-given-twice", (*sweep("model.activation=gelu,relu2"), "--set",
                                   "model.activation=silu"), "given twice", uses=("shard",),
         where="model.activation"),
    Case("sweep-seeds-by-set", sweep("training.seed=1,2"), "seeds are swept by --seeds N",
         uses=("shard",), where="training.seed"),
    Case("sweep-nothing-to-sweep", sweep(), "nothing to sweep", uses=("shard",), where="--set"),
])
