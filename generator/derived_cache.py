"""The op builds made before, kept by what they were made from: the generator's sources
(its fingerprint), the spec's path and its bytes. A spec edited back to a version built
before (a user trying an idea, then undoing it) gets its manifest entry and files from
here for a hash, as an unchanged one gets them from its build folder: nothing derived,
sympy not imported. build.py checks what it finds as it checks its own folder (the build
key over the templates the entry lists, each file's sha256), so a damaged or stale entry
is built again. Entries live in $EULERGEN_CACHE/derived/<key>/ (entry.json, cuda/, numpy/),
written atomically, entry.json last."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from eulergen import cache_dir
from eulergen.files import write_atomic

ENTRY = "entry.json"


def folder(fingerprint: str, spec: Path, data: bytes) -> Path:
    h = hashlib.sha256(fingerprint.encode())
    for part in (str(Path(spec).resolve()).encode(), data):
        h.update(b"\0" + part)
    return cache_dir() / "derived" / h.hexdigest()[:32]


def entry(held: Path) -> dict | None:
    """The manifest entry kept in `held`, or None (none, unreadable)."""
    try:
        data = json.loads((held / ENTRY).read_bytes())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def store(held: Path, entry: dict, files: dict[str, bytes]) -> None:
    """Keep a build: its files (paths relative to a build folder), then its entry."""
    for rel, data in files.items():
        write_atomic(held / rel, data)
    write_atomic(held / ENTRY, json.dumps(entry).encode())
