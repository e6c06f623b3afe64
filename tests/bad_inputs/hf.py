"""Hugging Face folders (config.json, safetensors headers, shard indexes, tokenizer files),
read by `train --init-from`, `sample`, `eval`; and `export`'s output folder."""
from __future__ import annotations

import json

from bad_inputs.case import (GONE, GPT2_CONFIG, LLAMA_CONFIG, Case, config, safetensors,
                             surface, tensor, words)

INIT = ("train", "--init-from", "hf", "--run-dir", "out", "--device", "numpy")
SAMPLE_HF = ("sample", "hf", "--device", "numpy", "--max-new-tokens", "2")
EVAL_HF = ("eval", "hf", "--data", "d.bin", "--device", "numpy")


def hf_config(**changes) -> dict:
    return {"hf/config.json": config(GPT2_CONFIG, **changes)}


def llama(**changes) -> dict:
    return {"hf/config.json": config(LLAMA_CONFIG, **changes)}


def hf_weights(data: bytes) -> dict:
    return {"hf/model.safetensors": data}


def index(weight_map) -> dict:
    return {"hf/model.safetensors.index.json": json.dumps({"weight_map": weight_map})}


HF = surface("HF folders", [
    Case("hf-n-embd-a-string", INIT, 'n_embd: expected an integer, got the string "128"',
         hf_config(n_embd="128"), uses=("hf",), fault="traceback"),
    Case("hf-n-head-zero", SAMPLE_HF, "n_head: 0 is outside 1..", hf_config(n_head=0),
         uses=("hf",), fault="traceback"),
    Case("hf-n-layer-negative", SAMPLE_HF, "n_layer: -1 is outside 1..", hf_config(n_layer=-1),
         uses=("hf",), fault="traceback"),
    Case("hf-vocab-a-float", SAMPLE_HF, "vocab_size: expected an integer, got 256.5",
         hf_config(vocab_size=256.5), uses=("hf",), fault="traceback"),
    Case("hf-n-positions-missing", SAMPLE_HF, "n_positions: missing", hf_config(n_positions=None),
         uses=("hf",), fault="traceback"),
    Case("hf-epsilon-negative", SAMPLE_HF, "layer_norm_epsilon: -1.0 must be positive",
         hf_config(layer_norm_epsilon=-1.0), uses=("hf",), fault="silent"),
    Case("hf-epsilon-nan", SAMPLE_HF, "layer_norm_epsilon: expected a finite number",
         {"hf/config.json": config(GPT2_CONFIG).replace("1e-05", "NaN")}, uses=("hf",),
         fault="silent"),
    Case("hf-activation-a-number", SAMPLE_HF, "activation_function: expected a string",
         hf_config(activation_function=3), uses=("hf",), fault="traceback"),
    Case("hf-activation-unknown", SAMPLE_HF, "'relu': eulergen has gelu_new",
         hf_config(activation_function="relu"), uses=("hf",)),
    Case("hf-architectures-a-string", SAMPLE_HF, "architectures: expected a list",
         hf_config(architectures="GPT2LMHeadModel"), uses=("hf",), fault="traceback"),
    Case("hf-architecture-bert", INIT, "eulergen reads GPT2LMHeadModel and LlamaForCausalLM",
         hf_config(architectures=["BertForMaskedLM"]), uses=("hf",)),
    Case("hf-untied", SAMPLE_HF, "tie_word_embeddings: False: eulergen supports True only",
         hf_config(tie_word_embeddings=False), uses=("hf",), fault="silent"),
    Case("hf-cross-attention", SAMPLE_HF, "add_cross_attention", hf_config(add_cross_attention=True),
         uses=("hf",), fault="silent"),
    Case("hf-config-a-list", SAMPLE_HF, "expected a JSON object", {"hf/config.json": "[1]"},
         uses=("hf",), where="hf", fault="traceback"),
    Case("hf-config-not-json", INIT, "invalid JSON", {"hf/config.json": "{"}, uses=("hf",),
         fault="traceback"),
    Case("hf-config-disagrees-with-weights", SAMPLE_HF, "config.json makes it",
         hf_config(n_positions=32), uses=("hf",), where="model.safetensors", fault="silent"),
    Case("hf-llama-rope-scaling-a-string", INIT, 'rope_scaling: expected an object, got the '
         'string "linear"', llama(rope_scaling="linear"), uses=("hf",), fault="traceback"),
    Case("hf-llama-rope-linear", INIT, "rope_type 'linear': eulergen's rope is the default one",
         llama(rope_scaling={"type": "linear", "factor": 2.0}), uses=("hf",), fault="silent"),
    Case("hf-llama-rope-type-a-number", INIT, "rope_scaling.rope_type: expected a string",
         llama(rope_scaling={"rope_type": 2}), uses=("hf",), fault="traceback"),
    Case("hf-llama-heads-zero", INIT, "num_attention_heads: 0 is outside 1..",
         llama(num_attention_heads=0), uses=("hf",), fault="traceback"),
    Case("hf-llama-head-dim", INIT, "eulergen's head dim is hidden_size / num_attention_heads = 16",
         llama(head_dim=8), uses=("hf",), fault="silent"),
    Case("hf-llama-bias-a-string", INIT, "attention_bias: expected true or false",
         llama(attention_bias="yes"), uses=("hf",), fault="traceback"),
    Case("hf-llama-theta-zero", INIT, "rope_theta: 0.0 must be positive", llama(rope_theta=0.0),
         uses=("hf",), fault="silent"),
    Case("hf-llama-activation", INIT, "hidden_act: 'gelu'", llama(hidden_act="gelu"), uses=("hf",)),
    Case("hf-header-a-list", SAMPLE_HF, "expected an object, got a list",
         hf_weights(safetensors([1, 2])), uses=("hf",), fault="traceback"),
    Case("hf-header-negative-offsets", INIT, "data_offsets: -8 is outside",
         hf_weights(safetensors({"x": tensor(offsets=(-8, 0))}, b"\0" * 8)), uses=("hf",),
         fault="traceback"),
    Case("hf-header-entry-a-string", SAMPLE_HF, "x: expected an object, got the string",
         hf_weights(safetensors({"x": "F32"})), uses=("hf",), fault="traceback"),
    Case("hf-header-offsets-three", SAMPLE_HF, "expected [begin, end], got 3 values",
         hf_weights(safetensors({"x": tensor(offsets=(0, 4, 8))}, b"\0" * 8)), uses=("hf",),
         fault="traceback"),
    Case("hf-header-dtype-bool", SAMPLE_HF, "'BOOL' is not a float type",
         hf_weights(safetensors({"x": tensor("BOOL", (1,), (0, 1))}, b"\0")), uses=("hf",),
         fault="traceback"),
    Case("hf-header-huge-shape", SAMPLE_HF, "x.shape",
         hf_weights(safetensors({"x": tensor(shape=(2**62, 2**62))})), uses=("hf",),
         fault="hang"),
    Case("hf-header-claims-a-gigabyte", EVAL_HF, "whose header claims 1073741824 bytes",
         hf_weights(safetensors({}, length=1 << 30)), uses=("hf",), fault="hang"),
    Case("hf-header-metadata-only", SAMPLE_HF, "holds no tensors",
         hf_weights(safetensors({"__metadata__": {"format": "pt"}})), uses=("hf",),
         where="model.safetensors"),
    Case("hf-no-weights", SAMPLE_HF, "pytorch_model.bin is not read: it is pickle",
         {"hf/model.safetensors": GONE, "hf/pytorch_model.bin": b"\x80\x02"}, uses=("hf",),
         where="hf"),
    Case("hf-index-a-list", SAMPLE_HF, "weight_map: expected an object, got a list", index([1]),
         uses=("hf",), where="model.safetensors.index.json", fault="traceback"),
    Case("hf-index-empty", SAMPLE_HF, "weight_map: empty", index({}), uses=("hf",),
         where="model.safetensors.index.json"),
    Case("hf-index-outside-the-folder", SAMPLE_HF, "is not a file name in this folder",
         index({"transformer.wte.weight": "../run/x.safetensors"}), uses=("hf",),
         where="model.safetensors.index.json", fault="data loss"),
    Case("hf-index-names-a-missing-shard", SAMPLE_HF, "is in model-2.safetensors, which is missing",
         index({"transformer.wte.weight": "model-2.safetensors"}), uses=("hf",),
         where="model.safetensors.index.json"),
    Case("hf-index-file-a-number", SAMPLE_HF, "weight_map.transformer.wte.weight: expected a string",
         index({"transformer.wte.weight": 3}), uses=("hf",),
         where="model.safetensors.index.json", fault="traceback"),
    Case("hf-tokenizer-vocab-and-merges", INIT,
         "found merges.txt, tokenizer_config.json, vocab.json, needs tokenizer.json",
         {"hf/tokenizer.json": GONE, "hf/vocab.json": "{}", "hf/merges.txt": ""}, uses=("hf",),
         where="hf", fault="silent"),
    Case("hf-tokenizer-none-for-sample", SAMPLE_HF, "found no tokenizer files, needs tokenizer.json",
         {"hf/tokenizer.json": GONE, "hf/tokenizer_config.json": GONE}, uses=("hf",),
         where="hf", fault="silent"),
    Case("hf-tokenizer-sentencepiece", EVAL_HF, "found tokenizer.model, needs tokenizer.json",
         {"hf/tokenizer.json": GONE, "hf/tokenizer_config.json": GONE,
          "hf/tokenizer.model": b"\x0a"}, uses=("hf",), where="hf", fault="silent"),
    Case("hf-tokenizer-broken", SAMPLE_HF, "not a tokenizers JSON file",
         {"hf/tokenizer.json": "{}"}, uses=("hf",), fault="traceback"),
    Case("hf-contradicting-set", (*INIT, "--set", "model.hidden_dim=64"),
         "contradicts the imported model's 32", uses=("hf",), where="model.hidden_dim"),
    Case("hf-many-slashes", ("sample", "a/b/c", "--device", "numpy"),
         "not a folder (want a save_pretrained folder or a Hub id)", where="a/b/c"),
    Case("hf-a-file", ("sample", "hf/config.json", "--device", "numpy"), "checkpoint not found",
         uses=("hf",), where="hf/config.json"),
])

