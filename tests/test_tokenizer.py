"""Tokenizers: byte level, GPT-2 through tiktoken (a small Encoding built here, no
download), HF tokenizer.json, `eulergen tokenizer train`, the config keys that name them,
and the vocab check at train start."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from eulergen.cli import main
from eulergen.errors import EulerError
from eulergen.runtime.data import tokenizer as T
from eulergen.runtime.engine.backend import NUMPY
from eulergen.runtime.train.config import config_from_dict, load_config
from eulergen.runtime.engine.ops import OpLibrary
from eulergen.runtime.data.tokenizer import (ENDOFTEXT, ByteTokenizer, HFTokenizer, check_fits,
                                        hf_tokenizer_json, load_tokenizer, tokenizer_named,
                                        train_bpe)
from eulergen.runtime.train.trainer import Trainer

tokenizers = pytest.importorskip("tokenizers")

TEXT = "def f(x):\n    return 'é∂' + x  # a comment\n"
CORPUS = [f"def function_{i}(value):\n    return value * {i} + offset\n" for i in range(200)]


def _data(**given):
    return load_config(None, [f"data.{k}={v}" for k, v in given.items()]).data


def _word_level_json(path, words):
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0])
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def test_byte_tokenizer_round_trips_utf8_and_ends_documents_with_byte_0():
    tok = load_tokenizer(_data())
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256 and tok.eot == 0
    assert tok.decode(tok.encode(TEXT)) == TEXT


def test_the_byte_tokenizer_exports_with_its_end_of_text_named(tmp_path):
    (tmp_path / "tok.json").write_bytes(hf_tokenizer_json(ByteTokenizer()))
    byte, back = ByteTokenizer(), HFTokenizer(tmp_path / "tok.json")
    assert (back.vocab_size, back.eot) == (byte.vocab_size, byte.eot) == (256, 0)
    assert back.encode(TEXT) == byte.encode(TEXT)
    ids = byte.encode(TEXT) + [byte.eot] + byte.encode("end")
    assert back.decode(ids) == byte.decode(ids) == TEXT + "end"


def test_hf_tokenizer_json_with_its_end_of_text_id(tmp_path):
    path = _word_level_json(tmp_path / "tok.json", ["[UNK]", "hello", "world", ENDOFTEXT])
    tok = load_tokenizer(_data(tokenizer=path))
    assert (tok.vocab_size, tok.eot) == (4, 3)
    assert tok.encode("hello world") == [1, 2]
    assert tok.decode([1, 2]) == "hello world"
    assert tok.digest.startswith("sha256:")


def test_hf_tokenizer_names_the_first_text_it_can_only_encode_as_unknown(tmp_path):
    path = _word_level_json(tmp_path / "tok.json", ["[UNK]", "hello", "world", ENDOFTEXT])
    tok = HFTokenizer(path)
    assert tok.unknown("hello world") is None
    assert tok.unknown("hello there world") == 6


def test_missing_tokenizer_file_is_one_line_error(tmp_path):
    with pytest.raises(EulerError) as err:
        load_tokenizer(_data(tokenizer=tmp_path / "tok.json"))
    assert str(err.value) == f"{tmp_path / 'tok.json'}: data.tokenizer: tokenizer file not found"


def test_a_file_that_is_not_a_tokenizer_json_is_one_line_error(tmp_path):
    (tmp_path / "tok.json").write_text('{"model": 3}')
    with pytest.raises(EulerError, match=r"tok.json: data.tokenizer: not a tokenizers JSON file"):
        tokenizer_named(str(tmp_path / "tok.json"))


def _small_gpt2_encoding(tiktoken):
    """GPT-2's split pattern over the 256 bytes, two merges and <|endoftext|> after them."""
    from tiktoken_ext.openai_public import r50k_pat_str
    ranks = {bytes([i]): i for i in range(256)}
    ranks.update({b"re": 256, b"ret": 257})
    return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={ENDOFTEXT: 258})


def test_gpt2_through_tiktoken(monkeypatch):
    tiktoken = pytest.importorskip("tiktoken")
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: _small_gpt2_encoding(tiktoken))
    tok = load_tokenizer(_data(tokenizer="gpt2"))
    assert (tok.name, tok.vocab_size, tok.eot) == ("gpt2", 259, 258)
    ids = tok.encode(TEXT)
    assert 257 in ids and tok.decode(ids) == TEXT
    # a document that spells the special token is text: only prepare writes boundaries
    assert 258 not in tok.encode(f"a {ENDOFTEXT} b")


