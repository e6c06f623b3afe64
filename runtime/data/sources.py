"""Documents for `eulergen prepare` and `eulergen tokenizer train`, in a fixed order:
local .txt files (one document a file), .jsonl (one a line, a text field), .parquet (one
a row of a text column, via pyarrow), folders and globs of those; or a Hugging Face
dataset streamed with `datasets`.

A document's index is its place in that order, counted whether or not it holds usable
text, so `documents(skip=n)` resumes after the first n without reading them where the
format allows (a .txt file, a parquet row group).
"""
from __future__ import annotations

import glob as globlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol

from eulergen.errors import EulerError
from eulergen.userfiles import DOCUMENT_LIMIT, opened, read_bytes

SUFFIXES = (".txt", ".jsonl", ".parquet")
ON_BAD_TEXT = ("stop", "skip")
DATA_EXTRA = "pip install 'eulergen[data]'"


@dataclass(frozen=True)
class Document:
    text: str | None              # None: no usable text (see `error`, or an empty row)
    error: EulerError | None = None  # text that is not UTF-8: the caller skips or stops
    advance: float = 0.0          # source bytes this document accounts for (progress)


class Source(Protocol):
    total_bytes: int | None

    def identity(self) -> dict: ...

    def documents(self, skip: int = 0) -> Iterator[Document]: ...


def checked(docs: Iterator[Document], on_bad_text: str, warn) -> Iterator[Document]:
    """`docs`, stopping at the first that is not UTF-8 ("stop"), or warning and passing it
    on without text ("skip": it still counts as a document)."""
    for doc in docs:
        if doc.error is not None:
            if on_bad_text == "stop":
                raise EulerError(f"{doc.error} (--on-bad-text skip leaves such documents out)")
            warn(f"skipped: {doc.error}")
        yield doc


# -- local files ----------------------------------------------------------------------------

class LocalFiles:
    """.txt, .jsonl and .parquet files named directly, by folder (searched recursively) or
    by glob; each folder's or glob's files in sorted path order, in the order given."""

    def __init__(self, specs: list[str], text_key: str = "text"):
        if not specs:
            raise EulerError("no sources given: name .txt, .jsonl or .parquet files, folders of "
                             "them, or --dataset", key="SOURCES")
        self.text_key = text_key
        self.files = tuple(p for spec in specs for p in _expand(spec))
        # a file named that is no regular file is refused by its reader, naming it
        self.sizes = tuple(p.stat().st_size if p.is_file() else 0 for p in self.files)
        self.total_bytes = sum(self.sizes)

    def identity(self) -> dict:
        # path and size: hashing every source file on each rerun would cost a full read
        return {"files": [[str(p), n] for p, n in zip(self.files, self.sizes)],
                "text_key": self.text_key}

    def documents(self, skip: int = 0) -> Iterator[Document]:
        for path, size in zip(self.files, self.sizes):
            reader = {".txt": _txt, ".jsonl": _jsonl, ".parquet": _parquet}[path.suffix]
            skip = yield from reader(path, size, self.text_key, skip)


def _expand(spec: str) -> list[Path]:
    path = Path(os.path.expanduser(spec))
    if path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file())
        if not found:
            raise EulerError(f"no {', '.join(SUFFIXES)} files in this folder", file=spec)
        return found
    if os.path.lexists(path) and not globlib.has_magic(spec):
        if path.suffix not in SUFFIXES:
            raise EulerError(f"not a source prepare reads (want {', '.join(SUFFIXES)})", file=spec)
        return [path]
    # folders and globs take the regular files they hold
    found = sorted(Path(p) for p in globlib.glob(str(path), recursive=True))
    found = [p for p in found if p.is_file() and p.suffix in SUFFIXES]
    if not found:
        raise EulerError(f"no such file, and no {', '.join(SUFFIXES)} files match it", file=spec)
    return found


def _decode(data: bytes, path: Path, offset: int) -> Document:
    try:
        return Document(data.decode("utf-8"), advance=len(data))
    except UnicodeDecodeError as err:
        return Document(None, EulerError(f"not UTF-8 at byte {offset + err.start}", file=str(path)),
                        advance=len(data))


def _txt(path: Path, size: int, text_key: str, skip: int):
    if skip:
        return skip - 1
    yield _decode(read_bytes(path, "source file", DOCUMENT_LIMIT), path, 0)
    return 0


