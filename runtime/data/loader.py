"""Token data: llm.c shards and nanoGPT .bin files, memory-mapped; a resumable,
deterministic batch loader; the built-in `builtin:stdlib` dataset (tokenizers live in
tokenizer.py).

llm.c shard: 256 little-endian int32 header (magic, version, token count), then the
tokens: uint16 under magic 20240520 (version 1, GPT-2), uint32 under 20240801 (version 7,
as llm.c writes its Llama-3 shards). nanoGPT train.bin/val.bin: headerless uint16.
"""
from __future__ import annotations

import glob as globlib
import hashlib
import os
import re
import sys
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterator

import numpy as np

import eulergen
from eulergen.errors import EulerError
from eulergen.files import write_atomic
from eulergen.runtime.data.tokenizer import BYTE_EOT
from eulergen.userfiles import map_array, opened, size_of

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
SHARD_MAGICS = {20240520: np.dtype("<u2"), 20240801: np.dtype("<u4")}
SHARD_VERSIONS = {20240520: 1, 20240801: 7}
# llm.c's other binary files, named so that pointing the loader at one says what it is.
LLMC_FILE_MAGICS = {20240326: "a model checkpoint", 20240327: "a model debug state",
                    20240328: "a tokenizer file", 20240522: "an eval (HellaSwag) file"}
# llm.c names its shards <name>_train_000001.bin; such a file must carry a header.
_LLMC_SHARD_NAME = re.compile(r"_(train|val)_?\d+\.bin\Z")

BUILTIN_STDLIB = "builtin:stdlib"
# Every 10th file (by path) is validation: a held-out sample with the training mix
# (the stdlib's tail, by path, is mostly unittest/tkinter/xml, unlike the rest).
STDLIB_VAL_EVERY = 10


# -- token files ----------------------------------------------------------------------------

