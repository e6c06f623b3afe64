"""Every file a user hands eulergen, read through one door: specs, configs, a run's own
JSON, tokenizer files, token shards, safetensors weights and their index, HF config.json,
prepare's sources and manifest. Each fault is one EulerError naming the file (and the line
and key where there is one).

- Regular files only. A FIFO, a device, a socket or a folder is refused by name before it
  is opened (stat), and again after (fstat of what was opened, O_NONBLOCK so that a FIFO
  put there meanwhile never waits for a writer); what is read is that open file.
- Symlinks are followed, deliberately: a data folder of links to shards and the Hugging
  Face cache (its snapshot files are links into its blobs) are ordinary. What a link names
  must itself be a regular file; a refusal names the link and its target.
- Bounded: a file read whole is refused above its kind's limit, from its size before any
  read, and no more than the limit is read; shards and weights are memory-mapped, every
  offset into them checked against the file's size first.
- Typed: a JSON field is checked for type and range before it is used (`Fields`).

YAML: at most YAML_MAX_NODES nodes counted with every alias expanded, nested at most
YAML_MAX_DEPTH deep, both counted while the document is composed (an alias adds the size of
the node it names), so a "billion laughs" is refused after reading its text once. A key
given twice in one mapping names both lines; so does JSON's, whose nesting past Python's
parser, and integers past Python's digit limit, are errors too.
"""
from __future__ import annotations

import json
import math
import os
import stat
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator

import yaml

from eulergen.errors import EulerError

TEXT_LIMIT = 16 << 20        # specs, configs, state.json, config.json, indexes: KBs in practice
TOKENIZER_LIMIT = 256 << 20  # tokenizer.json: GPT-2's is 1.4 MB, Llama 3's 9 MB, Gemma's 33 MB
DOCUMENT_LIMIT = 1 << 30     # one document of prepare's sources: a .txt file, a .jsonl line
SAFETENSORS_HEADER_LIMIT = 100 << 20   # the format's own limit on its JSON header
YAML_MAX_NODES = 100_000     # specs and configs hold tens to hundreds
YAML_MAX_DEPTH = 64
_KINDS = {stat.S_IFIFO: "FIFO", stat.S_IFCHR: "character device", stat.S_IFBLK: "block device",
          stat.S_IFSOCK: "socket", stat.S_IFDIR: "folder"}


@contextmanager
def opened(path: str | Path, what: str, key: str | None = None) -> Iterator[BinaryIO]:
    """`path` open for binary reading, after checking it is a regular file (`what` names
    the kind in errors: 'config file', 'token file'; `key`, the flag or key that named it)."""
    path = Path(path)
    try:
        _regular(path, os.stat(path).st_mode, what, key)   # a device is never even opened
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        raise _refusal(path, what, err, key) from None
    with os.fdopen(fd, "rb") as f:
        _regular(path, os.fstat(fd).st_mode, what, key)   # what was opened, if it changed
        yield f


def _regular(path: Path, mode: int, what: str, key: str | None) -> None:
    if not stat.S_ISREG(mode):
        kind = _KINDS.get(stat.S_IFMT(mode), "special file")
        raise EulerError(f"{_via_link(path)}a {kind}, not a regular file: a {what} is read "
                         "only from a file", file=str(path), key=key)


def _via_link(path: Path) -> str:
    return f"a symlink to {os.readlink(path)}, " if path.is_symlink() else ""


def _refusal(path: Path, what: str, err: OSError, key: str | None) -> EulerError:
    if isinstance(err, FileNotFoundError):
        dangling = f" ({_via_link(path)}which does not exist)" if path.is_symlink() else ""
        return EulerError(f"{what} not found{dangling}", file=str(path), key=key)
    return EulerError(f"cannot read {what}: {err.strerror}", file=str(path), key=key)


def size_of(f: BinaryIO) -> int:
    return os.fstat(f.fileno()).st_size


