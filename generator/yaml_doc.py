"""A YAML document that remembers the line of every key, so that every error about a spec
names the file, the line and the key path (`ops/x.yaml:9: outputs.y: …`)."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

from eulergen.errors import EulerError, Where
from eulergen.userfiles import compose_yaml, construct_yaml, decode_text, read_text

FLOAT32_MAX = 3.4028234663852886e38   # the kernels compute in float32


def past_float32(value: int | float) -> str | None:
    """What is wrong with a number of a spec the kernels cannot hold (nan, inf, past
    float32's range, an integer past any float), or None."""
    if abs(value) <= FLOAT32_MAX:
        return None
    shown = value if isinstance(value, float) else f"an integer of {len(str(value))} digits"
    return f"{shown} is not a finite float32 value"

_NUMBER_TEXT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


class YamlDoc:
    """A loaded YAML mapping and the line of every key path in it."""

    def __init__(self, path: Path, data: bytes | None = None):
        """`data`: the file's bytes, where the caller has read them already."""
        self.file = str(path)
        text = read_text(path, "spec file") if data is None else decode_text(data, path, "spec file")
        self.bytes = text.encode("utf-8")
        self.lines: dict[tuple, int] = {}
        # bounded (aliases expanded, depth) and duplicate keys refused while composing
        node = compose_yaml(text, self.file)
        if node is None:
            raise EulerError("empty spec file", file=self.file)
        self._index(node, ())
        self.data = construct_yaml(node, self.file)
        if not isinstance(self.data, dict):
            raise EulerError("a spec must be a mapping of keys (name, kind, …)", file=self.file, line=1)

    def _index(self, node: yaml.Node, path: tuple) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = k.value
                self.lines[path + (key,)] = k.start_mark.line + 1
                self._index(v, path + (key,))
        elif isinstance(node, yaml.SequenceNode):
            for n, item in enumerate(node.value):
                self.lines[path + (n,)] = item.start_mark.line + 1
                self._index(item, path + (n,))

    def where(self, *path) -> Where:
        line = next((self.lines[path[:n]] for n in range(len(path), 0, -1)
                     if path[:n] in self.lines), 1)
        return Where(self.file, line, ".".join(map(str, path)))

    def error(self, message: str, *path) -> EulerError:
        return self.where(*path).error(message)

    def mapping(self, value, *path) -> dict:
        """A mapping at `path` (absent: empty)."""
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.error(f"expected a mapping (name: value), got {type(value).__name__}", *path)
        return value

    def number(self, value, *path) -> float:
        """A number at `path`. PyYAML reads `1e-5` (no dot) as a string: say how to write it."""
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise self.error(f"expected a number, got {value!r}", *path)
        if isinstance(value, str):
            if _NUMBER_TEXT.match(value.strip()):
                mant, _, exp = value.strip().lower().partition("e")
                fixed = (mant if "." in mant else mant + ".0") + ("e" + exp if exp else "")
                raise self.error(f"'{value}' is read by YAML as a string; write {fixed}", *path)
            raise self.error(f"expected a number, got {value!r}", *path)
        fault = past_float32(value)
        if fault:
            raise self.error(fault, *path)
        return float(value)