def open_tokens(path: str | Path) -> np.ndarray:
    """Memory-map one token file as a 1-D unsigned array (llm.c shard or nanoGPT .bin),
    read through eulergen/userfiles.py (a regular file; its header checked against its size
    before anything is mapped)."""
    path = Path(path)
    with opened(path, "token file") as f:
        size = size_of(f)
        head = np.frombuffer(f.read(min(HEADER_BYTES, size // 4 * 4)), dtype="<i4")
        magic = int(head[0]) if head.size else None
        if magic in SHARD_MAGICS:
            return _open_shard(f, path, head, size)
        if magic in LLMC_FILE_MAGICS:
            raise EulerError(f"header magic {magic} is {LLMC_FILE_MAGICS[magic]}, not a token "
                             f"shard (expected 20240520 or 20240801)", file=str(path))
        if _LLMC_SHARD_NAME.search(path.name):
            raise EulerError(f"header magic {magic} is not an llm.c token shard "
                             f"(expected 20240520 or 20240801)", file=str(path))
        if size % 2:
            raise EulerError(f"truncated: {size} bytes is not a whole number of uint16 tokens "
                             f"(read as a headerless nanoGPT .bin)", file=str(path))
        if size == 0:
            raise EulerError("empty token file", file=str(path))
        return map_array(f, np.dtype("<u2"), 0, size // 2)


def _open_shard(f, path: Path, head: np.ndarray, size: int) -> np.ndarray:
    if head.size < HEADER_INTS:
        raise EulerError(f"truncated: {size} bytes, shorter than the {HEADER_BYTES}-byte header",
                         file=str(path))
    magic, version, count = int(head[0]), int(head[1]), int(head[2])
    if version != SHARD_VERSIONS[magic]:
        raise EulerError(f"header version {version} is not supported under magic {magic} "
                         f"(expected {SHARD_VERSIONS[magic]})", file=str(path))
    dtype = SHARD_MAGICS[magic]
    body = size - HEADER_BYTES
    if count < 0 or body < count * dtype.itemsize:
        raise EulerError(f"truncated: header says {count} tokens, body holds "
                         f"{body // dtype.itemsize}", file=str(path))
    if body > count * dtype.itemsize:
        raise EulerError(f"header says {count} tokens but the body holds "
                         f"{body // dtype.itemsize}: not a shard this loader wrote or knows",
                         file=str(path))
    if count == 0:
        raise EulerError("shard holds no tokens", file=str(path))
    return map_array(f, dtype, HEADER_BYTES, count)


def write_shard(path: str | Path, tokens: np.ndarray) -> str:
    """Write an llm.c shard atomically (temp file, fsync, rename): uint16 when every id
    fits, else uint32. Returns the file's sha256 (hex)."""
    tokens = np.asarray(tokens)
    wide = tokens.size and int(tokens.max()) > np.iinfo(np.uint16).max
    magic = 20240801 if wide else 20240520
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (magic, SHARD_VERSIONS[magic], tokens.size)
    data = header.tobytes() + tokens.astype(SHARD_MAGICS[magic]).tobytes()
    write_atomic(Path(path), data, fsync=True)
    return hashlib.sha256(data).hexdigest()


def resolve_files(pattern: str, cache_dir: str | Path | None = None, split: str = "train") -> list[Path]:
    """The sorted token files a dataset string names: a glob, one file, or builtin:stdlib."""
    if pattern == BUILTIN_STDLIB:
        return [stdlib_tokens(cache_dir)[split]]
    if pattern.startswith("builtin:"):
        raise EulerError(f"unknown built-in dataset {pattern!r} (known: {BUILTIN_STDLIB})",
                         key="data.dataset")
    pattern = os.path.expanduser(pattern)
    if not globlib.has_magic(pattern) and os.path.lexists(pattern):
        return [Path(pattern)]   # named itself: open_tokens says what is wrong with it
    # a glob takes the regular files it matches
    files = [p for p in sorted(Path(p) for p in globlib.glob(pattern)) if p.is_file()]
    if not files:
        raise EulerError("no token files match (data.dataset takes a glob of llm.c shards, a "
                         "nanoGPT train.bin, or builtin:stdlib)", file=pattern)
    return files


# -- the loader -----------------------------------------------------------------------------

@dataclass(frozen=True)
class DataPosition:
    """Where a loader stands: the epoch (which, with the seed, fixes the shard and row
    orders), the index into that epoch's shard order, and the batch within that shard."""
    epoch: int = 0
    shard: int = 0
    batch: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "shard": self.shard, "batch": self.batch}


class DataLoader:
    """Batches (x, y) of int32 [B, T], y shifted by one token.

    Each shard is cut into rows of T + 1 tokens at stride T (so every token is a target
    once per epoch); a batch is B rows. With `shuffle`, each epoch visits the shards in
    an order drawn from (seed, epoch) and the rows of each shard in an order drawn from
    (seed, epoch, shard), so a batch's rows come from all over the shard and a saved
    `state()` restores the exact stream without storing any generator state. Without
    shuffle (validation), shards and rows go in file order: B·T contiguous tokens a batch.
    The rows left over at the end of a shard (fewer than B) are skipped.

    Data-parallel (`world_size` N > 1): the stream is that of one loader of batch N·B, and
    rank r takes rows r·B..(r+1)·B of each of its batches, so N ranks see together exactly
    what one process of batch N·B sees, and the position (the same on every rank) is the
    global one, from which each rank's follows: it resumes on any N' ranks of B' = N·B / N'."""

    def __init__(self, pattern: str, batch_size: int, seq_len: int, seed: int = 0,
                 position: dict | None = None, *, shuffle: bool = True,
                 cache_dir: str | Path | None = None, split: str = "train",
                 vocab_size: int | None = None, rank: int = 0, world_size: int = 1):
        self.pattern = pattern
        self.vocab_size = vocab_size
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.shuffle = shuffle
        self.rank, self.world_size = rank, world_size
        self.files = resolve_files(pattern, cache_dir, split)
        self.shards = [open_tokens(f) for f in self.files]
        self._rows = [max(0, (len(s) - 1) // seq_len) for s in self.shards]
        self._batches = [rows // (batch_size * world_size) for rows in self._rows]
        if not any(self._batches):
            raise EulerError(f"too few tokens for one batch: the largest file holds "
                             f"{max(len(s) for s in self.shards)}, a batch needs "
                             f"B*T+1 = {batch_size * world_size * seq_len + 1}"
                             + (f" (B = {world_size} ranks x {batch_size})" if world_size > 1 else ""),
                             file=pattern)
        self._position = DataPosition()
        self._shard_order: np.ndarray | None = None
        self._row_order: tuple[tuple[int, int], np.ndarray] | None = None  # ((epoch, shard), rows)
        if position is not None:
            self.restore(position)

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.shards)

    @property
    def batches(self) -> int:
        """Batches in one pass over every file."""
        return sum(self._batches)

    def state(self) -> dict[str, int]:
        """JSON-ready position of the next batch; restore() continues from it exactly. With
        the rows of a global batch, and the ranks that read them (rank r rows r·B..(r+1)·B)."""
        return {**self._position.to_dict(), "seed": self.seed, "world_size": self.world_size,
                "rows": self.batch_size * self.world_size}

    def restore(self, state: dict) -> None:
        if state.get("seed", self.seed) != self.seed:
            raise EulerError(f"data position was saved with seed {state['seed']}, "
                             f"this loader has seed {self.seed}", key="data")
        rows = self.batch_size * self.world_size
        saved = state.get("rows", self.batch_size * state.get("world_size", 1))
        if saved != rows:
            # the position counts global batches: any ranks x batch_size that make as many rows
            raise EulerError(f"data position counts global batches of {saved} rows (world size x "
                             f"training.batch_size), this run's are {self.world_size} x "
                             f"{self.batch_size}: resume with as many rows", key="data")
        position = DataPosition(int(state["epoch"]), int(state["shard"]), int(state["batch"]))
        if position.shard >= len(self.shards):
            raise EulerError(f"data position names shard {position.shard}, but {self.pattern} "
                             f"has {len(self.shards)} files", key="data")
        self._move(position)

    def reset(self) -> None:
        self._move(DataPosition())

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return self

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        return self.next_batch()

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        pos = self._position
        while pos.batch >= self._batches[self._shard(pos)]:
            pos = DataPosition(pos.epoch, pos.shard + 1, 0) if pos.shard + 1 < len(self.shards) \
                else DataPosition(pos.epoch + 1, 0, 0)
            self._move(pos)
        shard = self._shard(pos)
        B, T = self.batch_size, self.seq_len
        first = (pos.batch * self.world_size + self.rank) * B
        rows = self._rows_of(pos)[first:first + B]
        tokens = self.shards[shard]
        chunk = np.stack([np.asarray(tokens[r * T:r * T + T + 1], dtype=np.int32) for r in rows])
        if self.vocab_size is not None and int(chunk.max()) >= self.vocab_size:
            # An embedding lookup past the table reads garbage on the GPU instead of failing.
            raise EulerError(f"token id {int(chunk.max())} is outside the model's vocabulary "
                             f"(model.vocab_size {self.vocab_size}); was this data made with "
                             f"another tokenizer?", file=str(self.files[shard]))
        self._position = DataPosition(pos.epoch, pos.shard, pos.batch + 1)
        return chunk[:, :-1], chunk[:, 1:]

    def _move(self, position: DataPosition) -> None:
        if self._shard_order is not None and position.epoch != self._position.epoch:
            self._shard_order = None
        self._position = position

    def _shard(self, pos: DataPosition) -> int:
        if self._shard_order is None:
            n = len(self.shards)
            self._shard_order = (np.random.default_rng([self.seed, pos.epoch]).permutation(n)
                                 if self.shuffle else np.arange(n))
        return int(self._shard_order[pos.shard])

    def _rows_of(self, pos: DataPosition) -> np.ndarray:
        """This shard's row order, drawn when the loader reaches the shard."""
        key = (pos.epoch, pos.shard)
        if self._row_order is None or self._row_order[0] != key:
            n = self._rows[self._shard(pos)]
            rows = (np.random.default_rng([self.seed, pos.epoch, pos.shard]).permutation(n)
                    if self.shuffle else np.arange(n))
            self._row_order = (key, rows)
        return self._row_order[1]


# -- builtin:stdlib -------------------------------------------------------------------------

@lru_cache(maxsize=1)
def stdlib_files() -> tuple[Path, ...]:
    """The standard library's own .py files, sorted by path relative to the stdlib root
    (installed packages excluded), so the text is the same wherever this Python is.
    Installed packages are pruned, not walked: under a pyenv or system Python they hold
    most of the tree, and every run's start walked them (benchmarks/RESULTS.md, Start-up)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, dirs, names in os.walk(root):   # like rglob: symlinked folders not entered
        dirs[:] = [d for d in dirs if d not in ("site-packages", "dist-packages")]
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    return tuple(sorted(files, key=lambda p: p.relative_to(root).as_posix()))


@lru_cache(maxsize=1)
def _stdlib_key() -> str:
    """What identifies the stdlib text: the Python version and every file's path and size
    (once a process: a run asks for its train and val split)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    key = hashlib.sha256()
    key.update(f"{sys.version}\nval every {STDLIB_VAL_EVERY}\n".encode())
    for p in stdlib_files():
        key.update(f"{p.relative_to(root).as_posix()}:{p.stat().st_size}\n".encode())
    return key.hexdigest()


def is_stdlib_folder(folder: Path) -> bool:
    """Whether `folder` is where stdlib_tokens keeps builtin:stdlib's (byte-level) shards:
    data/stdlib-<16 hex digits of its key> in a cache folder."""
    return folder.parent.name == "data" and \
        re.fullmatch(r"stdlib-[0-9a-f]{16}", folder.name) is not None


def stdlib_tokens(cache_dir: str | Path | None = None) -> dict[str, Path]:
    """Build (once) and return the train and val shards of builtin:stdlib: byte-level
    tokens of every stdlib .py file, each followed by byte 0; every 10th file (by
    path) is validation. Cached under the cache dir, keyed by the file list."""
    files = stdlib_files()
    if len(files) < STDLIB_VAL_EVERY:
        raise EulerError(f"the Python standard library here has {len(files)} .py files, too few "
                         f"for builtin:stdlib", key="data.dataset")
    folder = Path(cache_dir or eulergen.cache_dir()) / "data" / f"stdlib-{_stdlib_key()[:16]}"
    paths = {"train": folder / "train.bin", "val": folder / "val.bin"}
    if all(p.is_file() for p in paths.values()):
        return paths
    parts = {"train": [p for i, p in enumerate(files, 1) if i % STDLIB_VAL_EVERY],
             "val": files[STDLIB_VAL_EVERY - 1::STDLIB_VAL_EVERY]}
    for name, part in parts.items():
        data = bytearray()
        for p in part:
            data += p.read_bytes()
            data.append(BYTE_EOT)
        write_shard(paths[name], np.frombuffer(bytes(data), dtype=np.uint8))
    return paths


def make_loaders(cfg, cache_dir: str | Path | None = None, *, rank: int = 0,
                 world_size: int = 1) -> tuple[DataLoader, DataLoader | None]:
    """The run's train loader (shuffled by the seed; rank `rank`'s slice of each global
    batch) and val loader (file order, or None when the config names no validation set)
    for a RunConfig."""
    t, vocab = cfg.training, cfg.model.vocab_size
    train = DataLoader(cfg.data.dataset, t.batch_size, t.seq_len, t.seed, cache_dir=cache_dir,
                       split="train", vocab_size=vocab, rank=rank, world_size=world_size)
    val = None
    if cfg.data.val_dataset is not None:
        val = DataLoader(cfg.data.val_dataset, t.batch_size, t.seq_len, t.seed, shuffle=False,
                         cache_dir=cache_dir, split="val", vocab_size=vocab)
    return train, val
