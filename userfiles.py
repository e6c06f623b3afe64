"""Reading the YAML and JSON a user wrote (op specs, run configs, a run's own JSON) with
bounds checked before anything is expanded, and every fault one EulerError naming the file.

YAML: a document may hold at most YAML_MAX_NODES nodes counted with every alias expanded,
nested at most YAML_MAX_DEPTH deep. Both are counted while the document is composed (an
alias adds the size of the node it names, known once that node is whole), so a "billion
laughs" document is refused after reading its text once, before anything walks or
constructs the expansion. A key given twice in one mapping is an error naming both lines.
JSON: nesting deeper than Python's parser reaches, and a key given twice, are errors too.
"""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from eulergen.errors import EulerError

YAML_MAX_NODES = 100_000   # specs and configs hold tens to hundreds
YAML_MAX_DEPTH = 64


def read_text(path: str | Path, what: str) -> str:
    """A text file that must be UTF-8 (`what` names it in errors: 'spec', 'config')."""
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise EulerError(f"cannot read {what}: {err.strerror}", file=str(path)) from None
    return decode_text(data, path, what)


def decode_text(data: bytes, path: str | Path, what: str) -> str:
    """The bytes of the file at `path`, which must be UTF-8, as text."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        raise EulerError(f"not UTF-8 text (byte {err.start}): is this a {what} file?",
                         file=str(path), line=line) from None


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
    loader = _BoundedLoader(text, file)
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
    finally:
        loader.dispose()


def load_yaml(text: str, file: str):
    node = compose_yaml(text, file)
    return None if node is None else construct_yaml(node, file)


def load_json(text: str, file: str):
    """JSON with a key given twice refused (naming it), and nesting past what Python's
    parser reaches one error instead of a RecursionError."""
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