def read_bytes(path: str | Path, what: str, limit: int = TEXT_LIMIT,
               key: str | None = None) -> bytes:
    """A whole regular file of at most `limit` bytes."""
    with opened(path, what, key) as f:
        size = size_of(f)
        data = f.read(limit + 1) if size <= limit else b""
        if size > limit or len(data) > limit:   # (a file growing while read)
            raise EulerError(f"{max(size, len(data)):,} bytes: a {what} is at most {limit:,}"
                             " (is this the right file?)", file=str(path), key=key)
        return data


def decode_text(data: bytes, path: str | Path, what: str) -> str:
    """UTF-8 or one error naming the byte and its line."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        raise EulerError(f"not UTF-8 text (byte {err.start}): is this a {what}?",
                         file=str(path), line=line) from None


def read_text(path: str | Path, what: str, limit: int = TEXT_LIMIT,
              key: str | None = None) -> str:
    """A text file that must be UTF-8."""
    return decode_text(read_bytes(path, what, limit, key), path, what)


def read_json(path: str | Path, what: str, limit: int = TEXT_LIMIT,
              key: str | None = None) -> dict:
    """A JSON file that must hold an object."""
    data = load_json(read_text(path, what, limit, key), str(path))
    if not isinstance(data, dict):
        raise EulerError(f"expected a JSON object, got {type(data).__name__}", file=str(path))
    return data


def map_array(f: BinaryIO, dtype, offset: int, count: int):
    """`count` items of `dtype` at byte `offset` of an open file, memory-mapped (the caller
    has checked they lie inside it)."""
    import numpy as np
    return np.memmap(f, dtype=dtype, mode="r", offset=offset, shape=(count,))


# -- typed fields ---------------------------------------------------------------------------

_REQUIRED = object()
INT_MAX = 2**63 - 1


class Fields:
    """Typed reads of a JSON object's fields: each a value of the type and range asked, or
    one EulerError naming the file and the key path."""

    def __init__(self, data, file: str, prefix: str = ""):
        if not isinstance(data, dict):
            raise EulerError(f"expected an object, got {_kind(data)}", file=file,
                             key=prefix.rstrip(".") or None)
        self.data, self.file, self.prefix = data, file, prefix

    def error(self, key: str, message: str) -> EulerError:
        return EulerError(message, file=self.file, key=f"{self.prefix}{key}")

    def _get(self, key: str, default):
        value = self.data.get(key, default)
        if value is _REQUIRED:
            raise self.error(key, "missing")
        return value

    def int(self, key: str, default=_REQUIRED, *, lo: int = 0, hi: int = INT_MAX):
        value = self._get(key, default)
        if value is None and default is None:
            return None
        return check_int(value, self.file, f"{self.prefix}{key}", lo=lo, hi=hi)

    def number(self, key: str, default=_REQUIRED, *, positive: bool = False) -> float:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not math.isfinite(value):
            raise self.error(key, f"expected a finite number, got {_kind(value)}")
        if positive and value <= 0:
            raise self.error(key, f"{value} must be positive")
        return float(value)

    def text(self, key: str, default=_REQUIRED):
        value = self._get(key, default)
        if not (isinstance(value, str) or (value is None and default is None)):
            raise self.error(key, f"expected a string, got {_kind(value)}")
        return value

    def flag(self, key: str, default=_REQUIRED) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise self.error(key, f"expected true or false, got {_kind(value)}")
        return value

    def fields(self, key: str, default=_REQUIRED) -> Fields:
        """The object at `key` (null and absent: `default`, when given, as an object)."""
        value = self._get(key, default)
        return Fields({} if value is None and default is not _REQUIRED else value, self.file,
                      f"{self.prefix}{key}.")

    def list(self, key: str, default=_REQUIRED) -> list:
        value = self._get(key, default)
        if not isinstance(value, list):
            raise self.error(key, f"expected a list, got {_kind(value)}")
        return value


def check_int(value, file: str, key: str, *, lo: int = 0, hi: int = INT_MAX) -> int:
    """`value` if it is an integer (not a bool) in lo..hi, else one error naming `key`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise EulerError(f"expected an integer, got {_kind(value)}", file=file, key=key)
    if not lo <= value <= hi:
        raise EulerError(f"{_short(value)} is outside {lo:,}..{hi:,}", file=file, key=key)
    return value


