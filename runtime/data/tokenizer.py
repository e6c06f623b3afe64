"""Tokenizers: byte level, GPT-2 BPE through tiktoken, any Hugging Face tokenizer.json,
and training a byte-level BPE of one's own.

Every tokenizer has `name`, `vocab_size`, `eot` (the end-of-text id prepare writes before
each document, or None), `digest` (what identifies it in a prepared folder's manifest),
`encode(str) -> list[int]` and `decode(ids) -> str`. Libraries are imported only when used.
"""
from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Iterable, Protocol

from eulergen import outputs
from eulergen.errors import EulerError
from eulergen.userfiles import TOKENIZER_LIMIT, decode_text, read_bytes, read_json

BYTE, GPT2 = "byte", "gpt2"
BYTE_EOT = 0   # byte 0 never occurs in text: builtin:stdlib ends each file with it
ENDOFTEXT = "<|endoftext|>"
HF_TOKENIZER_FILE = "tokenizer.json"
GPT2_VOCAB = 50257   # 50256 BPE ranks, then <|endoftext|>
# Names HF tokenizers give their end-of-text token (GPT-2, Llama 3, Llama 2 / Mistral, Gemma).
_EOT_NAMES = (ENDOFTEXT, "<|end_of_text|>", "</s>", "<eos>")


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eot: int | None
    digest: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def unknown(self, text: str) -> int | None:
        """The character offset of the first piece of `text` this tokenizer can only encode
        as its unknown token (None: it encodes all of it; byte-level ones always do)."""
        return None


class ByteTokenizer(Tokenizer):
    """Token id = byte value of the UTF-8 text; byte 0 ends a document."""
    name = BYTE
    vocab_size = 256
    eot = BYTE_EOT
    digest = BYTE

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids if int(i) != BYTE_EOT).decode("utf-8", errors="replace")


