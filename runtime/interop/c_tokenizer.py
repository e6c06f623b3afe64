"""tokenizer.bin of `eulergen export-c` (templates/c/tokenizer.c reads it and documents the
layout): the byte tokenizer, or a byte-level BPE with GPT-2's pre-tokenizer (GPT-2's own
through tiktoken, or a tokenizer.json such as `eulergen tokenizer` trains) as each id's
bytes, each byte's id, the merges lowest rank first, and the Unicode letter and number
ranges its pre-tokenizer reads (from this Python's unicodedata). Anything else is refused.
"""
from __future__ import annotations

import json
import struct
import sys
import unicodedata
from functools import lru_cache

from eulergen.errors import EulerError
from eulergen.runtime.data.tokenizer import (ByteTokenizer, HFTokenizer, TiktokenTokenizer,
                                             bpe_merges, byte_chars)

MAGIC = struct.unpack("<i", b"EGT1")[0]
VERSION = 1
BYTE, BPE = 0, 1


def tokenizer_bytes(tok) -> bytes:
    if isinstance(tok, ByteTokenizer):
        return _header(BYTE, tok.vocab_size, tok.eot, 0, 0, 0)
    if isinstance(tok, TiktokenTokenizer):
        ranks = tok.ranks()
        tokens = {i: t for t, i in ranks.items()}
        merges = [(ranks[a], ranks[b], ranks[a + b]) for a, b in bpe_merges(ranks)]
        return _bpe(tok, tokens, merges)
    if isinstance(tok, HFTokenizer):
        return _bpe(tok, *_from_json(tok))
    raise EulerError(f"tokenizer {tok.name}: export-c writes the byte tokenizer and byte-level "
                     "BPEs only", key="data.tokenizer")


def _header(kind, vocab, eot, merges, letters, numbers) -> bytes:
    return struct.pack("<8i", MAGIC, VERSION, kind, vocab, -1 if eot is None else eot, merges,
                       letters, numbers)


def _bpe(tok, tokens: dict[int, bytes], merges: list[tuple[int, int, int]]) -> bytes:
    """The BPE's file: `tokens` id -> bytes (specials absent: they have none)."""
    single = {t[0]: i for i, t in tokens.items() if len(t) == 1}
    if len(single) != 256:
        missing = next(b for b in range(256) if b not in single)
        raise EulerError(f"tokenizer {tok.name}: no token for byte 0x{missing:02x}: not a "
                         "byte-level BPE", key="data.tokenizer")
    letters, numbers = _ranges("L"), _ranges("N")
    parts = [_header(BPE, tok.vocab_size, tok.eot, len(merges), len(letters), len(numbers))]
    for i in range(tok.vocab_size):
        t = tokens.get(i, b"")
        parts += [struct.pack("<i", len(t)), t]
    parts.append(struct.pack("<256i", *(single[b] for b in range(256))))
    parts += [struct.pack(f"<{3 * len(merges)}i", *(i for m in merges for i in m))]
    parts += [struct.pack(f"<{2 * len(r)}i", *(i for pair in r for i in pair))
              for r in (letters, numbers)]
    return b"".join(parts)


def _from_json(tok: HFTokenizer) -> tuple[dict[int, bytes], list[tuple[int, int, int]]]:
    """Its tokens and merges, where the file is a byte-level BPE whose pre-tokenizer is
    GPT-2's (ByteLevel with its regex, no prefix space) and nothing else changes the text."""
    data = json.loads(tok.to_json())
    model, pre = data.get("model") or {}, data.get("pre_tokenizer") or {}
    plain = (model.get("type") == "BPE" and not data.get("normalizer")
             and pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
             and not pre.get("add_prefix_space") and not model.get("dropout")
             and not model.get("continuing_subword_prefix")
             and not model.get("end_of_word_suffix") and not model.get("ignore_merges"))
    if not plain:
        raise EulerError(f"tokenizer {tok.name}: export-c's C tokenizer is GPT-2's byte-level "
                         "BPE (a ByteLevel pre-tokenizer with its regex, no normalizer); this "
                         "one is another kind", key="data.tokenizer")
    byte_of = {c: b for b, c in enumerate(byte_chars())}
    specials = {t["id"] for t in data.get("added_tokens", [])}
    vocab = model["vocab"]
    tokens = {}
    for text, i in vocab.items():
        if i in specials:
            continue
        try:
            tokens[i] = bytes(byte_of[c] for c in text)
        except KeyError:
            raise EulerError(f"tokenizer {tok.name}: token {text!r} stands for no bytes: not a "
                             "byte-level BPE", key="data.tokenizer") from None
    merges = []
    for m in model.get("merges", []):
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        merges.append((vocab[a], vocab[b], vocab[a + b]))
    return tokens, merges


@lru_cache(maxsize=None)
def _ranges(category: str) -> list[tuple[int, int]]:
    """The code points whose Unicode category starts with `category`, as (first, last) runs."""
    runs: list[tuple[int, int]] = []
    start = None
    for c in range(sys.maxunicode + 2):
        inside = c <= sys.maxunicode and unicodedata.category(chr(c)).startswith(category)
        if inside and start is None:
            start = c
        elif not inside and start is not None:
            runs.append((start, c - 1))
            start = None
    return runs