def test_gpt2_without_network_says_how_to_get_the_bpe_files(monkeypatch, tmp_path):
    tiktoken = pytest.importorskip("tiktoken")
    import tiktoken.load
    import tiktoken.registry

    def unreachable(url):
        raise ConnectionError(f"cannot resolve host of {url}")
    monkeypatch.setattr(tiktoken.load, "read_file", unreachable)
    monkeypatch.delitem(tiktoken.registry.ENCODINGS, "gpt2", raising=False)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    constants = pytest.importorskip("huggingface_hub.constants")   # and no GPT-2 in its cache
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(EulerError) as err:
        load_tokenizer(_data(tokenizer="gpt2"))
    message = str(err.value)
    assert message.startswith("data.tokenizer: no 'gpt2' BPE files here: tiktoken could not "
                              "download them (ConnectionError)")
    assert "TIKTOKEN_CACHE_DIR" in message and "tokenizer.json" in message and "\n" not in message


def test_nanoeuler_tokenizer_path_is_the_tokenizer():
    data = _data(tokenizer_path="tok/gpt2.json")
    assert data.tokenizer == "tok/gpt2.json"
    assert load_config(None, ["data.tokenizer=t.json", "data.tokenizer_path=t.json"]).data.tokenizer == "t.json"
    assert _data().tokenizer == "byte"
    assert load_config("config/gpt2-small.json").data.tokenizer == "gpt2"
    assert load_config("config/nanoeuler.json").data.tokenizer == "gpt2"


@pytest.mark.parametrize("overrides, message", [
    (["data.tokenizer=gpt2", "data.tokenizer_path=t.json"],
     "--set: data.tokenizer: 'gpt2' and data.tokenizer_path 't.json' name different tokenizers: "
     "give one of them"),
    (["data.tokenizer=gtp2"],
     "--set: data.tokenizer: 'gtp2' is not byte, gpt2 or a path to a tokenizer .json "
     "(did you mean 'gpt2'?)"),
])
def test_bad_tokenizer_settings_are_one_line_errors(overrides, message):
    with pytest.raises(EulerError) as err:
        load_config(None, overrides)
    assert str(err.value) == message