class TiktokenTokenizer(Tokenizer):
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
            # offline: GPT-2's tokenizer.json in the Hugging Face cache holds the same BPE
            cached = _hub_cached_gpt2() if encoding_name == GPT2 else None
            if cached is None:
                raise EulerError(
                    f"no {encoding_name!r} BPE files here: tiktoken could not download them "
                    f"({type(err).__name__}); copy tiktoken's cache folder from a machine where "
                    "it works and set TIKTOKEN_CACHE_DIR to it, or put GPT-2's tokenizer.json "
                    "in the Hugging Face cache (hf download openai-community/gpt2 "
                    "tokenizer.json), or set it to an HF GPT-2 folder", key=key) from None
            self._enc = gpt2_from_tokenizer_json(cached, key=key)
        self.name = encoding_name
        self.vocab_size = self._enc.n_vocab
        self.eot = self._enc.eot_token
        self.digest = digest_of(encoding_name)

    def ranks(self) -> dict[bytes, int]:
        """The BPE's tokens (bytes) and their ranks, which are their ids."""
        return {t: self._enc.encode_single_token(t) for t in self._enc.token_byte_values()}

    def encode(self, text: str) -> list[int]:
        # data text that spells "<|endoftext|>" is text, not a document boundary
        return self._enc.encode_ordinary(text)

    def decode(self, ids: Iterable[int]) -> str:
        return self._enc.decode([int(i) for i in ids], errors="replace")


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` JSON file."""

    def __init__(self, path: str | Path, *, key: str = "data.tokenizer"):
        path = Path(path)
        Tokenizer = _tokenizers(key).Tokenizer
        data = read_bytes(path, "tokenizer file", TOKENIZER_LIMIT, key)
        try:
            self._tok = Tokenizer.from_str(decode_text(data, path, "tokenizer file"))
        except EulerError:
            raise
        except Exception as err:  # the library raises bare Exceptions for bad files
            raise EulerError(f"not a tokenizers JSON file: {err}", file=str(path), key=key) from None
        self.name = str(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eot = next((i for i in map(self._tok.token_to_id, _EOT_NAMES) if i is not None), None)
        self.digest = _file_digest(data)
        self._json = data

    @functools.cached_property
    def _unk(self) -> int | None:
        # read from the JSON when a prompt is first checked: loading (train, prepare) skips it
        model = json.loads(self._json).get("model")
        unk = model.get("unk_token") if isinstance(model, dict) else None
        return self._tok.token_to_id(unk) if isinstance(unk, str) else None

    def unknown(self, text: str) -> int | None:
        if self._unk is None:
            return None
        enc = self._tok.encode(text, add_special_tokens=False)
        return next((start for i, (start, _) in zip(enc.ids, enc.offsets) if i == self._unk),
                    None)

    def to_json(self) -> bytes:
        return self._json

    def encode(self, text: str) -> list[int]:
        # no post-processor specials ([CLS], <s>): prepare places the document boundaries
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids])


def tokenizer_named(spec: str, *, key: str = "data.tokenizer") -> Tokenizer:
    """"byte", "gpt2", a path to a tokenizer.json, or a Hugging Face tokenizer folder
    (one holding tokenizer.json: a save_pretrained folder)."""
    if spec == BYTE:
        return ByteTokenizer()
    if spec == GPT2:
        return TiktokenTokenizer(GPT2, key=key)
    return HFTokenizer(tokenizer_file(spec), key=key)


def digest_of(spec: str) -> str:
    """What identifies the tokenizer `spec` names (its `digest`, which a prepared folder's
    manifest records), without loading it."""
    if spec == BYTE:
        return BYTE
    if spec == GPT2:
        return f"tiktoken:{GPT2}"
    return _file_digest(read_bytes(tokenizer_file(spec), "tokenizer file", TOKENIZER_LIMIT))


def _file_digest(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


def tokenizer_file(spec: str | Path) -> Path:
    """A tokenizer path as given, or a folder's tokenizer.json."""
    path = Path(spec)
    return path / HF_TOKENIZER_FILE if path.is_dir() else path


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
    <|endoftext|> as its end-of-text token; write it to `out` (tokenizer.json), which must
    not exist (outputs.write_new: never over a file, the text being read included)."""
    if vocab_size < MIN_BPE_VOCAB:
        raise EulerError(f"--vocab-size {vocab_size} is below {MIN_BPE_VOCAB} (256 bytes and "
                         f"{ENDOFTEXT})", key="--vocab-size")
    if vocab_size > MAX_BPE_VOCAB:
        raise EulerError(f"--vocab-size {vocab_size:,} is above {MAX_BPE_VOCAB:,}",
                         key="--vocab-size")
    outputs.check_new(out, by="tokenizer train", key="--out")   # before training, and on writing
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
    outputs.write_new(out, tok.to_str(pretty=True).encode("utf-8"), by="tokenizer train",
                      key="--out")
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


# -- GPT-2's BPE between tiktoken and Hugging Face, and tokenizer.json for export -----------

def byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte in
    a tokenizer.json's vocab (the `bytes_to_unicode` table of GPT-2's encoder.py)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _hub_cached_gpt2() -> Path | None:
    """GPT-2's tokenizer.json where huggingface_hub caches it, if it is there."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    for repo in ("openai-community/gpt2", "gpt2"):
        found = try_to_load_from_cache(repo, HF_TOKENIZER_FILE)
        if isinstance(found, str):
            return Path(found)
    return None


def gpt2_from_tokenizer_json(path: Path, *, key: str = "data.tokenizer"):
    """A tiktoken Encoding of GPT-2 from an HF GPT-2 tokenizer.json: GPT-2's BPE ranks are
    its ids (merge n makes id 256 + n), so tiktoken's lowest-rank-first merging gives the
    ids the file's merges give, with tiktoken's own handling of text."""
    import tiktoken
    from tiktoken_ext.openai_public import r50k_pat_str

    data = read_json(path, "tokenizer file", TOKENIZER_LIMIT, key)
    try:
        vocab = dict(data["model"]["vocab"])
        specials = {t["content"]: t["id"] for t in data.get("added_tokens", [])}
    except (ValueError, KeyError, TypeError) as err:
        raise EulerError(f"not GPT-2's tokenizer.json ({type(err).__name__}: {err})",
                         file=str(path), key=key) from None
    eot = specials.get(ENDOFTEXT, vocab.get(ENDOFTEXT))
    bpe = {token: i for token, i in vocab.items() if token != ENDOFTEXT}
    if data["model"].get("type") != "BPE" or eot != GPT2_VOCAB - 1 or \
            len(bpe) != GPT2_VOCAB - 1 or set(bpe.values()) != set(range(GPT2_VOCAB - 1)):
        raise EulerError(f"not GPT-2's tokenizer.json: want a BPE of ids 0-{GPT2_VOCAB - 2} "
                         f"and {ENDOFTEXT} = {GPT2_VOCAB - 1}", file=str(path), key=key)
    byte_of = {c: b for b, c in enumerate(byte_chars())}
    try:
        ranks = {bytes(byte_of[c] for c in token): i for token, i in bpe.items()}
    except KeyError as err:
        raise EulerError(f"not a byte-level BPE: {err.args[0]!r} stands for no byte",
                         file=str(path), key=key) from None
    return tiktoken.Encoding(GPT2, pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={ENDOFTEXT: GPT2_VOCAB - 1},
                             explicit_n_vocab=GPT2_VOCAB)


def hf_tokenizer_json(tok: Tokenizer) -> bytes:
    """The tokenizer as a Hugging Face tokenizer.json, for export: an HF tokenizer's own
    file; byte level and GPT-2's BPE rebuilt as byte-level BPEs with the same ids."""
    if isinstance(tok, HFTokenizer):
        return tok.to_json()
    if isinstance(tok, TiktokenTokenizer):
        return byte_level_bpe_json(tok.ranks(), {ENDOFTEXT: tok.eot})
    # every byte its own id, no merges, no regex split: ids are the UTF-8 bytes, but for
    # byte 0, which never occurs in text: it is the end of text, named as GPT-2 names its own
    lib = _tokenizers("export")
    chars = byte_chars()
    vocab = {chars[b]: b for b in range(256) if b != BYTE_EOT} | {ENDOFTEXT: BYTE_EOT}
    hf = lib.Tokenizer(lib.models.BPE(vocab, []))
    hf.pre_tokenizer = lib.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = lib.decoders.ByteLevel()
    hf.add_special_tokens([ENDOFTEXT])   # at its id in the vocab; decode leaves it out
    return hf.to_str(pretty=True).encode("utf-8")


def byte_level_bpe_json(ranks: dict[bytes, int], specials: dict[str, int]) -> bytes:
    """tokenizer.json of a tiktoken-style BPE (token bytes -> rank = id) with GPT-2's
    pre-tokenizer, and special tokens at their ids."""
    lib = _tokenizers("export")
    chars = byte_chars()
    text = {token: "".join(chars[b] for b in token) for token in ranks}
    vocab = {**{text[t]: r for t, r in ranks.items()}, **specials}
    merges = [(text[a], text[b]) for a, b in bpe_merges(ranks)]
    hf = lib.Tokenizer(lib.models.BPE(vocab, merges))
    hf.pre_tokenizer = lib.pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = lib.decoders.ByteLevel()
    hf.add_special_tokens(list(specials))
    return hf.to_str(pretty=True).encode("utf-8")


def bpe_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Merges under which HF's BPE (lowest merge first) gives tiktoken's ids (lowest rank
    first): every split of a token into two tokens, ranked by the token it makes (as
    transformers' TikTokenConverter builds them)."""
    merges = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    return [(left, right) for *_, left, right in sorted(merges)]
