"""Checkpoints and run folders: state.json and the weights of a run, damaged; run folders
that are not eulergen's; `plot`."""
from __future__ import annotations

import json

from bad_inputs.case import QUICK, ON_SHARD, SAMPLE, Case, GONE, safetensors, surface, tensor

CKPT = "run/ckpt_00000002"


def _state(run_edit) -> dict:
    return {f"{CKPT}/state.json": run_edit}


def _weights(data: bytes) -> dict:
    return {f"{CKPT}/model.safetensors": data}


CHECKPOINTS = surface("checkpoints", [
    Case("state-json-binary", ("train", "--resume", "run"), "corrupt state",
         _state(b"\x00\xff\xfe\x00"), uses=("run",), fault="traceback"),
    Case("state-json-missing-keys", ("train", "--resume", "run"), "corrupt state: no",
         _state('{"format": 1, "step": 2}'), uses=("run",), fault="traceback"),
    Case("state-json-step-not-an-integer", ("train", "--resume", "run"),
         'step "two" is not a step number', _state('{"format": 1, "step": "two"}'),
         uses=("run",), fault="traceback"),
    Case("state-json-step-negative", SAMPLE, "step -2 is not a step number",
         _state('{"format": 1, "step": -2}'), uses=("run",), fault="traceback"),
    Case("state-json-format", SAMPLE, "checkpoint format 7 is not 1",
         _state('{"format": 7, "step": 2}'), uses=("run",)),
    Case("state-json-deep", SAMPLE, "nested too deeply", _state("[" * 100_000 + "]" * 100_000),
         uses=("run",), fault="traceback"),
    Case("state-json-a-list", SAMPLE, "not a JSON object", _state("[1, 2]"), uses=("run",),
         fault="traceback"),
    Case("state-json-config-wrong", SAMPLE, "model.hidden_dim: expected an integer",
         _state(json.dumps({"format": 1, "step": 2, "config": {"model": {"hidden_dim": "x"}}})),
         uses=("run",), fault="traceback"),
    Case("state-json-digest-a-number", SAMPLE, "tokenizer_digest: expected a string",
         _state(json.dumps({"format": 1, "step": 2, "config": {}, "tokenizer_digest": 5})),
         uses=("run",), fault="traceback"),
    Case("resume-state-spike-guard-wrong", ("train", "--resume", "run"), "corrupt state",
         _state(json.dumps({"format": 1, "step": 2, "config": {}, "adam_updates": "x",
                            "spike_guard": 1, "data": 2})), uses=("run",),
         where="state.json", fault="traceback"),
    Case("weights-corrupt", SAMPLE, "corrupt tensors",
         _weights(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage"), uses=("run",), fault="traceback"),
    Case("weights-header-a-list", SAMPLE, "expected an object, got a list",
         _weights(safetensors([1, 2])), uses=("run",), fault="traceback"),
    Case("weights-negative-offsets", SAMPLE, "x.data_offsets: corrupt tensors: -8 is outside",
         _weights(safetensors({"x": tensor(offsets=(-8, 0))}, b"\0" * 8)), uses=("run",),
         fault="traceback"),
    Case("weights-dtype-int", SAMPLE, "'I64' is not a float type",
         _weights(safetensors({"x": tensor("I64", (1,))}, b"\0" * 8)), uses=("run",),
         fault="traceback"),
    Case("weights-shape-strings", SAMPLE, "x.shape: corrupt tensors: expected an integer",
         _weights(safetensors({"x": tensor(shape=("2",))}, b"\0" * 8)), uses=("run",),
         fault="traceback"),
    Case("weights-header-past-the-file", SAMPLE, "whose header claims 4096 bytes",
         _weights(safetensors({}, length=4096)), uses=("run",), fault="hang"),
    Case("weights-header-not-json", SAMPLE, "the header is not JSON",
         _weights(b"\x04\x00\x00\x00\x00\x00\x00\x00nope"), uses=("run",), fault="traceback"),
    Case("weights-body-cut-short", SAMPLE, "truncated: x ends at byte",
         _weights(safetensors({"x": tensor(shape=(4,), offsets=(0, 16))}, b"\0" * 8)),
         uses=("run",), fault="traceback"),
    Case("weights-offsets-disagree", SAMPLE, "its offsets span 4 bytes",
         _weights(safetensors({"x": tensor(offsets=(0, 4))}, b"\0" * 8)), uses=("run",),
         fault="traceback"),
    Case("weights-another-model", SAMPLE, "weights do not fit this model: missing 'wpe.weight'",
         _weights(safetensors({"wte.weight": tensor(shape=(2,))}, b"\0" * 8)), uses=("run",),
         where="model.safetensors", fault="traceback"),
    Case("weights-empty-file", SAMPLE, "truncated or not safetensors", _weights(b""),
         uses=("run",), fault="traceback"),
    Case("checkpoint-optim-gone", ("sample", CKPT, "--device", "numpy"),
         "incomplete checkpoint: optim.safetensors is missing",
         {f"{CKPT}/optim.safetensors": GONE}, uses=("run",), where=CKPT),
    Case("sample-no-checkpoint", ("sample", "empty", "--device", "numpy"),
         "no checkpoint in this run folder", {"empty/notes.txt": "x"}, where="empty"),
    Case("resume-missing", ("train", "--resume", "gone"), "not a run folder", where="gone"),
    Case("resume-with-config", ("train", "--resume", "run", "--config", "c.yaml"),
         "--resume continues a run", {"c.yaml": "{}"}, uses=("run",), where="--resume"),
    Case("resume-another-width", ("train", "--resume", "run", "--set", "model.hidden_dim=64"),
         "has shape", uses=("run",), where="model.safetensors", fault="traceback"),
    Case("resume-init-record-wrong", ("train", "--resume", "run"), "folder: missing",
         {"run/init_from.json": '{"init_from": "x"}', f"{CKPT}/model.safetensors": GONE},
         uses=("run",), where="run/init_from.json", fault="traceback"),
])

RUN_FOLDERS = surface("checkpoints", [
    Case("run-dir-of-the-users-files", ("train", "--run-dir", "mine", *QUICK, *ON_SHARD),
         "holds files eulergen did not write",
         {"mine/config.json": "{}", "mine/metrics.jsonl": "{}\n", "mine/loss.png": "png"},
         uses=("shard",), where="mine", fault="data loss"),
    Case("run-dir-is-a-file", ("train", "--run-dir", "notes.txt", *QUICK, *ON_SHARD),
         "exists and is not a folder", {"notes.txt": "mine"}, uses=("shard",), fault="data loss"),
    Case("run-dir-with-checkpoints", ("train", "--run-dir", "run", *QUICK, *ON_SHARD),
         "holds checkpoints", uses=("run", "shard"), where="run", fault="data loss"),
    Case("plot-binary-metrics", ("plot", "p"), "not UTF-8 text",
         {"p/metrics.jsonl": b"\xff\xfe\x00\x01"}, fault="traceback"),
    Case("plot-not-a-run", ("plot", "p"), "no metrics.jsonl here", {"p/x.txt": "x"}, where="p"),
    Case("plot-records-not-objects", ("plot", "p"), "not a metrics record",
         {"p/metrics.jsonl": "[1]\n[2]\n"}, fault="traceback"),
    Case("plot-loss-a-string", ("plot", "p"), "train_loss: expected a number, got str",
         {"p/metrics.jsonl": '{"step": 1, "train_loss": "low"}\n'}, fault="silent"),
    Case("plot-no-loss", ("plot", "p"), "no loss recorded yet",
         {"p/metrics.jsonl": '{"step": 1}\n'}),
    Case("plot-foreign-png", ("plot", "p"), "not overwritten",
         {"p/metrics.jsonl": '{"step": 1, "train_loss": 1.0}\n', "p/loss.png": "mine"},
         where="p/loss.png", fault="data loss"),
])
