"""Hugging Face in and out: a transformers `save_pretrained` folder of GPT2LMHeadModel or
LlamaForCausalLM (tied embeddings) as an eulergen model config and state dict, and back.

    imported = load_folder(locate("gpt2"))     # a folder, or a Hub id through huggingface_hub
    imported.model        # ModelConfig keys from config.json
    imported.params       # eulergen names and shapes (runtime/model/gpt.py), wte padded
    export_folder(model_cfg, params, tokenizer_json, out)

The layouts, checked against transformers by tests/test_hf.py:
- GPT-2's Conv1D stores weight [in, out]; eulergen's nn.Linear layout is [out, in]: every
  block matrix is transposed. c_attn is q, k, v stacked, as eulergen's.
- Llama's q_proj, k_proj, v_proj stack into c_attn, gate_proj and up_proj into c_fc (the
  swiglu op's first input is the gated one, silu(gate)·up). HF's rotate_half pairs
  element k with k + D/2, as ops/rope.yaml does, at the same frequencies base^(-2k/D), so
  q and k are not permuted.
- wte gets zero rows up to padded_vocab; the model keeps padded ids out of the loss.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eulergen import outputs
from eulergen.errors import EulerError
from eulergen.progress import Bar, hidden
from eulergen.runtime.data.tokenizer import GPT2_VOCAB
from eulergen.runtime.interop.hf_files import (CONFIG, INDEX, OTHER_TOKENIZER_FILES, TOKENIZER,
                                               WEIGHTS, read_tensors, weight_files)
from eulergen.runtime.model.params import padded_vocab
from eulergen.userfiles import Fields, read_json

GPT2, LLAMA = "GPT2LMHeadModel", "LlamaForCausalLM"
# GPT-2's activation_function values and the op of the same function
_GPT2_ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu": "gelu_erf"}
# tensors a folder may hold that are no parameter: GPT-2's causal-mask buffers, old Llama
# checkpoints' rotary frequencies (both recomputed), and the tied head (checked equal to wte)
_IGNORED = re.compile(r"(h\.\d+\.attn\.(masked_)?bias|layers\.\d+\.self_attn\.rotary_emb\.inv_freq)\Z")
_PREFIX = {GPT2: "transformer.", LLAMA: "model."}


@dataclass(frozen=True)
class Imported:
    folder: Path
    architecture: str
    model: dict            # ModelConfig keys
    params: dict           # eulergen parameter name -> float32 array
    tokenizer: Path | None  # the folder's tokenizer.json


def locate(spec: str | Path, key: str = "--init-from") -> Path:
    """A local save_pretrained folder as given, or a Hub id (`gpt2`, `org/name`) fetched
    through huggingface_hub into its cache (offline: what the cache already holds)."""
    path = Path(spec)
    if path.is_dir():
        return path
    if path.exists() or str(spec).startswith((".", "/", "~")) or str(spec).count("/") > 1:
        raise EulerError("not a folder (want a save_pretrained folder or a Hub id)",
                         file=str(spec), key=key)
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise EulerError(f"{spec!r} is no local folder, and a Hub id needs huggingface_hub "
                         "(pip install huggingface_hub)", key=key) from None
    patterns = [CONFIG, "*.safetensors", INDEX, TOKENIZER]
    try:
        return Path(snapshot_download(str(spec), allow_patterns=patterns))
    except Exception as err:  # offline, unknown repo, gated: the library's many error types
        try:
            return Path(snapshot_download(str(spec), allow_patterns=patterns,
                                          local_files_only=True))
        except Exception:
            raise EulerError(f"{spec!r} is no local folder and the Hub download failed "
                             f"({type(err).__name__}); on a machine without access, copy a "
                             "save_pretrained folder here and name its path",
                             key=key) from None


def load_folder(folder: Path, bar: Bar | None = None) -> Imported:
    """Read a folder's config.json and weights; every tensor is checked against the
    config's shapes before anything is returned. `bar` (started by the caller) counts the
    tensors read."""
    folder = Path(folder)
    arch, model = model_config(folder / CONFIG)
    files = weight_files(folder)
    bar = bar or hidden()
    bar.update(total=(bar.total or 0) + len(files), status=f"reading {folder.name}")
    tensors = read_tensors(files, lambda: bar.update(advance=1))
    params = _to_eulergen(arch, model, tensors, files)
    tok = folder / TOKENIZER   # there, but no file (a FIFO, a link to a device): its reader says
    return Imported(folder, arch, model, params, tok if os.path.lexists(tok) else None)


def tokenizer_of(imported: Imported) -> str:
    """The data.tokenizer of an imported folder: its tokenizer.json; GPT-2's own BPE for a
    GPT2LMHeadModel of GPT-2's 50257 ids that comes with no tokenizer files at all; else
    one error saying which files the folder has and which eulergen needs."""
    if imported.tokenizer is not None:   # absolute, its links kept: read and checked as named
        return str(imported.tokenizer.absolute())
    found = sorted(p.name for p in imported.folder.iterdir() if p.name in OTHER_TOKENIZER_FILES)
    if not found and imported.architecture == GPT2 and imported.model["vocab_size"] == GPT2_VOCAB:
        return "gpt2"
    found = ", ".join(found) or "no tokenizer files"
    raise EulerError(f"no tokenizer eulergen reads: found {found}, needs {TOKENIZER} (AutoTokenizer"
                     ".from_pretrained(folder).save_pretrained(folder) writes one; train can name "
                     "one: --set data.tokenizer=…)", file=str(imported.folder))


# -- config.json <-> ModelConfig ------------------------------------------------------------

def model_config(path: Path) -> tuple[str, dict]:
    """(architecture, ModelConfig keys) of a config.json, every field it reads typed and in
    range; EulerError naming the key that eulergen cannot represent."""
    f = Fields(read_json(path, "model config"), str(path))
    archs = f.list("architectures", [])
    arch = archs[0] if len(archs) == 1 else None
    if arch not in (GPT2, LLAMA):
        raise f.error("architectures", f"{archs}: eulergen reads {GPT2} and {LLAMA}")

    def need(key, want, default=None):
        value = f.data.get(key, default)
        if value != want:
            raise f.error(key, f"{value!r}: eulergen supports {want!r} only")

    def size(key, default=..., *, lo: int = 1):
        return f.int(key, lo=lo) if default is ... else f.int(key, default, lo=lo)

    need("tie_word_embeddings", True, True)
    if arch == GPT2:
        act = f.text("activation_function", "gelu_new")
        if act not in _GPT2_ACTIVATIONS:
            raise f.error("activation_function", f"{act!r}: eulergen has "
                                                 f"{', '.join(_GPT2_ACTIVATIONS)}")
        need("scale_attn_weights", True, True)
        need("scale_attn_by_inverse_layer_idx", False, False)
        need("add_cross_attention", False, False)
        d, heads = size("n_embd"), size("n_head")
        model = dict(hidden_dim=d, num_layers=size("n_layer"), num_heads=heads,
                     num_kv_heads=heads, vocab_size=size("vocab_size"),
                     max_seq_len=size("n_positions"), mlp_hidden=size("n_inner", None) or 4 * d,
                     norm="layernorm", activation=_GPT2_ACTIVATIONS[act],
                     attention="causal_attention", positions="learned", bias=True,
                     norm_eps=f.number("layer_norm_epsilon", 1e-5, positive=True))
    else:
        need("hidden_act", "silu", "silu")
        bias = f.flag("attention_bias", False)
        need("mlp_bias", bias, False)
        key = "rope_parameters" if f.data.get("rope_parameters") else "rope_scaling"
        rope = f.fields(key, None)
        kind = rope.text("rope_type", rope.data.get("type", "default"))
        if kind != "default":
            raise f.error(key, f"rope_type {kind!r}: eulergen's rope is the default one")
        heads, d = size("num_attention_heads"), size("hidden_size")
        if size("head_dim", d // heads, lo=0) != d // heads:
            raise f.error("head_dim", f"{f.data['head_dim']}: eulergen's head dim is "
                                      f"hidden_size / num_attention_heads = {d // heads}")
        model = dict(hidden_dim=d, num_layers=size("num_hidden_layers"), num_heads=heads,
                     num_kv_heads=size("num_key_value_heads", None) or heads,
                     vocab_size=size("vocab_size"), max_seq_len=size("max_position_embeddings"),
                     mlp_hidden=size("intermediate_size"), norm="rmsnorm", activation="swiglu",
                     attention="causal_attention", positions="rope",
                     rope_base=rope.number("rope_theta", f.number("rope_theta", 10000.0,
                                                                  positive=True), positive=True),
                     bias=bias, norm_eps=f.number("rms_norm_eps", 1e-6, positive=True))
    return arch, model


def architecture_of(m) -> str:
    """The transformers class a ModelConfig is, or EulerError naming the key that differs."""
    gpt2 = dict(norm="layernorm", positions="learned", bias=True, attention="causal_attention")
    llama = dict(norm="rmsnorm", activation="swiglu", positions="rope",
                 attention="causal_attention")
    if m.norm == "layernorm":
        wanted, arch = gpt2, GPT2
        if m.activation not in _GPT2_ACTIVATIONS.values():
            raise EulerError(f"{m.activation!r}: {GPT2} has gelu or gelu_erf",
                             key="model.activation")
        if m.num_kv_heads != m.num_heads:
            raise EulerError(f"{m.num_kv_heads} KV heads: {GPT2} has no grouped-query "
                             "attention", key="model.num_kv_heads")
    else:
        wanted, arch = llama, LLAMA
    for key, value in wanted.items():
        if getattr(m, key) != value:
            raise EulerError(f"{getattr(m, key)!r}: {arch} has {value!r} (export writes "
                             f"{GPT2}: layernorm, gelu, learned positions, biases; or {LLAMA}: "
                             "rmsnorm, swiglu, rope)", key=f"model.{key}")
    return arch


def hf_config(m, arch: str, eot: int | None) -> dict:
    """config.json for a ModelConfig of architecture `arch`."""
    ids = {"bos_token_id": eot, "eos_token_id": eot}
    if arch == GPT2:
        act = "gelu_new" if m.activation == "gelu" else "gelu"
        return {"architectures": [GPT2], "model_type": "gpt2", "n_embd": m.hidden_dim,
                "n_layer": m.num_layers, "n_head": m.num_heads, "n_inner": m.mlp_hidden,
                "n_positions": m.max_seq_len, "vocab_size": m.vocab_size,
                "activation_function": act, "layer_norm_epsilon": m.norm_eps,
                "tie_word_embeddings": True, "torch_dtype": "float32", **ids}
    return {"architectures": [LLAMA], "model_type": "llama", "hidden_size": m.hidden_dim,
            "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
            "num_key_value_heads": m.num_kv_heads, "head_dim": m.head_dim,
            "intermediate_size": m.mlp_hidden, "max_position_embeddings": m.max_seq_len,
            "vocab_size": m.vocab_size, "hidden_act": "silu", "rms_norm_eps": m.norm_eps,
            "rope_theta": m.rope_base, "attention_bias": m.bias, "mlp_bias": m.bias,
            "tie_word_embeddings": True, "torch_dtype": "float32", **ids}


# -- weights --------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Rule:
    """One eulergen parameter: HF tensors (name, HF shape), transposed each, stacked by row."""
    name: str
    parts: tuple[tuple[str, tuple[int, ...]], ...]
    transpose: bool = False


def _rules(arch: str, m: dict) -> list[_Rule]:
    d, L, F, V = m["hidden_dim"], m["num_layers"], m["mlp_hidden"], m["vocab_size"]
    hd = d // m["num_heads"]
    q, kv = m["num_heads"] * hd, m["num_kv_heads"] * hd
    if arch == GPT2:
        rules = [_Rule("wte.weight", (("wte.weight", (V, d)),)),
                 _Rule("wpe.weight", (("wpe.weight", (m["max_seq_len"], d)),))]
        for i in range(L):
            h = f"h.{i}"
            for ln in ("ln_1", "ln_2"):
                rules += [_Rule(f"{h}.{ln}.{w}", ((f"{h}.{ln}.{w}", (d,)),)) for w in ("weight", "bias")]
            for name, rows, cols in (("attn.c_attn", q + 2 * kv, d), ("attn.c_proj", d, q),
                                     ("mlp.c_fc", F, d), ("mlp.c_proj", d, F)):
                rules.append(_Rule(f"{h}.{name}.weight", ((f"{h}.{name}.weight", (cols, rows)),), True))
                rules.append(_Rule(f"{h}.{name}.bias", ((f"{h}.{name}.bias", (rows,)),)))
        return rules + [_Rule(f"ln_f.{w}", ((f"ln_f.{w}", (d,)),)) for w in ("weight", "bias")]
    rules = [_Rule("wte.weight", (("embed_tokens.weight", (V, d)),))]
    kinds = ("weight", "bias") if m["bias"] else ("weight",)
    for i in range(L):
        h, a = f"h.{i}", f"layers.{i}"
        rules.append(_Rule(f"{h}.ln_1.weight", ((f"{a}.input_layernorm.weight", (d,)),)))
        rules.append(_Rule(f"{h}.ln_2.weight", ((f"{a}.post_attention_layernorm.weight", (d,)),)))
        for kind in kinds:
            def shape(rows, cols):
                return (rows, cols) if kind == "weight" else (rows,)
            rules += [
                _Rule(f"{h}.attn.c_attn.{kind}", tuple((f"{a}.self_attn.{p}_proj.{kind}", shape(n, d))
                                                       for p, n in (("q", q), ("k", kv), ("v", kv)))),
                _Rule(f"{h}.attn.c_proj.{kind}", ((f"{a}.self_attn.o_proj.{kind}", shape(d, q)),)),
                _Rule(f"{h}.mlp.c_fc.{kind}", ((f"{a}.mlp.gate_proj.{kind}", shape(F, d)),
                                                (f"{a}.mlp.up_proj.{kind}", shape(F, d)))),
                _Rule(f"{h}.mlp.c_proj.{kind}", ((f"{a}.mlp.down_proj.{kind}", shape(d, F)),))]
    return rules + [_Rule("ln_f.weight", (("norm.weight", (d,)),))]


def _to_eulergen(arch: str, m: dict, tensors: dict, files: dict) -> dict:
    prefix = _PREFIX[arch]
    bare = {k[len(prefix):] if k.startswith(prefix) else k: k for k in tensors}
    rules = _rules(arch, m)
    embed = rules[0].parts[0][0]
    expected = {name for r in rules for name, _ in r.parts}
    for name, full in bare.items():
        if name in expected or _IGNORED.match(name):
            continue
        if name == "lm_head.weight":
            if not np.array_equal(tensors[full], tensors[bare.get(embed, full)]):
                raise EulerError(f"{full} differs from {prefix}{embed}: an untied LM head "
                                 "(eulergen ties it to the embedding)", file=str(files[full]))
            continue
        raise EulerError(f"unexpected tensor {full}: not a {arch} weight of this config",
                         file=str(files[full]))
    out = {}
    for rule in rules:
        blocks = []
        for name, shape in rule.parts:
            full = bare.get(name)
            if full is None:
                raise EulerError(f"{prefix}{name} is missing", file=str(next(iter(files.values()))))
            t = tensors[full]
            if t.shape != shape:
                raise EulerError(f"{full} has shape {list(t.shape)}, config.json makes it "
                                 f"{list(shape)}", file=str(files[full]))
            blocks.append(t.T if rule.transpose else t)
        out[rule.name] = np.ascontiguousarray(blocks[0] if len(blocks) == 1 else np.concatenate(blocks))
    wte = out["wte.weight"]
    padded = np.zeros((padded_vocab(m["vocab_size"]), wte.shape[1]), dtype=np.float32)
    padded[:len(wte)] = wte
    out["wte.weight"] = padded
    return out


def to_hf(arch: str, m: dict, params: dict, each=None) -> dict:
    """eulergen parameters (wte padded) as the tensors of `arch`'s save_pretrained;
    `each()` after each."""
    prefix, out = _PREFIX[arch], {}
    for rule in _rules(arch, m):
        if each is not None:
            each()
        t = params[rule.name]
        if rule.name == "wte.weight":
            t = t[:m["vocab_size"]]
        start = 0
        for name, shape in rule.parts:
            rows = shape[-1] if rule.transpose else shape[0]
            block = t[start:start + rows]
            start += rows
            out[prefix + name] = np.ascontiguousarray(block.T if rule.transpose else block,
                                                      dtype=np.float32)
    return out


def tokenizer_config(tokenizer_json: bytes, eot: int | None) -> dict:
    """tokenizer_config.json beside a tokenizer.json: AutoTokenizer's class, and the end of
    text as its bos and eos token (GPT-2's convention)."""
    from tokenizers import Tokenizer
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    if eot is not None:
        token = Tokenizer.from_str(tokenizer_json.decode("utf-8")).id_to_token(eot)
        config.update(bos_token=token, eos_token=token)
    return config


def export_folder(model_cfg, params: dict, out: Path, *, tokenizer_files: dict | None = None,
                  eot: int | None = None, bar: Bar | None = None) -> str:
    """Write a folder transformers.AutoModelForCausalLM.from_pretrained loads (plus the
    tokenizer files given, name -> bytes); returns the architecture written. `bar`
    (started by the caller) counts the tensors converted, then says what is written."""
    from safetensors.numpy import save_file
    arch = architecture_of(model_cfg)
    bar = bar or hidden()
    bar.update(total=(bar.total or 0) + len(params), status="converting")
    tensors = to_hf(arch, dataclasses.asdict(model_cfg), params, lambda: bar.update(advance=1))
    bar.update(status=f"writing {out}")
    files = {CONFIG: json.dumps(hf_config(model_cfg, arch, eot), indent=2).encode(),
             WEIGHTS: lambda path: save_file(tensors, str(path), metadata={"format": "pt"}),
             **(tokenizer_files or {})}
    # a folder another tool wrote (transformers' own save) is refused, never replaced
    outputs.replace_folder(out, files, by="export", key="--out")
    return arch


def run_overrides(imported: Imported, given, overrides) -> list[str]:
    """The `--set` items, to come before the user's, that make a run the imported model's:
    every model key from config.json, and the folder's tokenizer (`tokenizer_of`) when the
    run names none. `given` is the config resolved from them and the user's `overrides`: a
    model key the user set to another value than config.json's is an error."""
    for item in overrides:
        key = item.partition("=")[0].strip()
        section, _, name = key.partition(".")
        if section == "model" and name in imported.model:
            mine, theirs = getattr(given.model, name), imported.model[name]
            if mine != theirs:
                raise EulerError(f"--set {item} contradicts the imported model's {theirs!r} "
                                 f"({imported.folder / CONFIG})", key=key)
    named = given.data.tokenizer != "byte" or any(
        item.partition("=")[0].strip() in ("data.tokenizer", "data.tokenizer_path")
        for item in overrides)
    return model_sets(imported) + ([] if named else [f"data.tokenizer={tokenizer_of(imported)}"])


def model_sets(imported: Imported) -> list[str]:
    return [f"model.{k}={v}" for k, v in imported.model.items()]