EXPORT = surface("export", [
    Case("export-over-a-transformers-folder", ("export", "run", "--out", "hf"),
         "holds files export did not write (config.json, generation_config.json, "
         "model.safetensors, …)", uses=("run", "hf"), where="hf", fault="data loss"),
    Case("export-over-its-own-export-and-notes", ("export", "run", "--out", "out"),
         "holds files export did not write (notes.md)",
         {"out/.eulergen-export": '{"written_by": "eulergen", "files": ["config.json"]}',
          "out/config.json": "{}", "out/notes.md": "mine"}, uses=("run",), where="out",
         fault="data loss"),
    Case("export-marker-unreadable", ("export", "run", "--out", "out"),
         "holds files export did not write (.eulergen-export, config.json)",
         {"out/.eulergen-export": "[", "out/config.json": "{}"}, uses=("run",), where="out",
         fault="data loss"),
    Case("export-out-is-a-file", ("export", "run", "--out", "notes.txt"),
         "exists and is not a folder", {"notes.txt": "mine"}, uses=("run",), where="--out",
         fault="data loss"),
    Case("export-nan-weights", ("export", "nanrun", "--out", "out"),
         "h.0.ln_1.weight: 32 of its 32 values are NaN or Inf", uses=("nanrun",),
         where="model.safetensors", fault="silent"),
    Case("export-tokenizer-since-changed", ("export", "tokrun", "--out", "out"),
         "is not the tokenizer these weights were trained with",
         {"tok.json": words({"a": 0}, eot=True)}, uses=("tokrun",), where="warning:", code=0,
         new_files=True,
         fault="silent"),
    Case("export-a-gqa-gpt2", ("export", "run", "--out", "out"), "has no grouped-query attention",
         {"run/ckpt_00000002/state.json": json.dumps({"format": 1, "step": 2, "config": {
             "model": {"hidden_dim": 32, "num_heads": 2, "num_kv_heads": 1, "num_layers": 1,
                       "max_seq_len": 16}}})}, uses=("run",), where="model.num_kv_heads",
         fault="silent"),
    Case("export-without-out", ("export", "run"), "Missing option '--out'", uses=("run",),
         where="--out"),
    Case("export-c-over-its-own-export-and-its-build", ("export-c", "run", "--out", "out"),
         "holds files export-c did not write (run_cpu)",
         {"out/.eulergen-export-c": '{"written_by": "eulergen", "files": ["model.c"]}',
          "out/model.c": "//", "out/run_cpu": b"\x7fELF"}, uses=("run",), where="out",
         fault="data loss"),
    Case("export-c-out-is-a-file", ("export-c", "run", "--out", "notes.txt"),
         "exists and is not a folder", {"notes.txt": "mine"}, uses=("run",), where="--out",
         fault="data loss"),
    Case("export-c-nan-weights", ("export-c", "nanrun", "--out", "out"),
         "h.0.ln_1.weight: 32 of its 32 values are NaN or Inf", uses=("nanrun",),
         where="model.safetensors", fault="silent"),
    Case("export-c-without-out", ("export-c", "run"), "Missing option '--out'", uses=("run",),
         where="--out"),
])
