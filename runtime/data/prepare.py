"""`eulergen prepare`: documents → tokens → llm.c shards, in parallel, resumable.

Layout of an output folder, as llm.c's fineweb.py writes it: `<name>_val_000000.bin` (the
first `val_tokens` tokens), then `<name>_train_000001.bin`, … of `shard_tokens` each (the
last one shorter); every document is preceded by the tokenizer's end-of-text id, and a
document that does not fit a shard continues in the next one. Beside them `prepare.json`:
the settings, and after each shard the shards written (tokens, sha256), the documents
consumed and how many tokens of the next one are already written.

Resume: a rerun checks the settings and every finished shard, skips the documents they
hold without tokenizing them, and continues; shards and prepare.json are written
atomically, so a killed run leaves at worst a temp file, which the rerun removes.
Workers tokenize batches of documents and the results are taken in order, so the bytes
do not depend on the number of workers.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from eulergen import outputs
from eulergen.errors import EulerError
from eulergen.files import write_atomic
from eulergen.progress import Bar
from eulergen.runtime.data.loader import open_tokens, write_shard
from eulergen.runtime.data.prepared import STATE_FILE, PrepareState, ShardRecord, show
from eulergen.runtime.data.sources import ON_BAD_TEXT, Document, Source, checked
from eulergen.runtime.data.tokenizer import Tokenizer
from eulergen.userfiles import opened

MAX_WORKERS_PER_CORE = 4   # each worker is a process holding the tokenizer
SHARD_TOKENS = 100_000_000     # llm.c's fineweb.py
# 10M validation tokens: at GPT-2 small's B=16, T=1024 that is 600 batches, far more than
# an evaluation reads, and 0.1% of FineWeb-Edu's sample-10BT; small sources pass less.
VAL_TOKENS = 10_000_000
BATCH_BYTES = 1 << 20          # text a worker tokenizes per task: large enough to hide IPC
BATCH_DOCS = 4096
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")


@dataclass(frozen=True)
class Settings:
    shard_tokens: int = SHARD_TOKENS
    val_tokens: int = VAL_TOKENS
    on_bad_text: str = "stop"
    name: str | None = None    # shard file prefix; None: the output folder's name


@dataclass
class Progress:
    """Counters the caller may show while prepare runs (a progress bar reads them)."""
    advance: float = 0.0
    tokens: int = 0
    shards: int = 0
    on_update: Callable[["Progress"], None] | None = field(default=None, repr=False)

    def update(self, advance: float = 0.0, tokens: int = 0, shards: int = 0) -> None:
        self.advance += advance
        self.tokens += tokens
        self.shards += shards
        if self.on_update is not None:
            self.on_update(self)


def shown(bar: Bar) -> Progress:
    """prepare's counters shown on `bar` (over the source's bytes): tokens, shards, tokens/s
    (of this run: a resumed one's earlier tokens left out)."""
    started, first = time.perf_counter(), None

    def show(p: Progress) -> None:
        nonlocal first
        first = p.tokens if first is None else first
        rate = (p.tokens - first) / max(1e-9, time.perf_counter() - started)
        bar.update(p.advance, status=f"{p.tokens:,} tokens, {p.shards} shards, {rate:,.0f} tok/s")
    return Progress(on_update=show)


def shard_name(name: str, index: int) -> str:
    return f"{name}_{'val' if index == 0 else 'train'}_{index:06d}.bin"


def train_glob(out: Path, name: str) -> str:
    """The data.dataset glob of a prepared folder (config derives the val glob from it)."""
    return str(out / f"{name}_train_*.bin")


def prepare(source: Source, out: str | Path, tokenizer: Tokenizer, settings: Settings = Settings(),
            *, workers: int | None = None, progress: Progress | None = None,
            warn: Callable[[str], None] = lambda m: print(m, file=sys.stderr)) -> PrepareState:
    """Tokenize `source` into shards under `out` (or continue a run that stopped there)."""
    out = Path(out)
    name = settings.name or out.resolve().name
    _check_settings(settings, name, tokenizer)
    cores = len(os.sched_getaffinity(0))
    if workers is not None and workers > MAX_WORKERS_PER_CORE * cores:
        raise EulerError(f"{workers:,} workers: at most {MAX_WORKERS_PER_CORE} a core "
                         f"({MAX_WORKERS_PER_CORE * cores} here)", key="--workers")
    wanted = {"source": source.identity(), "tokenizer": tokenizer.name,
              "tokenizer_digest": tokenizer.digest, "eot": tokenizer.eot,
              **asdict(replace(settings, name=name))}
    new_folder = not out.exists()
    state = _open_folder(out, wanted)
    progress = progress or Progress()
    progress.update(tokens=state.tokens, shards=len(state.shards))
    if state.done:
        return state
    writer = _ShardWriter(out, name, settings, tokenizer, state, progress)
    index = state.documents
    docs = source.documents(skip=state.documents)
    try:
        for doc, tokens in _tokenized(docs, tokenizer, workers, settings.on_bad_text, warn):
            start = state.carry if index == state.documents else 0
            writer.add(tokens, index=index, start=start, skipped=doc.error is not None)
            index += 1
            progress.update(advance=doc.advance, tokens=tokens.size - start)
        return writer.finish(index)
    except EulerError:
        if new_folder and not writer.state.shards:   # bad input before any shard: leave no trace
            (out / STATE_FILE).unlink()
            if not any(out.iterdir()):
                out.rmdir()
        raise


def _check_settings(settings: Settings, name: str, tokenizer: Tokenizer) -> None:
    if settings.shard_tokens < 1 or settings.val_tokens < 1:
        raise EulerError(f"--shard-tokens {settings.shard_tokens} and --val-tokens "
                         f"{settings.val_tokens} must be positive", key="--shard-tokens")
    if settings.on_bad_text not in ON_BAD_TEXT:
        raise EulerError(f"{settings.on_bad_text!r} is not one of {', '.join(ON_BAD_TEXT)}",
                         key="--on-bad-text")
    if not _NAME.match(name):
        raise EulerError(f"{name!r} cannot prefix shard file names (letters, digits, . _ -)",
                         key="--name")
    if tokenizer.eot is None:
        raise EulerError(f"tokenizer {tokenizer.name} has no end-of-text token; prepare writes "
                         "one before each document", key="--tokenizer")


# -- the output folder ------------------------------------------------------------------------

def _open_folder(out: Path, settings: dict) -> PrepareState:
    """The state to continue from: fresh for a new or empty folder, else the manifest's,
    after checking that the folder holds nothing prepare did not write (outputs.py's rule),
    that it was made with these settings and that its shards are intact."""
    state_path = out / STATE_FILE
    if not state_path.exists():
        outputs.check_folder(out, lambda name: False, by="prepare", key="--out")
        state = PrepareState(settings=settings)
        write_atomic(state_path, state.to_json())
        return state
    state = PrepareState.read(state_path)
    settings = json.loads(json.dumps(settings))    # the JSON-ready form the manifest holds
    recorded = {s.file for s in state.shards}
    shard = re.escape(settings["name"]) + r"_(val|train)_\d{6}\.bin"
    ours = re.compile(shard + r"\Z")
    # files.write_atomic's temp files, of a write the last run did not finish
    temp = re.compile(rf"\.({shard}|{re.escape(STATE_FILE)})\.\w+\.tmp\Z")
    outputs.check_folder(out, lambda e: e == STATE_FILE or e in recorded or bool(
        ours.match(e) or temp.match(e)), by="prepare", key="--out")
    if state.settings != settings and not state.shards:
        state = PrepareState(settings=settings)    # nothing written yet: nothing to keep
        write_atomic(state_path, state.to_json())
    if state.settings != settings:
        key = next(k for k in (*settings, *state.settings)
                   if state.settings.get(k) != settings.get(k))
        raise EulerError(f"this folder was prepared with {key} = {show(state.settings.get(key))}, "
                         f"not {show(settings.get(key))}: rerun with its settings, or name another "
                         "folder", file=str(out / STATE_FILE), key=key)
    for entry in sorted(p.name for p in out.iterdir()):
        if temp.match(entry):
            (out / entry).unlink()
    for shard in state.shards:
        _verify(out / shard.file, shard)
    return state


def _verify(path: Path, shard: ShardRecord) -> None:
    if not path.exists():
        raise EulerError(f"shard listed in {STATE_FILE} is missing: delete the folder to prepare "
                         "it again", file=str(path))
    count = len(open_tokens(path))    # a truncated or foreign file fails here, saying how
    digest = hashlib.sha256()
    with opened(path, "token file") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    digest = digest.hexdigest()
    if count != shard.tokens or digest != shard.sha256:
        raise EulerError(f"shard differs from what {STATE_FILE} recorded ({count} tokens, "
                         f"sha256 {digest[:12]}…; expected {shard.tokens}, {shard.sha256[:12]}…): "
                         "it changed after it was written; delete the folder to prepare it again",
                         file=str(path))


class _ShardWriter:
    """Fills one shard buffer at a time; writes each full shard, then the state."""

    def __init__(self, out: Path, name: str, settings: Settings, tokenizer: Tokenizer,
                 state: PrepareState, progress: Progress):
        self.out, self.name, self.settings, self.state, self.progress = out, name, settings, state, progress
        self.dtype = _token_dtype(tokenizer)
        self.buffer = np.empty(self._capacity(), dtype=self.dtype)
        self.filled = 0
        self.skipped = state.skipped

    def _capacity(self) -> int:
        return self.settings.val_tokens if not self.state.shards else self.settings.shard_tokens

    def add(self, tokens: np.ndarray, *, index: int, start: int, skipped: bool) -> None:
        """Document `index`, whose first `start` tokens are already in the shards."""
        self.skipped += skipped
        at = start
        while at < tokens.size:
            take = min(tokens.size - at, self.buffer.size - self.filled)
            self.buffer[self.filled:self.filled + take] = tokens[at:at + take]
            self.filled += take
            at += take
            if self.filled == self.buffer.size:
                whole = at == tokens.size
                self._flush(index + 1 if whole else index, 0 if whole else at)

    def _flush(self, documents: int, carry: int, done: bool = False) -> None:
        tokens = self.buffer[:self.filled]
        file = shard_name(self.name, len(self.state.shards))
        digest = write_shard(self.out / file, tokens)
        self.state = replace(self.state, shards=(*self.state.shards, ShardRecord(file, tokens.size, digest)),
                             documents=documents, carry=carry, tokens=self.state.tokens + tokens.size,
                             skipped=self.skipped, done=done)
        write_atomic(self.out / STATE_FILE, self.state.to_json())
        self.progress.update(shards=1)
        if not done:
            self.buffer = np.empty(self._capacity(), dtype=self.dtype)
            self.filled = 0

    def finish(self, documents: int) -> PrepareState:
        if len(self.state.shards) + (self.filled > 0) < 2:
            total = self.state.tokens + self.filled
            raise EulerError(f"the sources hold {total:,} tokens: too few for a validation shard of "
                             f"--val-tokens {self.settings.val_tokens:,} and any training tokens "
                             "after it; pass a smaller --val-tokens", key="--val-tokens")
        if self.filled:
            self._flush(documents, 0, done=True)
        else:
            self.state = replace(self.state, done=True, documents=documents, skipped=self.skipped)
            write_atomic(self.out / STATE_FILE, self.state.to_json())
        return self.state


# -- tokenizing in parallel -------------------------------------------------------------------

def _token_dtype(tokenizer: Tokenizer):
    """The narrowest dtype that holds every id the tokenizer can produce."""
    return np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32


_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer: Tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer
    # one process a core already: HF tokenizers' own threads would only contend
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _encode(texts: list[str | None], tokenizer: Tokenizer | None = None) -> tuple[np.ndarray, np.ndarray]:
    """[eot, *ids] of each document, concatenated, and each one's length (0 for no text)."""
    tok = tokenizer or _worker_tokenizer
    flat: list[int] = []
    lengths = np.zeros(len(texts), dtype=np.int64)
    for i, text in enumerate(texts):
        if text:
            before = len(flat)
            flat.append(tok.eot)
            flat.extend(tok.encode(text))
            lengths[i] = len(flat) - before
    return np.array(flat, dtype=_token_dtype(tok)), lengths


def _batches(docs, on_bad_text: str, warn) -> Iterator[list[Document]]:
    batch, size = [], 0
    for doc in checked(docs, on_bad_text, warn):
        batch.append(doc)
        size += len(doc.text or "")
        if size >= BATCH_BYTES or len(batch) >= BATCH_DOCS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _tokenized(docs, tokenizer: Tokenizer, workers: int | None, on_bad_text: str,
               warn) -> Iterator[tuple[Document, np.ndarray]]:
    """(document, its tokens) in source order; `workers` processes tokenize."""
    workers = workers or len(os.sched_getaffinity(0))
    batches = _batches(docs, on_bad_text, warn)
    if workers == 1:
        for batch in batches:
            yield from _split(batch, _encode([d.text for d in batch], tokenizer))
        return
    import multiprocessing
    with multiprocessing.Pool(workers, _init_worker, (tokenizer,)) as pool:
        # a bounded window of batches in flight: Pool.imap would read the whole source ahead
        pending: deque = deque()
        for batch in batches:
            pending.append((batch, pool.apply_async(_encode, ([d.text for d in batch],))))
            if len(pending) > 2 * workers:
                batch, result = pending.popleft()
                yield from _split(batch, result.get())
        while pending:
            batch, result = pending.popleft()
            yield from _split(batch, result.get())


def _split(batch: list[Document], encoded: tuple[np.ndarray, np.ndarray]):
    flat, lengths = encoded
    ends = np.cumsum(lengths)
    for doc, end, n in zip(batch, ends, lengths):
        yield doc, flat[end - n:end]