def _kind(value) -> str:
    if value is None or isinstance(value, (bool, int, float)):
        return _short(json.dumps(value))
    if isinstance(value, str):
        return f"the string {_short(json.dumps(value))}"
    return {dict: "an object", list: "a list"}.get(type(value), type(value).__name__)


def _short(value) -> str:
    text = str(value)
    return text if len(text) <= 40 else f"{text[:20]}… ({len(text):,} characters)"


# -- safetensors ----------------------------------------------------------------------------

SAFETENSORS_DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "F64": "<f8"}


def safetensors_header(f: BinaryIO, path: Path) -> tuple[dict, int]:
    """(name -> (dtype, shape, begin offset), where the data starts) of an open
    safetensors file (8-byte header length, a JSON header, the bytes), every field typed and
    every tensor's bytes checked to lie inside the file."""
    import numpy as np
    size, file = size_of(f), str(path)
    head = f.read(8)
    length = int.from_bytes(head, "little") if len(head) == 8 else -1
    if length < 2 or length > min(size - 8, SAFETENSORS_HEADER_LIMIT):
        raise EulerError(f"truncated or not safetensors: a {size}-byte file whose header "
                         f"claims {max(length, 0)} bytes", file=file)
    try:
        raw = load_json(f.read(length).decode("utf-8"), file)
    except (EulerError, UnicodeDecodeError):
        raise EulerError("not safetensors: the header is not JSON", file=file) from None
    header = {}
    for name, info in Fields(raw, file).data.items():
        if name == "__metadata__":
            continue
        entry = Fields(info, file, f"{name}.")
        dtype = entry.text("dtype")
        if dtype not in SAFETENSORS_DTYPES:
            raise entry.error("dtype", f"{dtype!r} is not a float type "
                                       f"({', '.join(SAFETENSORS_DTYPES)})")
        shape = tuple(check_int(n, file, f"{name}.shape", hi=size) for n in entry.list("shape"))
        offsets = entry.list("data_offsets")
        if len(offsets) != 2:
            raise entry.error("data_offsets", f"expected [begin, end], got {len(offsets)} values")
        begin, end = (check_int(n, file, f"{name}.data_offsets", hi=size) for n in offsets)
        want = math.prod(shape) * np.dtype(SAFETENSORS_DTYPES[dtype]).itemsize
        if end - begin != want:
            raise EulerError(f"{name}: its offsets span {end - begin} bytes, shape "
                             f"{list(shape)} of {dtype} is {want}", file=file)
        if 8 + length + end > size:
            raise EulerError(f"truncated: {name} ends at byte {8 + length + end}, the file "
                             f"has {size}", file=file)
        header[name] = (np.dtype(SAFETENSORS_DTYPES[dtype]), shape, begin)
    return header, 8 + length


def read_safetensors(path: str | Path, what: str = "weights file", each=None) -> dict:
    """Every tensor of a safetensors file as float32 (f16 and bf16 widen exactly);
    `each()` after each tensor (a progress bar)."""
    import numpy as np
    path = Path(path)
    with opened(path, what) as f:
        header, base = safetensors_header(f, path)
        out = {}
        for name, (dtype, shape, begin) in header.items():
            count = math.prod(shape)
            raw = map_array(f, dtype, base + begin, count) if count else np.zeros(0, dtype)
            if dtype == np.dtype("<u2"):   # bf16 bits: the high half of a float32
                out[name] = (raw.astype(np.uint32) << 16).view(np.float32).reshape(shape)
            else:
                out[name] = raw.astype(np.float32).reshape(shape)
            if each is not None:
                each()
        return out


# -- YAML and JSON text ---------------------------------------------------------------------

# (Pythons before 3.10.7 have no such limit, and no ValueError)
_TOO_LONG = f"an integer of more than {getattr(sys, 'get_int_max_str_digits', int)():,} digits"


