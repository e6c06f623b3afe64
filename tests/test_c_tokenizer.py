"""export-c's C tokenizer (templates/c/tokenizer.c over the tokenizer.bin c_tokenizer.py
writes) against the Python tokenizers it stands for: the byte tokenizer, a BPE trained by
`eulergen tokenizer train` (Hugging Face's ByteLevel, GPT-2's pre-tokenizer) and a tiktoken
BPE of the same ranks, on text with contractions, digits, runs of spaces, tabs and
newlines, accents, CJK and emoji: the same ids, and their bytes the text again."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from eulergen import TEMPLATES_DIR
from eulergen.errors import EulerError
from eulergen.runtime.data import tokenizer as T
from eulergen.runtime.interop.c_tokenizer import tokenizer_bytes

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
tokenizers = pytest.importorskip("tokenizers")
HERE = Path(__file__).parent

TEXTS = ["def f(x):\n    return x  # héllo wörld, 日本\n\n  \t end",
         "I'm sure they'll say we've done it; don't they'd?  'quoted' O'Neil's",
         "1234 5678.9 ½ x²   \n\n\n trailing   ", "emoji 😀👍🏽 and ∂y/∂x = αβγ", "a\r\nb\tc\u00a0d"]
CORPUS = [t * 3 for t in TEXTS] + [f"def function_{i}(value):\n    return value * {i}\n"
                                   for i in range(100)]


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    out = tmp_path_factory.mktemp("tokenize") / "tokenize"
    c = TEMPLATES_DIR / "c"
    done = subprocess.run(["cc", "-std=c11", "-O2", "-Wall", "-Werror", f"-I{c}",
                           str(HERE / "c" / "tokenize.c"), str(c / "tokenizer.c"),
                           str(c / "error.c"), "-o", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return out


def _c(harness, tok, tmp_path) -> list[tuple[list[int], bytes]]:
    """(ids, their bytes) of each of TEXTS by the C tokenizer of `tok`."""
    (tmp_path / "tokenizer.bin").write_bytes(tokenizer_bytes(tok))
    done = subprocess.run([str(harness), str(tmp_path / "tokenizer.bin"), *TEXTS],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split("\n")
    return [([int(i) for i in lines[2 * n].split()], bytes.fromhex(lines[2 * n + 1]))
            for n in range(len(TEXTS))]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return T.train_bpe(CORPUS, 400, tmp_path_factory.mktemp("bpe") / "bpe.json")


def test_the_byte_tokenizer(harness, tmp_path):
    for text, (ids, back) in zip(TEXTS, _c(harness, T.ByteTokenizer(), tmp_path)):
        assert ids == T.ByteTokenizer().encode(text) and back == text.encode()


def test_a_trained_byte_level_bpe(harness, trained, tmp_path):
    got = _c(harness, trained, tmp_path)
    for text, (ids, back) in zip(TEXTS, got):
        assert ids == trained.encode(text), text
        assert back == text.encode()
    assert max(max(ids) for ids, _ in got) >= 256, "merges were used"


def test_a_tiktoken_bpe(harness, trained, tmp_path):
    import tiktoken
    from tiktoken_ext.openai_public import r50k_pat_str
    byte_of = {c: b for b, c in enumerate(T.byte_chars())}
    ranks = {bytes(byte_of[c] for c in t): i for t, i in trained._tok.get_vocab().items()
             if t != T.ENDOFTEXT}
    tok = T.TiktokenTokenizer.__new__(T.TiktokenTokenizer)   # GPT-2's own is not reachable
    tok._enc = tiktoken.Encoding("t", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                                 special_tokens={T.ENDOFTEXT: trained.eot})
    tok.name, tok.vocab_size, tok.eot = "t", tok._enc.n_vocab, trained.eot
    for text, (ids, back) in zip(TEXTS, _c(harness, tok, tmp_path)):
        assert ids == tok.encode(text), text
        assert back == text.encode()


def test_a_tokenizer_that_is_no_byte_level_bpe_is_refused(tmp_path):
    model = tokenizers.models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")
    word = tokenizers.Tokenizer(model)
    word.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    word.save(str(tmp_path / "words.json"))
    with pytest.raises(EulerError, match="GPT-2's byte-level BPE") as err:
        tokenizer_bytes(T.HFTokenizer(tmp_path / "words.json"))
    assert err.value.key == "data.tokenizer"