def _jsonl(path: Path, size: int, text_key: str, skip: int):
    offset = 0
    with opened(path, "source file") as f:
        lines = iter(lambda: f.readline(DOCUMENT_LIMIT + 1), b"")
        for number, line in enumerate(lines, 1):
            if len(line) > DOCUMENT_LIMIT:
                raise EulerError(f"a line of more than {DOCUMENT_LIMIT:,} bytes: a document is "
                                 "at most that", file=str(path), line=number)
            start, offset = offset, offset + len(line)
            if skip:
                skip -= 1
                continue
            doc = _decode(line, path, start)
            if doc.text is None or not doc.text.strip():   # not UTF-8, or a blank line
                yield Document(None, doc.error, len(line))
                continue
            try:
                row = json.loads(doc.text)
            except json.JSONDecodeError as err:
                raise EulerError(f"not a JSON line: {err.msg}", file=str(path), line=number) from None
            if not isinstance(row, dict) or text_key not in row:
                keys = ", ".join(row) if isinstance(row, dict) else type(row).__name__
                raise EulerError(f"no string field {text_key!r} (has: {keys}); --text-key names "
                                 "the field", file=str(path), line=number, key=text_key)
            if not isinstance(row[text_key], (str, type(None))):
                raise EulerError(f"field {text_key!r} holds {type(row[text_key]).__name__}, not "
                                 "text", file=str(path), line=number, key=text_key)
            yield Document(row[text_key], advance=len(line))
    return skip


def _parquet(path: Path, size: int, text_key: str, skip: int):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise EulerError(f"reading .parquet needs pyarrow ({DATA_EXTRA})", file=str(path)) from None
    with opened(path, "source file") as f:
        try:
            pf = pq.ParquetFile(f)
        except Exception as err:  # pyarrow's own ArrowInvalid, for a file that is not parquet
            raise EulerError(f"not a parquet file: {err}", file=str(path)) from None
        names = pf.schema_arrow.names
        if text_key not in names:
            raise EulerError(f"no column {text_key!r} (has: {', '.join(names)}); --text-key names "
                             "the column", file=str(path), key=text_key)
        per_row = size / max(1, pf.metadata.num_rows)
        for group in range(pf.num_row_groups):
            rows = pf.metadata.row_group(group).num_rows
            if skip >= rows:
                skip -= rows
                continue
            column = pf.read_row_group(group, columns=[text_key]).column(0)
            for value in column.to_pylist()[skip:]:
                if isinstance(value, bytes):
                    doc = _decode(value, path, 0)
                    yield Document(doc.text, doc.error, per_row)
                elif value is None or isinstance(value, str):
                    yield Document(value, advance=per_row)
                else:
                    raise EulerError(f"column {text_key!r} holds {type(value).__name__}, not text",
                                     file=str(path), key=text_key)
            skip = 0
    return skip


# -- Hugging Face datasets --------------------------------------------------------------------

class HubDataset:
    """A dataset on the Hugging Face hub, streamed (nothing is downloaded up front)."""
    total_bytes = None

    def __init__(self, name: str, subset: str | None = None, split: str = "train",
                 text_key: str = "text"):
        self.name, self.subset, self.split, self.text_key = name, subset, split, text_key

    def identity(self) -> dict:
        return {"dataset": self.name, "subset": self.subset, "split": self.split,
                "text_key": self.text_key}

    def documents(self, skip: int = 0) -> Iterator[Document]:
        try:
            import datasets
        except ImportError:
            raise EulerError(f"--dataset needs the `datasets` package ({DATA_EXTRA})",
                             key="--dataset") from None
        where = self.name + (f" ({self.subset})" if self.subset else "")
        count = skip
        try:
            stream = datasets.load_dataset(self.name, self.subset, split=self.split, streaming=True)
            if skip:
                stream = stream.skip(skip)
            for row in stream:
                if self.text_key not in row:
                    raise EulerError(f"rows have no field {self.text_key!r} (have: "
                                     f"{', '.join(row)}); --text-key names it", key="--text-key")
                count += 1
                yield Document(row[self.text_key])
        except EulerError:
            raise
        except Exception as err:  # the hub client's many network and lookup errors
            what = "cannot reach" if count == skip else f"lost the stream after {count} documents of"
            reason = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
            raise EulerError(f"{what} Hugging Face dataset {where} ({type(err).__name__}: {reason}); "
                             "where the hub is unreachable, download its files elsewhere and pass "
                             "the local .parquet or .jsonl files instead", key="--dataset") from None
