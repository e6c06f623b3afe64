"""The bad-input corpus: each row a command line, the files it finds in its folder, and a
fragment of the one-line error it must print (tests/test_bad_inputs.py runs them).

`files` maps a path in the case's folder to its text (str) or bytes; `uses` copies shared
fixtures in: "shard" (data/text_train.bin, byte-level text) and "run" (run/, a finished
two-step run with checkpoints). `where` is the file or flag the message must name (the
first path in `files` when not given). `new_files`: the command may create files (never
change one that was there)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Case:
    id: str
    args: tuple[str, ...]
    says: str
    files: dict = field(default_factory=dict)
    uses: tuple[str, ...] = ()
    where: str | None = None
    code: int = 2
    env: dict = field(default_factory=dict)
    stdin: bytes | None = None
    new_files: bool = False


def bomb(levels: int = 8) -> str:
    """The billion laughs: 10**levels values from a few hundred bytes."""
    items = ["&a0 [x, x, x, x, x, x, x, x, x, x]"]
    items += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels)]
    return "[" + ", ".join(items) + "]"


def spec(body: str, name: str = "myact") -> dict:
    return {f"ops/{name}.yaml": f"name: {name}\nkind: pointwise\n{body}"}


def shard_bytes(magic: int, version: int, count: int, body: bytes) -> bytes:
    header = np.zeros(256, dtype="<i4")
    header[:3] = (magic, version, count)
    return header.tobytes() + body


QUICK = ("--device", "numpy", "--set", "training.total_steps=2", "--set",
         "training.warmup_steps=1", "--set", "training.eval_every=0", "--set",
         "training.sample_tokens=0", "--set", "model.max_seq_len=16", "--set",
         "training.batch_size=2", "--set", "model.hidden_dim=32", "--set", "model.num_heads=1",
         "--set", "model.num_kv_heads=1", "--set", "model.num_layers=1")
ON_SHARD = ("--set", "data.dataset=data/text_train.bin", "--set", "data.val_dataset=null")
TRAIN = ("train", "--run-dir", "out", *QUICK)
PLAN_OPS = ("plan", "--ops", "ops")
OK_ACT = "inputs: [x]\noutputs:\n  y: x * sigmoid(x)\n"
WORDS = json.dumps({"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
                    "normalizer": None, "pre_tokenizer": {"type": "Whitespace"},
                    "post_processor": None, "decoder": None,
                    "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "a": 1, "b": 2},
                              "unk_token": "[UNK]"}})

SPECS = [
    Case("spec-alias-bomb", PLAN_OPS, "aliases expanded", spec(OK_ACT + f"doc: {bomb()}\n")),
    Case("spec-recursive-alias", PLAN_OPS, "refers to a node that contains it",
         spec(OK_ACT + "doc: &a [*a]\n")),
    Case("spec-deep-yaml", PLAN_OPS, "nested deeper than 64 levels",
         spec(OK_ACT + "doc: " + "[" * 5000 + "]" * 5000 + "\n")),
    Case("spec-duplicate-key", PLAN_OPS, "inputs: given twice, on lines 3 and 6",
         spec(OK_ACT + "inputs: [z]\n")),
    Case("spec-binary", PLAN_OPS, "not UTF-8 text", {"ops/myact.yaml": b"name: \xff\xfe\x00\x01"}),
    Case("spec-empty", PLAN_OPS, "empty spec file", {"ops/myact.yaml": ""}),
    Case("spec-a-list", PLAN_OPS, "a spec must be a mapping", {"ops/myact.yaml": "- a\n- b\n"}),
    Case("spec-non-ascii-input", PLAN_OPS, "inputs.0: 'ξ' is not a valid name",
         spec("inputs: [ξ]\noutputs:\n  y: ξ * 2\n")),
    Case("spec-non-ascii-op-name", PLAN_OPS, "name: 'mísh' is not a valid name",
         spec("inputs: [x]\noutputs:\n  y: x\n", name="mísh")),
    Case("spec-non-ascii-param", PLAN_OPS, "params.ε: 'ε' is not a valid name",
         spec("inputs: [x]\nparams: {ε: 1.0}\noutputs:\n  y: x\n")),
    Case("spec-non-ascii-output", PLAN_OPS, "outputs.ÿ: 'ÿ' is not a valid name",
         spec("inputs: [x]\noutputs:\n  ÿ: x\n")),
    Case("spec-non-ascii-formula", PLAN_OPS, "formulas are ASCII",
         spec("inputs: [x]\noutputs:\n  y: ｘ * 2\n")),
    Case("spec-long-formula", PLAN_OPS, "characters: at most 10,000",
         spec("inputs: [x]\noutputs:\n  y: " + "+".join(["x"] * 6000) + "\n")),
    Case("spec-deep-formula", PLAN_OPS, "nests 65 levels deep",
         spec("inputs: [x]\noutputs:\n  y: " + "tanh(" * 65 + "x" + ")" * 65 + "\n")),
    Case("spec-let-bomb", PLAN_OPS, "expands (its `let` names inlined)",
         spec("inputs: [x]\nlet:\n  l0: x + 1\n"
              + "".join(f"  l{i}: l{i - 1}*x + sin(l{i - 1})\n" for i in range(1, 20))
              + "outputs:\n  y: l19\n")),
    Case("spec-unknown-function", PLAN_OPS, "unknown function 'sigmoidd'",
         spec("inputs: [x]\noutputs:\n  y: sigmoidd(x)\n")),
    Case("spec-syntax-error", PLAN_OPS, "syntax error", spec("inputs: [x]\noutputs:\n  y: x *\n")),
    Case("spec-attribute-injection", PLAN_OPS, "attribute access are not allowed",
         spec("inputs: [x]\noutputs:\n  y: x.__class__\n")),
    Case("spec-import-injection", PLAN_OPS, "unknown function '__import__'",
         spec("inputs: [x]\noutputs:\n  y: __import__('os')\n")),
    Case("spec-name-mismatch", PLAN_OPS, "must equal the file name",
         {"ops/myact.yaml": "name: other\nkind: pointwise\n" + OK_ACT}),
    Case("spec-unknown-kind", PLAN_OPS, "unknown kind 'pointwize'",
         {"ops/myact.yaml": "name: myact\nkind: pointwize\n" + OK_ACT}),
    Case("spec-shadows-builtin", PLAN_OPS, "add `override: true`", spec(OK_ACT, name="gelu")),
    Case("spec-ops-dir-missing", ("plan", "--ops", "nowhere"), "ops directory does not exist",
         where="nowhere"),
    Case("spec-ops-path-env-missing", ("check", "gelu"), "ops directory does not exist",
         env={"EULERGEN_OPS_PATH": "gone"}, where="gone"),
]

CONFIGS = [
    Case("config-alias-bomb", ("plan", "--config", "c.yaml"), "model.hidden_dim",
         {"c.yaml": f"model:\n  hidden_dim: {bomb()}\n"}),
    Case("config-duplicate-yaml", ("plan", "--config", "c.yaml"),
         "c.yaml:3: model.hidden_dim: given twice, on lines 2 and 3",
         {"c.yaml": "model:\n  hidden_dim: 64\n  hidden_dim: 128\n"}),
    Case("config-duplicate-json", ("plan", "--config", "c.json"),
         "c.json:2: model.num_layers: given twice, on lines 1 and 2",
         {"c.json": '{"model": {"num_layers": 2,\n "num_layers": 3}}'}),
    Case("config-binary", ("plan", "--config", "c.json"), "not UTF-8 text",
         {"c.json": b"\x89PNG\r\n\x1a\n\x00\x00"}),
    Case("config-deep-json", ("plan", "--config", "c.json"), "nested",
         {"c.json": "[" * 100_000 + "]" * 100_000}),
    Case("config-deep-yaml", ("plan", "--config", "c.yaml"), "nested deeper than 64 levels",
         {"c.yaml": "model: " + "[" * 100_000 + "]" * 100_000}),
    Case("config-a-list", ("plan", "--config", "c.yaml"), "expected a mapping of sections",
         {"c.yaml": "- model\n"}),
    Case("config-unknown-section", ("plan", "--config", "c.yaml"), "unknown section",
         {"c.yaml": "modle: {}\n"}),
    Case("config-typo-key", ("plan", "--config", "c.yaml"), "did you mean 'hidden_dim'",
         {"c.yaml": "model:\n  hiden_dim: 64\n"}),
    Case("config-wrong-type", ("plan", "--config", "c.yaml"), "expected an integer",
         {"c.yaml": "model:\n  hidden_dim: big\n"}),
    Case("config-invalid-json", ("plan", "--config", "c.json"), "invalid JSON",
         {"c.json": '{"model": {"hidden_dim": 64,}}'}),
    Case("config-invalid-yaml", ("plan", "--config", "c.yaml"), "YAML error",
         {"c.yaml": "model: [\n"}),
    Case("config-missing", ("plan", "--config", "nope.yaml"), "config file not found",
         where="nope.yaml"),
    Case("set-no-equals", ("plan", "--set", "model.hidden_dim"), "expected section.key=value",
         where="--set"),
    Case("set-unknown-section", ("plan", "--set", "modl.x=1"), "unknown section", where="--set"),
    Case("set-million-layers", ("plan", "--set", "model.num_layers=1000000"),
         "model.num_layers: 1,000,000 layers: at most 1,024", where="model.num_layers"),
    Case("set-vocab-1e12", (*TRAIN, *ON_SHARD, "--set", "model.vocab_size=1000000000000"),
         "model.vocab_size", uses=("shard",), where="32 bits"),
    Case("set-accumulation-1e9", (*TRAIN, *ON_SHARD, "--set",
                                  "training.gradient_accumulation=1000000000"),
         "at most 33,554,432", uses=("shard",), where="training.gradient_accumulation"),
    Case("set-hidden-1M", (*TRAIN, *ON_SHARD, "--set", "model.hidden_dim=1048576", "--set",
                           "model.num_heads=16384", "--set", "model.num_kv_heads=16384"),
         "the training plan needs", uses=("shard",), where="model.hidden_dim"),
    Case("set-seed-negative", (*TRAIN, *ON_SHARD, "--set", "training.seed=-1"),
         "training.seed: must not be negative", uses=("shard",), where="--set"),
    Case("set-zero-steps", ("plan", "--set", "training.total_steps=0"), "must be positive",
         where="training.total_steps"),
    Case("set-heads-not-dividing", ("plan", "--set", "model.num_heads=5"), "do not divide",
         where="model.num_heads"),
    Case("set-nan-lr", ("plan", "--set", "training.learning_rate=.nan"), "expected a number",
         where="training.learning_rate"),
    Case("set-dtype", ("plan", "--set", "training.dtype=fp64"), "is not one of",
         where="training.dtype"),
]

DATA = [
    Case("data-glob-matches-nothing", (*TRAIN, "--set", "data.dataset=data/*_train_*.bin"),
         "no token files match", where="data/*_train_*.bin"),
    Case("data-checkpoint-magic", (*TRAIN, "--set", "data.dataset=d_train_000001.bin"),
         "is a model checkpoint, not a token shard",
         {"d_train_000001.bin": shard_bytes(20240326, 1, 4, b"\0" * 8)}),
    Case("data-truncated-shard", (*TRAIN, "--set", "data.dataset=d_train_000001.bin"),
         "truncated: header says 1000 tokens",
         {"d_train_000001.bin": shard_bytes(20240520, 1, 1000, b"\0" * 8)}),
    Case("data-odd-nanogpt-bin", (*TRAIN, "--set", "data.dataset=train.bin"),
         "not a whole number of uint16 tokens", {"train.bin": b"\0" * 101}),
    Case("data-empty-bin", (*TRAIN, "--set", "data.dataset=train.bin"), "empty token file",
         {"train.bin": b""}),
    Case("data-too-few-tokens", (*TRAIN, "--set", "data.dataset=d_train_000001.bin"),
         "too few tokens for one batch",
         {"d_train_000001.bin": shard_bytes(20240520, 1, 4, np.arange(4, dtype="<u2").tobytes())}),
    Case("data-ids-past-the-vocab", (*TRAIN, "--set", "data.dataset=d_train_000001.bin",
                                     "--set", "data.val_dataset=null"),
         "outside the model's vocabulary",
         {"d_train_000001.bin": shard_bytes(20240520, 1, 4000,
                                            np.full(4000, 999, dtype="<u2").tobytes())},
         new_files=True),
    Case("data-another-tokenizers", (*TRAIN, "--set", "data.dataset=d/d_train_000001.bin",
                                     "--set", "data.val_dataset=null"),
         "prepared with tokenizer 'gpt2', not 'byte'",
         {"d/d_train_000001.bin": shard_bytes(20240520, 1, 4000,
                                              np.full(4000, 65, dtype="<u2").tobytes()),
          "d/prepare.json": json.dumps({"format": 1, "settings": {
              "tokenizer": "gpt2", "tokenizer_digest": "tiktoken:gpt2"}, "shards": []})},
         where="d/prepare.json"),
    Case("prepare-out-is-a-file", ("prepare", "a.txt", "--out", "a.txt", "--tokenizer", "byte",
                                   "--quiet"), "not a folder", {"a.txt": "hello\n"}),
    Case("prepare-out-foreign", ("prepare", "a.txt", "--out", "mine", "--tokenizer", "byte",
                                 "--quiet"), "holds files prepare did not write",
         {"a.txt": "hello\n", "mine/notes.md": "mine\n"}, where="mine"),
    Case("prepare-binary-source", ("prepare", "a.txt", "--out", "out", "--tokenizer", "byte",
                                   "--quiet"), "--on-bad-text skip", {"a.txt": b"\xff\xfe\x00"}),
    Case("prepare-missing-source", ("prepare", "gone.txt", "--out", "out", "--tokenizer", "byte",
                                    "--quiet"), "gone.txt", where="gone.txt"),
    Case("eval-steps-past-the-validation-set", (*TRAIN, "--set", "data.dataset=data/text_train.bin",
                                               "--set", "data.val_dataset=data/text_train.bin",
                                               "--set", "training.eval_every=1",
                                               "--set", "training.eval_steps=1000000000"),
         "but the validation set holds", uses=("shard",), where="training.eval_steps"),
    Case("prepare-a-million-workers", ("prepare", "a.txt", "--out", "out", "--tokenizer", "byte",
                                       "--workers", "1000000", "--quiet"),
         "1,000,000 workers: at most 4 a core", {"a.txt": "x"}, where="--workers"),
    Case("prepare-zero-shard-tokens", ("prepare", "a.txt", "--out", "out", "--shard-tokens", "0"),
         "not a positive token count", {"a.txt": "x"}, where="--shard-tokens"),
]

TOKENIZERS = [
    Case("tokenizer-missing", (*TRAIN, *ON_SHARD, "--set", "data.tokenizer=tok.json"),
         "tokenizer file not found", uses=("shard",), where="tok.json"),
    Case("tokenizer-not-a-tokenizer", (*TRAIN, *ON_SHARD, "--set", "data.tokenizer=tok.json"),
         "not a tokenizers JSON file", {"tok.json": '{"hello": 1}'}, uses=("shard",)),
    Case("tokenizer-binary", (*TRAIN, *ON_SHARD, "--set", "data.tokenizer=tok.json"),
         "tok.json", {"tok.json": b"\xff\xd8\xff\xe0"}, uses=("shard",)),
    Case("tokenizer-without-eot", (*TRAIN, *ON_SHARD, "--set", "data.tokenizer=tok.json"),
         "has no end-of-text token", {"tok.json": WORDS}, uses=("shard",),
         where="data.tokenizer"),
    Case("tokenizer-train-tiny-vocab", ("tokenizer", "train", "a.txt", "--vocab-size", "10",
                                        "--out", "t.json"), "is below", {"a.txt": "abc\n"},
         where="--vocab-size"),
    Case("prepare-tokenizer-without-eot", ("prepare", "a.txt", "--out", "out", "--tokenizer",
                                           "tok.json", "--quiet"),
         "has no end-of-text token", {"a.txt": "a b\n", "tok.json": WORDS}, where="--tokenizer"),
]


def _state(run_edit) -> dict:
    return {"run/ckpt_00000002/state.json": run_edit}


CHECKPOINTS = [
    Case("state-json-binary", ("train", "--resume", "run"), "corrupt state",
         _state(b"\x00\xff\xfe\x00"), uses=("run",), where="run/ckpt_00000002/state.json"),
    Case("state-json-missing-keys", ("train", "--resume", "run"), "corrupt state: no",
         _state('{"format": 1, "step": 2}'), uses=("run",),
         where="run/ckpt_00000002/state.json"),
    Case("state-json-step-not-an-integer", ("train", "--resume", "run"),
         'step "two" is not a step number', _state('{"format": 1, "step": "two"}'),
         uses=("run",), where="run/ckpt_00000002/state.json"),
    Case("state-json-deep", ("sample", "run", "--device", "numpy"), "nested too deeply",
         _state("[" * 100_000 + "]" * 100_000), uses=("run",),
         where="run/ckpt_00000002/state.json"),
    Case("state-json-a-list", ("sample", "run", "--device", "numpy"), "not a JSON object",
         _state("[1, 2]"), uses=("run",), where="run/ckpt_00000002/state.json"),
    Case("weights-corrupt", ("sample", "run", "--device", "numpy"), "corrupt tensors",
         {"run/ckpt_00000002/model.safetensors": b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage"},
         uses=("run",)),
    Case("sample-no-checkpoint", ("sample", "empty", "--device", "numpy"),
         "no checkpoint in this run folder", {"empty/notes.txt": "x"}, where="empty"),
    Case("resume-missing", ("train", "--resume", "gone"), "not a run folder", where="gone"),
    Case("resume-with-config", ("train", "--resume", "run", "--config", "c.yaml"),
         "--resume continues a run", {"c.yaml": "{}"}, uses=("run",), where="--resume"),
    Case("run-dir-of-the-users-files", ("train", "--run-dir", "mine", *QUICK, *ON_SHARD),
         "holds files eulergen did not write",
         {"mine/config.json": "{}", "mine/metrics.jsonl": "{}\n", "mine/loss.png": "png"},
         uses=("shard",), where="mine"),
    Case("run-dir-is-a-file", ("train", "--run-dir", "notes.txt", *QUICK, *ON_SHARD),
         "exists and is not a folder", {"notes.txt": "mine"}, uses=("shard",)),
    Case("run-dir-with-checkpoints", ("train", "--run-dir", "run", *QUICK, *ON_SHARD),
         "holds checkpoints", uses=("run", "shard"), where="run"),
    Case("plot-binary-metrics", ("plot", "p"), "not UTF-8 text",
         {"p/metrics.jsonl": b"\xff\xfe\x00\x01"}),
    Case("plot-not-a-run", ("plot", "p"), "no metrics.jsonl here", {"p/x.txt": "x"}, where="p"),
    Case("plot-records-not-objects", ("plot", "p"), "not a metrics record",
         {"p/metrics.jsonl": "[1]\n[2]\n"}),
    Case("plot-foreign-png", ("plot", "p"), "not overwritten",
         {"p/metrics.jsonl": '{"step": 1, "train_loss": 1.0}\n', "p/loss.png": "mine"},
         where="p"),
]

FLAGS = [
    Case("sample-seed-negative", ("sample", "run", "--seed", "-1"), "--seed", uses=("run",),
         where="-1"),
    Case("sample-zero-samples", ("sample", "run", "--num-samples", "0"), "--num-samples",
         uses=("run",), where="0"),
    Case("sample-ten-million-samples", ("sample", "run", "--device", "numpy", "--num-samples",
                                        "10000000"), "the sampling plan needs", uses=("run",),
         where="--num-samples"),
    Case("sample-prompt-not-utf8", ("sample", "run", "--device", "numpy", "--prompt", "a\udcffb"),
         "not UTF-8 text (byte 0xff at character 1)", uses=("run",), where="--prompt"),
    Case("sample-empty-prompt", ("sample", "run", "--device", "numpy", "--prompt", ""),
         "the prompt is empty", uses=("run",), where="prompt"),
    Case("sample-bf16-on-numpy", ("sample", "run", "--device", "numpy", "--dtype", "bf16"),
         "bf16 sampling needs a CUDA GPU", uses=("run",), where="--dtype"),
    Case("sample-no-new-tokens", ("sample", "run", "--max-new-tokens", "0"), "want ≥ 1",
         uses=("run",), where="max_new_tokens"),
    Case("sample-negative-temperature", ("sample", "run", "--temperature", "-1"),
         "want ≥ 0", uses=("run",), where="temperature"),
    Case("sample-top-p-past-one", ("sample", "run", "--top-p", "2"), "top_p", uses=("run",),
         where="top_p"),
    Case("train-unknown-device", ("train", "--device", "tpu"), "Invalid value for '--device'",
         where="tpu"),
    Case("eval-zero-batch", ("eval", "run", "--data", "x", "--batch-size", "0"),
         "--batch-size", uses=("run",), where="0"),
    Case("prepare-without-out", ("prepare", "a.txt"), "Missing option '--out'",
         {"a.txt": "x"}, where="--out"),
    Case("chat-line-not-utf8", ("chat", "run", "--device", "numpy", "--max-new-tokens", "2"),
         "that line is not UTF-8 text: left out", uses=("run",), code=0,
         stdin=b"\xff\xfe\n/quit\n", where="warning:"),
]

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


RUNS = [
    Case("compare-not-a-run", ("compare", "p"), "no config.json here", {"p/x.txt": "x"},
         where="p"),
    Case("compare-nothing-in-common", ("compare", "a", "b"), "nothing in common with a",
         {**fake_run("a", "data/text_train.bin"), **fake_run("b", "other_val.bin")},
         where="b"),
    Case("compare-out-not-eulergens", ("compare", "run", "--out", "mine.png"),
         "a file eulergen did not write: not overwritten", {"mine.png": "my picture"},
         uses=("run",)),
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
         where="sw"),
    Case("sweep-into-a-sweep", sweep("model.activation=gelu,relu2"),
         "holds a sweep: continue it with `eulergen sweep --resume sw`",
         {"sw/.eulergen-run": "", "sw/sweep.json": "{}"}, uses=("shard",), where="sw"),
    Case("sweep-resume-not-a-sweep", ("sweep", "--resume", "run"), "not a sweep folder",
         uses=("run",), where="run"),
    Case("sweep-resume-with-sets", ("sweep", "--resume", "run", "--set", "a.b=1"),
         "--resume continues a sweep", uses=("run",), where="--resume"),
    Case("sweep-without-evaluation", sweep("training.eval_every=0", seeds=2),
         "is 0, but a sweep compares the runs' final val losses", uses=("shard",),
         where="training.eval_every"),
    Case("sweep-key-given-twice", (*sweep("model.activation=gelu,relu2"), "--set",
                                   "model.activation=silu"), "given twice", uses=("shard",),
         where="model.activation"),
    Case("sweep-seeds-by-set", sweep("training.seed=1,2"), "seeds are swept by --seeds N",
         uses=("shard",), where="training.seed"),
    Case("sweep-nothing-to-sweep", sweep(), "nothing to sweep", uses=("shard",), where="--set"),
]

CASES = [*SPECS, *CONFIGS, *DATA, *TOKENIZERS, *CHECKPOINTS, *FLAGS, *RUNS]