def test_tokenizer_larger_than_the_model_vocab_fails_at_train_start(tmp_path):
    words = ["[UNK]", *(f"w{i}" for i in range(299))]
    path = _word_level_json(tmp_path / "big.json", words)
    cfg = load_config(None, [f"data.tokenizer={path}", f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(EulerError) as err:
        Trainer(cfg, OpLibrary(NUMPY), progress=False, tensorboard=False)
    assert str(err.value) == (f"model.vocab_size: tokenizer {path} has 300 ids, more than "
                              "model.vocab_size 256: set model.vocab_size to at least 300")
    assert not (tmp_path / "run").exists()
    check_fits(load_tokenizer(cfg.data), 300)


def test_trained_bpe_round_trips_and_ends_documents_with_endoftext(tmp_path):
    tok = train_bpe(CORPUS, 300, tmp_path / "tok.json")
    assert tok.vocab_size == 300 and tok.eot is not None
    assert tok.decode([tok.eot]) == "" and tok.eot == tok._tok.token_to_id(ENDOFTEXT)
    for text in (TEXT, CORPUS[7], "unseen: ∑ ünïcode 🙂\n"):
        assert tok.decode(tok.encode(text)) == text
    # merges were learned: the corpus's words take fewer ids than bytes
    assert len(tok.encode(CORPUS[7])) < len(CORPUS[7].encode()) / 2
def test_tokenizer_train_cli_writes_a_json_that_data_tokenizer_uses(tmp_path):
    for i in range(3):
        (tmp_path / f"doc{i}.txt").write_text("".join(CORPUS[i::3]))
    (tmp_path / "more.jsonl").write_text(json.dumps({"text": TEXT}) + "\n")
    out = tmp_path / "tok.json"
    got = CliRunner().invoke(main, ["tokenizer", "train", "--vocab-size", "320", "--out",
                                    str(out), str(tmp_path / "doc0.txt"), str(tmp_path / "doc1.txt"),
                                    str(tmp_path / "doc2.txt"), str(tmp_path / "more.jsonl")])
    assert got.exit_code == 0, got.output
    assert f"--set data.tokenizer={out}" in got.output
    tok = load_tokenizer(_data(tokenizer=out))
    assert tok.vocab_size == 320 and tok.decode(tok.encode(TEXT)) == TEXT
    assert not list(tmp_path.glob(".tok.json.*"))   # written atomically: no temp left


def test_tokenizer_train_refuses_a_vocab_below_the_bytes(tmp_path):
    (tmp_path / "a.txt").write_text(TEXT)
    got = CliRunner().invoke(main, ["tokenizer", "train", "--vocab-size", "100",
                                    "--out", str(tmp_path / "t.json"), str(tmp_path / "a.txt")])
    assert got.exit_code == 2
    assert got.output.strip() == ("error: --vocab-size: --vocab-size 100 is below 257 (256 bytes "
                                  f"and {ENDOFTEXT})")


def test_tokenizer_train_refuses_an_absurd_vocab_before_training(tmp_path):
    (tmp_path / "a.txt").write_text(TEXT)
    got = CliRunner().invoke(main, ["tokenizer", "train", "--vocab-size", "100000000000",
                                    "--out", str(tmp_path / "t.json"), str(tmp_path / "a.txt")])
    assert got.exit_code == 2
    assert got.output.strip() == ("error: --vocab-size: --vocab-size 100,000,000,000 is above "
                                  "1,048,576")
    assert not (tmp_path / "t.json").exists()


def test_tokenizer_train_refuses_a_folder_as_out(tmp_path):
    (tmp_path / "a.txt").write_text(TEXT)
    got = CliRunner().invoke(main, ["tokenizer", "train", "--vocab-size", "300",
                                    "--out", str(tmp_path), str(tmp_path / "a.txt")])
    assert got.exit_code == 2
    assert got.output.strip() == (f"error: {tmp_path}: --out: a folder: tokenizer train "
                                  "writes a new file, never over anything")


# -- GPT-2's BPE between tiktoken and Hugging Face, a tokenizer folder ------------------------

FORMS_TEXT = "def f(x):\n    return x  # héllo wörld, 日本\n\n  \t end"


def _gpt2_shaped_json(path: Path) -> Path:
    """A byte-level BPE with GPT-2's shape (ids 0-50255 the BPE, merge n making id 256 + n,
    <|endoftext|> = 50256); GPT-2's own files are not reachable from the tests."""
    import tokenizers as tk
    chars = T.byte_chars()
    vocab = {c: i for i, c in enumerate(chars)}
    merges = []
    for a in chars:
        for b in chars:
            if len(vocab) < 50256:
                vocab[a + b] = len(vocab)
                merges.append((a, b))
    for a, b in [("Ġ", "r"), ("Ġr", "e")]:   # longer tokens too: "Ġre" made from "Ġr"
        if a + b not in vocab:
            merges.append((a, b))
    tok = tk.Tokenizer(tk.models.BPE(vocab, merges[:50000]))
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    tok.add_special_tokens([T.ENDOFTEXT])
    tok.save(str(path))
    return path


def test_gpt2_works_offline_from_the_hub_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants
    import tiktoken

    def offline(name):
        raise ConnectionError("no network")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(EulerError, match="TIKTOKEN_CACHE_DIR .* Hugging Face cache") as err:
        T.tokenizer_named("gpt2")
    assert "\n" not in str(err.value)
    repo = tmp_path / "models--openai-community--gpt2"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc")
    (repo / "snapshots" / "abc").mkdir(parents=True)
    path = _gpt2_shaped_json(repo / "snapshots" / "abc" / "tokenizer.json")
    tok = T.tokenizer_named("gpt2")
    assert (tok.name, tok.vocab_size, tok.eot, tok.digest) == ("gpt2", 50257, 50256, "tiktoken:gpt2")
    assert tok.encode(FORMS_TEXT) == T.HFTokenizer(path).encode(FORMS_TEXT)
    assert tok.decode(tok.encode(FORMS_TEXT)) == FORMS_TEXT


def test_a_tokenizer_folder_is_its_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_bytes(T.hf_tokenizer_json(T.ByteTokenizer()))
    tok = T.tokenizer_named(str(tmp_path))
    assert tok.encode(FORMS_TEXT) == list(FORMS_TEXT.encode())
    cfg = config_from_dict({"data": {"tokenizer": str(tmp_path)}})
    assert cfg.data.tokenizer == str(tmp_path / "tokenizer.json")


def test_a_tiktoken_bpe_exports_as_a_tokenizer_json_with_the_same_ids(tmp_path):
    import tiktoken
    trained = T.train_bpe([FORMS_TEXT * 3, "return the results, re-read them"] * 20, 400, tmp_path / "t.json")
    byte_of = {c: b for b, c in enumerate(T.byte_chars())}
    ranks = {bytes(byte_of[c] for c in t): i for t, i in trained._tok.get_vocab().items()
             if t != T.ENDOFTEXT}
    enc = tiktoken.Encoding("t", pat_str=r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
                            mergeable_ranks=ranks, special_tokens={T.ENDOFTEXT: trained.eot})
    (tmp_path / "back.json").write_bytes(T.byte_level_bpe_json(ranks, {T.ENDOFTEXT: trained.eot}))
    back = T.HFTokenizer(tmp_path / "back.json")
    assert back.encode(FORMS_TEXT) == enc.encode_ordinary(FORMS_TEXT) == trained.encode(FORMS_TEXT)
    assert back.eot == trained.eot

