"""Reading a config file and typing its values: the file's mapping with each key's line
(through eulergen/userfiles.py), and a given section's keys checked against its dataclass's
field types (numeric strings read as numbers, as YAML 1.1 leaves `6e-4` a string)."""
from __future__ import annotations

import json
import math
import typing
from pathlib import Path
from typing import Any

import yaml

from eulergen import PACKAGE_DIR
from eulergen.errors import EulerError, suggest
from eulergen.userfiles import compose_yaml, construct_yaml, load_json, read_text


def locate(path: Path) -> Path:
    """`path` as given, or else the shipped file of that relative name, so that
    `--config config/gpt2-small.json` works from any folder once eulergen is installed."""
    if path.exists() or path.is_absolute():
        return path
    shipped = PACKAGE_DIR / path
    return shipped if shipped.is_file() else path


def read_file(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """The file's mapping and the line of each key. Read through eulergen/userfiles.py:
    aliases and nesting bounded before expansion, a key given twice refused."""
    text = read_text(path, "config file")
    file = str(path)
    root = None
    if path.suffix == ".json":
        # read as YAML too, for positions (where that fails, none) and so that a key
        # given twice is named with both its lines
        try:
            root = compose_yaml(text, file)
        except EulerError as err:
            if "given twice" in err.message:
                raise
        data = load_json(text, file)
    else:
        root = compose_yaml(text, file)
        data = None if root is None else construct_yaml(root, file)
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise EulerError("expected a mapping of sections (model, training, data)", file=str(path))
    return data, key_lines(root)


def key_lines(root) -> dict[str, int]:
    """Line of each `section.key` (and section), for error messages."""
    lines: dict[str, int] = {}
    if not isinstance(root, yaml.MappingNode):
        return lines
    for key_node, value_node in root.value:
        section = str(key_node.value)
        lines[section] = key_node.start_mark.line + 1
        if isinstance(value_node, yaml.MappingNode):
            for sub_key, _ in value_node.value:
                lines[f"{section}.{sub_key.value}"] = sub_key.start_mark.line + 1
    return lines


def typed(cls: type, given: dict[str, Any], section: str, fail) -> dict[str, Any]:
    """Check each given key exists and has the field's type; returns only the given keys."""
    hints = typing.get_type_hints(cls)
    out: dict[str, Any] = {}
    for key, value in given.items():
        full = f"{section}.{key}"
        if key not in hints:
            fail(full, "unknown key" + suggest(str(key), list(hints)))
        out[key] = coerce(hints[key], value, full, fail)
    return out


def coerce(hint: Any, value: Any, key: str, fail) -> Any:
    args = typing.get_args(hint)
    if type(None) in args:
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
    if hint is bool:
        if isinstance(value, bool):
            return value
        fail(key, f"expected true or false, got {show(value)}")
    if hint is int:
        number = as_number(value)
        if isinstance(number, int) and abs(number) >= 2**63:   # past float(): no size is
            fail(key, f"expected an integer, got one of {len(str(number)):,} digits")
        if number is not None and float(number).is_integer():
            return int(number)
        fail(key, f"expected an integer, got {show(value)}")
    if hint is float:
        number = as_number(value)
        if number is not None and math.isfinite(number):
            return float(number)
        fail(key, f"expected a number, got {show(value)}")
    if hint is str:
        if isinstance(value, str):
            return value
        fail(key, f"expected a string, got {show(value)}")
    raise AssertionError(f"config field {key} has unsupported type {hint}")


def as_number(value: Any) -> float | int | None:
    """Numbers, and numeric strings: PyYAML reads `6e-4` as a string (YAML 1.1)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def show(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:60] + f"… ({len(text):,} characters)"
