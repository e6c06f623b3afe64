"""A YAML document that remembers the line of every key, so that every error about a spec
names the file, the line and the key path (`ops/x.yaml:9: outputs.y: …`)."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

from eulergen.errors import EulerError
from eulergen.generator.formula import Where

_NUMBER_TEXT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


class YamlDoc:
    """A loaded YAML mapping and the line of every key path in it."""

    def __init__(self, path: Path):
        self.file = str(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise EulerError(f"cannot read spec: {err}", file=self.file) from None
        self.bytes = text.encode("utf-8")
        self.lines: dict[tuple, int] = {}
        loader = yaml.SafeLoader(text)
        try:
            node = loader.get_single_node()
            if node is None:
                raise EulerError("empty spec file", file=self.file)
            self._index(node, ())
            self.data = loader.construct_document(node)
        except yaml.MarkedYAMLError as err:
            mark = err.problem_mark or err.context_mark
            line = mark.line + 1 if mark else None
            raise EulerError(f"YAML error: {err.problem or err.context}", file=self.file,
                             line=line) from None
        finally:
            loader.dispose()
        if not isinstance(self.data, dict):
            raise EulerError("a spec must be a mapping of keys (name, kind, …)", file=self.file, line=1)

    def _index(self, node: yaml.Node, path: tuple) -> None:
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for k, v in node.value:
                key = k.value
                if key in seen:
                    raise EulerError("duplicate key", file=self.file, line=k.start_mark.line + 1,
                                     key=".".join(map(str, path + (key,))))
                seen.add(key)
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
        return float(value)