class _BoundedLoader(yaml.SafeLoader):
    def __init__(self, text: str, file: str):
        super().__init__(text)
        self.file = file
        self._path: list = []              # the key path of the node being composed
        self._sizes: dict[int, int] = {}   # id(node) -> its node count, aliases expanded

    def compose_node(self, parent, index):
        # PyYAML calls this with index = the key node for a mapping's value, the position
        # for a sequence's item, and None for a key or the root
        key = index.value if isinstance(index, yaml.ScalarNode) else index
        if isinstance(parent, yaml.MappingNode) and isinstance(index, yaml.ScalarNode):
            for earlier, _ in parent.value:
                if isinstance(earlier, yaml.ScalarNode) and earlier.value == index.value:
                    raise self._error(f"given twice, on lines {earlier.start_mark.line + 1} "
                                      f"and {index.start_mark.line + 1}", index, key)
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            node = self.anchors.get(event.anchor)
            if node is not None and id(node) not in self._sizes:
                raise self._error(f"alias *{event.anchor} refers to a node that contains it",
                                  event, key)
            return super().compose_node(parent, index)
        if key is not None:
            self._path.append(key)
        if len(self._path) > YAML_MAX_DEPTH:
            raise EulerError(f"nested deeper than {YAML_MAX_DEPTH} levels", file=self.file,
                             line=self.peek_event().start_mark.line + 1)
        node = super().compose_node(parent, index)
        if key is not None:
            self._path.pop()
        if isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            children = node.value if isinstance(node, yaml.SequenceNode) else []
        size = 1 + sum(self._sizes[id(c)] for c in children)
        if size > YAML_MAX_NODES:
            raise self._error(f"more than {YAML_MAX_NODES:,} values with its aliases expanded "
                              "(an alias bomb?)", node, key)
        self._sizes[id(node)] = size
        return node

    def _error(self, message: str, at, last=None) -> EulerError:
        path = self._path + ([last] if last is not None and self._path[-1:] != [last] else [])
        return EulerError(message, file=self.file, line=at.start_mark.line + 1,
                          key=".".join(map(str, path)) or None)


def compose_yaml(text: str, file: str) -> yaml.Node | None:
    """The node tree of one YAML document (None when empty), within the bounds above."""
    try:
        loader = _BoundedLoader(text, file)   # its reader refuses NUL and other controls
    except yaml.YAMLError as err:
        raise EulerError(f"YAML error: {err}".splitlines()[0], file=file) from None
    try:
        return loader.get_single_node()
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        raise EulerError(f"YAML error: {err.problem or err.context}", file=file,
                         line=mark.line + 1 if mark else None) from None
    except yaml.YAMLError as err:
        raise EulerError(f"YAML error: {err}", file=file) from None
    finally:
        loader.dispose()


def construct_yaml(node: yaml.Node, file: str):
    """The Python value of a node tree from compose_yaml (aliases share one object)."""
    loader = yaml.SafeLoader("")
    try:
        return loader.construct_document(node)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        raise EulerError(f"YAML error: {err.problem or err.context}", file=file,
                         line=mark.line + 1 if mark else None) from None
    except ValueError:   # the only one a safe load raises: an int past Python's digit limit
        raise EulerError(f"YAML error: {_TOO_LONG}", file=file) from None
    finally:
        loader.dispose()


def load_yaml(text: str, file: str):
    node = compose_yaml(text, file)
    return None if node is None else construct_yaml(node, file)


def load_json(text: str, file: str):
    """JSON with a key given twice refused (naming it), and nesting past what Python's
    parser reaches, or an integer past its digit limit, one error instead of a crash."""
    def no_duplicates(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise EulerError("given twice in one object", file=file, key=key)
            seen.add(key)
        return dict(pairs)
    try:
        return json.loads(text, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as err:
        raise EulerError(f"invalid JSON: {err.msg}", file=file, line=err.lineno) from None
    except RecursionError:
        raise EulerError("JSON nested too deeply to read", file=file) from None
    except ValueError:   # json's int() past Python's digit limit
        raise EulerError(f"invalid JSON: {_TOO_LONG}", file=file) from None
