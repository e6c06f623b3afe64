"""Hugging Face in and out (runtime/interop/hf.py, hf_files.py, evaluate.py, the tokenizer forms):
small random transformers models, GPT-2's and Llama's, with GPT-2's vocabulary of 50257
and a small one, on the numpy backend against transformers on the CPU.

Tolerances: the loss and gradients are the same fp32 function computed in another order
(BLAS blocking, the flash-style attention's online softmax, the layer-norm reductions), a
few ulps per op: measured within 1e-6 of each gradient's largest entry; a swapped,
untransposed or misrouted tensor is off by O(1). So 1e-5 (∞-norm relative) per gradient
and 1e-5 relative on the loss; logits after export within 1e-4 absolute (the issue's bar).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from eulergen import PACKAGE_DIR
from eulergen.cli import main
from eulergen.runtime.interop import hf
from eulergen.runtime.data import tokenizer as T
from eulergen.runtime.engine.backend import get_backend
from eulergen.runtime.train.config import config_from_dict
from eulergen.runtime.train.evaluate import evaluate, open_model
from eulergen.runtime.model.gpt import build
from eulergen.runtime.engine.ops import OpLibrary
from bad_inputs.case import words
from runs import first_loss

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-5
B, S = 2, 16
CASES = [("gpt2", 50257), ("gpt2", 97), ("llama", 50257), ("llama", 97)]


@pytest.fixture(scope="module")
def lib():
    return OpLibrary(get_backend("numpy"))


def hf_model(kind: str, vocab: int, seed: int = 0):
    """A random transformers model, eval mode, norm weights and biases moved off 1 and 0
    (so a gradient routed to the wrong one shows)."""
    torch.manual_seed(seed)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=vocab,
                                         n_positions=S, bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=S,
            tie_word_embeddings=True, rope_theta=500.0, rms_norm_eps=1e-5,
            bos_token_id=0, eos_token_id=0)
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def word_tokenizer(folder: Path, vocab: int) -> None:
    """A WordLevel tokenizer.json of `vocab` ids (<|endoftext|> the last) in `folder`: an HF
    folder without a tokenizer eulergen reads is refused."""
    (folder / hf.TOKENIZER).write_text(words({f"w{i}": i for i in range(vocab - 1)}, eot=True))


def saved(tmp_path_factory, kind, vocab, **config):
    folder = tmp_path_factory.mktemp(f"{kind}{vocab}")
    model = hf_model(kind, vocab)
    for key, value in config.items():
        setattr(model.config, key, value)
    model.save_pretrained(folder)
    return folder, model


def tokens(vocab, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, vocab, (B, S))
    x[0, :4] = 5   # repeated ids: the embedding's scatter adds them
    return x, rng.integers(0, vocab, (B, S))


def eulergen_model(lib, model_keys: dict, params: dict, training=True):
    cfg = config_from_dict({"model": model_keys})
    model = build(cfg.model, lib, B, S, training=training)
    model.load_state_dict(params)
    return cfg, model


@pytest.mark.parametrize("kind,vocab", CASES)
def test_loss_and_every_gradient_equal_transformers(tmp_path_factory, lib, kind, vocab):
    folder, ref = saved(tmp_path_factory, kind, vocab)
    imported = hf.load_folder(folder)
    _, model = eulergen_model(lib, imported.model, imported.params)
    x, y = tokens(vocab)
    model.load_tokens(x, y)
    loss = float(model.loss_and_grad()[0])

    logits = ref(torch.as_tensor(x)).logits
    ref_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), torch.as_tensor(y).reshape(-1))
    ref_loss.backward()
    assert loss == pytest.approx(ref_loss.item(), rel=TOL)
    # eulergen's gradients in HF's layout (the export mapping), against HF's own
    ours = hf.to_hf(imported.architecture, imported.model, dict(model.grads))
    theirs = {n: p.grad.numpy() for n, p in ref.named_parameters()}
    assert ours.keys() == theirs.keys()
    worst = {n: np.abs(ours[n] - g).max() / np.abs(g).max() for n, g in theirs.items()}
    assert max(worst.values()) < TOL, {n: f"{e:.1e}" for n, e in worst.items() if e >= TOL}
    assert not model.grads["wte.weight"][vocab:].any(), "padded rows get no gradient"


@pytest.mark.parametrize("kind,vocab", CASES)
def test_import_then_export_is_bit_exact(tmp_path_factory, kind, vocab):
    folder, _ = saved(tmp_path_factory, kind, vocab)
    imported = hf.load_folder(folder)
    cfg = config_from_dict({"model": imported.model})
    out = folder.parent / f"{folder.name}-out"
    assert hf.export_folder(cfg.model, imported.params, out) == imported.architecture
    from safetensors.numpy import load_file
    before, after = load_file(folder / hf.WEIGHTS), load_file(out / hf.WEIGHTS)
    assert before.keys() == after.keys()
    for name in before:
        assert before[name].tobytes() == after[name].tobytes(), name


def _trained_like(lib, preset_keys: dict, vocab: int):
    """An eulergen model of its own (random weights, norms off 1): what a run exports."""
    keys = {**preset_keys, "vocab_size": vocab, "max_seq_len": S}
    cfg = config_from_dict({"model": keys})
    model = build(cfg.model, lib, B, S, training=False)
    model.init_weights(3)
    rng = np.random.default_rng(4)
    model.load_state_dict({k: v + rng.normal(0, 0.1, v.shape).astype(np.float32) if v.ndim == 1
                           else v for k, v in model.state_dict().items()})
    return cfg, model


GPT2_KEYS = dict(preset="gpt2", hidden_dim=32, num_layers=2, num_heads=2, mlp_hidden=64)
LLAMA_KEYS = dict(preset="nanoeuler", hidden_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  mlp_hidden=48)


@pytest.mark.parametrize("keys", [GPT2_KEYS, LLAMA_KEYS], ids=["gpt2", "llama"])
@pytest.mark.parametrize("vocab", [50257, 97])
def test_export_loads_in_transformers_with_equal_logits(tmp_path, lib, keys, vocab):
    cfg, model = _trained_like(lib, keys, vocab)
    hf.export_folder(cfg.model, model.state_dict(), tmp_path / "out")
    ref, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out",
                                                                  output_loading_info=True)
    assert not any(info.values()), info   # no missing, unexpected or mismatched weights
    x, _ = tokens(vocab)
    model.load_tokens(x)
    ours = np.asarray(model.logits())[..., :vocab]
    with torch.no_grad():
        theirs = ref.eval()(torch.as_tensor(x)).logits.numpy()
    assert np.abs(ours - theirs).max() <= 1e-4


def test_sharded_weights_load_like_one_file(tmp_path_factory):
    folder, model = saved(tmp_path_factory, "llama", 97)
    sharded = folder.parent / "sharded"
    model.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / hf.INDEX).is_file()
    one, many = hf.load_folder(folder).params, hf.load_folder(sharded).params
    assert one.keys() == many.keys() and all(np.array_equal(one[k], many[k]) for k in one)


# -- bad input: one line naming the file and the tensor, nothing written ---------------------

@pytest.fixture
def gpt2_folder(tmp_path_factory):
    folder = saved(tmp_path_factory, "gpt2", 97)[0]
    word_tokenizer(folder, 97)
    return folder


def _fails(tmp_path, folder, *extra):
    run = tmp_path / "run"
    result = CliRunner().invoke(main, ["train", "--init-from", str(folder), "--run-dir", str(run),
                                       "--device", "numpy", *extra])
    assert result.exit_code == 2, result.output
    assert not run.exists(), "nothing written to the run folder"
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


def test_another_architecture_is_refused(tmp_path, gpt2_folder):
    config = json.loads((gpt2_folder / hf.CONFIG).read_text())
    (gpt2_folder / hf.CONFIG).write_text(json.dumps({**config, "architectures": ["BertForMaskedLM"]}))
    line = _fails(tmp_path, gpt2_folder)
    assert "config.json" in line and "BertForMaskedLM" in line


def test_a_truncated_weights_file_names_the_tensor(tmp_path, gpt2_folder):
    weights = gpt2_folder / hf.WEIGHTS
    weights.write_bytes(weights.read_bytes()[:-100])
    line = _fails(tmp_path, gpt2_folder)
    assert "model.safetensors" in line and "truncated: transformer." in line


def test_a_config_that_disagrees_with_the_weights_names_the_tensor(tmp_path, gpt2_folder):
    config = json.loads((gpt2_folder / hf.CONFIG).read_text())
    (gpt2_folder / hf.CONFIG).write_text(json.dumps({**config, "n_positions": 32}))
    line = _fails(tmp_path, gpt2_folder)
    assert "transformer.wpe.weight has shape [16, 32], config.json makes it [32, 32]" in line


def test_an_index_naming_a_missing_shard_names_file_and_tensor(tmp_path, gpt2_folder):
    (gpt2_folder / hf.WEIGHTS).rename(gpt2_folder / "model-00001-of-00002.safetensors")
    (gpt2_folder / hf.INDEX).write_text(json.dumps({"weight_map": {
        "transformer.wte.weight": "model-00001-of-00002.safetensors",
        "transformer.ln_f.weight": "model-00002-of-00002.safetensors"}}))
    line = _fails(tmp_path, gpt2_folder)
    assert "model.safetensors.index.json" in line
    assert "transformer.ln_f.weight is in model-00002-of-00002.safetensors, which is missing" in line


def test_an_untied_head_is_refused(tmp_path_factory, tmp_path):
    folder, _ = saved(tmp_path_factory, "llama", 97)
    config = json.loads((folder / hf.CONFIG).read_text())
    (folder / hf.CONFIG).write_text(json.dumps({**config, "tie_word_embeddings": False}))
    assert "tie_word_embeddings: False: eulergen supports True only" in _fails(tmp_path, folder)


def test_a_contradicting_set_is_refused(tmp_path, gpt2_folder):
    line = _fails(tmp_path, gpt2_folder, "--set", "model.hidden_dim=64")
    assert "--set model.hidden_dim=64 contradicts the imported model's 32" in line


def test_export_never_writes_over_foreign_files(tmp_path, gpt2_folder):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    result = CliRunner().invoke(main, ["export", str(gpt2_folder), "--out", str(out)])
    assert result.exit_code == 2 and "holds files export did not write (notes.txt)" in result.output
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


# -- the run: fine-tune, export, eval, sample -----------------------------------------------

def test_fine_tune_export_eval_sample_end_to_end(tmp_path_factory, tmp_path, lib):
    folder, _ = saved(tmp_path_factory, "gpt2", 256)
    (folder / hf.TOKENIZER).write_bytes(T.hf_tokenizer_json(T.ByteTokenizer()))
    run, out, data = tmp_path / "run", tmp_path / "out", tmp_path / "data"
    cli = CliRunner()
    (tmp_path / "text.txt").write_bytes((PACKAGE_DIR / "runtime" / "data" / "loader.py").read_bytes())
    result = cli.invoke(main, ["prepare", str(tmp_path / "text.txt"), "--out", str(data),
                               "--tokenizer", str(folder / hf.TOKENIZER), "--val-tokens", "400",
                               "--quiet"])   # the data in the folder's own tokenizer
    assert result.exit_code == 0, result.output
    result = cli.invoke(main, ["train", "--init-from", str(folder), "--run-dir", str(run),
                               "--set", f"data.dataset={data}/data_train_*.bin",
                               "--device", "numpy", "--set", "training.total_steps=2",
                               "--set", "training.warmup_steps=1", "--set", "training.batch_size=2",
                               "--set", "training.eval_every=0", "--set", "training.sample_tokens=0"])
    assert result.exit_code == 0, result.output
    saved_cfg = json.loads((run / "config.json").read_text())
    assert saved_cfg["data"]["tokenizer"] == str((folder / hf.TOKENIZER).resolve())
    assert saved_cfg["model"]["hidden_dim"] == 32 and saved_cfg["model"]["vocab_size"] == 256

    result = cli.invoke(main, ["export", str(run), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert {p.name for p in out.iterdir()} == {hf.CONFIG, hf.WEIGHTS, hf.TOKENIZER,
                                              "tokenizer_config.json", ".eulergen-export"}
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("héllo")["input_ids"] == list("héllo".encode())
    assert (tok.eos_token, tok.eos_token_id) == (T.ENDOFTEXT, T.BYTE_EOT)

    val = f"{data}/data_val_000000.bin"
    result = cli.invoke(main, ["eval", str(run), "--data", val, "--batch-size", "2",
                               "--max-batches", "2", "--device", "numpy"])
    assert result.exit_code == 0, result.output
    expected = evaluate(open_model(run, "numpy"), lib, val, batch=2, seq=S, max_batches=2)
    assert result.output.strip().startswith(f"loss {expected.loss:.4f}  perplexity {expected.perplexity:.3f}")

    result = cli.invoke(main, ["sample", str(out), "--prompt", "ab", "--max-new-tokens", "3",
                               "--device", "numpy"])
    assert result.exit_code == 0 and result.output.startswith("ab"), result.output


def test_a_resume_before_the_first_checkpoint_starts_again_from_the_imported_weights(
        tmp_path_factory, tmp_path, monkeypatch):
    from eulergen.runtime.train.trainer import Trainer
    folder, _ = saved(tmp_path_factory, "gpt2", 256)
    short = ["--device", "numpy", "--set", "training.total_steps=2", "--set",
             "training.warmup_steps=1", "--set", "training.batch_size=2", "--set",
             "training.eval_every=0", "--set", "training.sample_tokens=0",
             "--set", "data.tokenizer=byte"]   # the folder has none: builtin:stdlib's bytes
    cli = CliRunner()

    whole = tmp_path / "whole"
    assert cli.invoke(main, ["train", "--init-from", str(folder), "--run-dir", str(whole),
                             *short]).exit_code == 0
    killed = tmp_path / "killed"

    def killed_at_the_first_step(self):
        raise KeyboardInterrupt
    with monkeypatch.context() as m:
        m.setattr(Trainer, "train_step", killed_at_the_first_step)
        cli.invoke(main, ["train", "--init-from", str(folder), "--run-dir", str(killed), *short])
    assert (killed / "config.json").is_file() and not list(killed.glob("ckpt_*"))
    result = cli.invoke(main, ["train", "--resume", str(killed), "--device", "numpy"])
    assert result.exit_code == 0, result.output
    assert first_loss(killed) == first_loss(whole)
    fresh = tmp_path / "fresh"   # the same model from its seed: another first loss
    keys = [f"--set=model.{k}={v}" for k, v in hf.load_folder(folder).model.items()]
    assert cli.invoke(main, ["train", "--run-dir", str(fresh), *keys, *short]).exit_code == 0
    assert first_loss(fresh) != first_loss(whole)


def test_eval_is_the_mean_loss_transformers_gives(tmp_path_factory, tmp_path, lib):
    folder, ref = saved(tmp_path_factory, "llama", 97)
    word_tokenizer(folder, 97)
    data = tmp_path / "d_val_000000.bin"
    from eulergen.runtime.data.loader import write_shard
    ids = np.random.default_rng(5).integers(0, 97, 4 * S + 1)
    write_shard(data, ids)
    result = evaluate(open_model(folder, "numpy"), lib, str(data), batch=2, seq=S)
    windows = torch.as_tensor(np.stack([ids[i:i + S + 1] for i in range(0, 4 * S, S)]))
    with torch.no_grad():
        logits = ref(windows[:, :-1]).logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, 97), windows[:, 1:].reshape(-1))
    assert result.tokens == 4 * S
    assert result.loss == pytest.approx(want.item(), rel=TOL)
