"""Tokenizers: byte level, GPT-2 BPE through tiktoken, any Hugging Face tokenizer.json,
and training a byte-level BPE of one's own.

Every tokenizer has `name`, `vocab_size`, `eot` (the end-of-text id prepare writes before
each document, or None), `digest` (what identifies it in a prepared folder's manifest),
`encode(str) -> list[int]` and `decode(ids) -> str`. Libraries are imported only when used.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable, Protocol

from eulergen.errors import EulerError
from eulergen.files import write_atomic

BYTE, GPT2 = "byte", "gpt2"
BYTE_EOT = 0   # byte 0 never occurs in text: builtin:stdlib ends each file with it
ENDOFTEXT = "<|endoftext|>"
# Names HF tokenizers give their end-of-text token (GPT-2, Llama 3, Llama 2 / Mistral, Gemma).
_EOT_NAMES = (ENDOFTEXT, "<|end_of_text|>", "</s>", "<eos>")


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eot: int | None
    digest: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """Token id = byte value of the UTF-8 text; byte 0 ends a document."""
    name = BYTE
    vocab_size = 256
    eot = BYTE_EOT
    digest = BYTE

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids if int(i) != BYTE_EOT).decode("utf-8", errors="replace")


class TiktokenTokenizer:
    """GPT-2's BPE (50257 ids, <|endoftext|> = 50256) through tiktoken."""

    def __init__(self, encoding_name: str = GPT2, *, key: str = "data.tokenizer"):
        try:
            import tiktoken
        except ImportError:
            raise EulerError(f"the {encoding_name!r} tokenizer needs the `tiktoken` package "
                             "(pip install tiktoken)", key=key) from None
        try:
            self._enc = tiktoken.get_encoding(encoding_name)
        except Exception as err:  # requests' network errors, tiktoken's hash mismatch
            raise EulerError(
                f"tiktoken could not load the {encoding_name!r} BPE files ({type(err).__name__}): "
                "it downloads them once from openaipublic.blob.core.windows.net; on a machine "
                "without that access, copy a cache folder filled where it works and set "
                "TIKTOKEN_CACHE_DIR to it, or name a local tokenizer.json", key=key) from None
        self.name = encoding_name
        self.vocab_size = self._enc.n_vocab
        self.eot = self._enc.eot_token
        self.digest = f"tiktoken:{encoding_name}"

    def encode(self, text: str) -> list[int]:
        # data text that spells "<|endoftext|>" is text, not a document boundary
        return self._enc.encode_ordinary(text)

    def decode(self, ids: Iterable[int]) -> str:
        return self._enc.decode([int(i) for i in ids], errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers` JSON file."""

    def __init__(self, path: str | Path, *, key: str = "data.tokenizer"):
        path = Path(path)
        if not path.is_file():
            raise EulerError("tokenizer file not found", file=str(path), key=key)
        Tokenizer = _tokenizers(key).Tokenizer
        data = path.read_bytes()
        try:
            self._tok = Tokenizer.from_str(data.decode("utf-8"))
        except Exception as err:  # the library raises bare Exceptions for bad files
            raise EulerError(f"not a tokenizers JSON file: {err}", file=str(path), key=key) from None
        self.name = str(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eot = next((i for i in map(self._tok.token_to_id, _EOT_NAMES) if i is not None), None)
        self.digest = f"sha256:{hashlib.sha256(data).hexdigest()}"

    def encode(self, text: str) -> list[int]:
        # no post-processor specials ([CLS], <s>): prepare places the document boundaries
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids])


def tokenizer_named(spec: str, *, key: str = "data.tokenizer") -> Tokenizer:
    """"byte", "gpt2", or a path to a tokenizer.json."""
    if spec == BYTE:
        return ByteTokenizer()
    if spec == GPT2:
        return TiktokenTokenizer(GPT2, key=key)
    return HFTokenizer(spec, key=key)


def load_tokenizer(data) -> Tokenizer:
    """The tokenizer a run's DataConfig names (`data.tokenizer`, which config.py has
    already reconciled with NanoEuler's `data.tokenizer_path`)."""
    return tokenizer_named(data.tokenizer)


def check_fits(tokenizer: Tokenizer, model_vocab: int) -> None:
    """A model must have an embedding row for every id the tokenizer can produce."""
    if tokenizer.vocab_size > model_vocab:
        raise EulerError(f"tokenizer {tokenizer.name} has {tokenizer.vocab_size} ids, more than "
                         f"model.vocab_size {model_vocab}: set model.vocab_size to at least "
                         f"{tokenizer.vocab_size}", key="model.vocab_size")


# -- training a byte-level BPE --------------------------------------------------------------

MIN_BPE_VOCAB = 257   # the 256 byte symbols and <|endoftext|>
# Far past any BPE in use (GPT-4's has ~100k ids); larger asks make the Rust trainer
# allocate until the process is killed instead of failing.
MAX_BPE_VOCAB = 1 << 20


def train_bpe(texts: Iterable[str], vocab_size: int, out: str | Path) -> HFTokenizer:
    """Train a GPT-2-style byte-level BPE on `texts` with Hugging Face tokenizers, with
    <|endoftext|> as its end-of-text token; write it atomically to `out` (tokenizer.json)."""
    if vocab_size < MIN_BPE_VOCAB:
        raise EulerError(f"--vocab-size {vocab_size} is below {MIN_BPE_VOCAB} (256 bytes and "
                         f"{ENDOFTEXT})", key="--vocab-size")
    if vocab_size > MAX_BPE_VOCAB:
        raise EulerError(f"--vocab-size {vocab_size:,} is above {MAX_BPE_VOCAB:,}",
                         key="--vocab-size")
    if Path(out).is_dir():
        raise EulerError("a folder: --out names the tokenizer .json to write", file=str(out),
                         key="--out")
    lib = _tokenizers("--vocab-size")
    tok = lib.Tokenizer(lib.models.BPE())
    tok.pre_tokenizer = lib.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = lib.decoders.ByteLevel()
    trainer = lib.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[ENDOFTEXT], show_progress=False,
        initial_alphabet=lib.pre_tokenizers.ByteLevel.alphabet())
    seen = _Counted(texts)
    tok.train_from_iterator(seen, trainer=trainer)
    if not seen.count:
        raise EulerError("no text to train on: the sources hold no documents", key="SOURCES")
    write_atomic(Path(out), tok.to_str(pretty=True).encode("utf-8"))
    return HFTokenizer(out)


class _Counted:
    """An iterable that counts what it yields (tokenizers consumes it in Rust)."""

    def __init__(self, texts: Iterable[str]):
        self._texts, self.count = texts, 0

    def __iter__(self):
        for text in self._texts:
            self.count += 1
            yield text


def _tokenizers(key: str):
    try:
        import tokenizers
    except ImportError:
        raise EulerError("this needs the `tokenizers` package (pip install tokenizers)",
                         key=key) from None
    return tokenizers
