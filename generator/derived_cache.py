"""The op builds made before: whether one is intact where it lies (`reusable`, `reused`: its
build key again, each file's sha256 its entry's), and every build kept by what it was made
from: the generator's sources (its fingerprint), the spec's path and its bytes. A spec
edited back to a version built before (a user trying an idea, then undoing it) gets its
manifest entry and files from here for a hash, as an unchanged one gets them from its
build folder: nothing derived, sympy not imported. build.py checks what it finds here as it
checks its own folder, so a damaged or stale entry is built again. Entries live in
$EULERGEN_CACHE/derived/<key>/ (entry.json, cuda/, numpy/, c/), written atomically,
entry.json last."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from eulergen import PACKAGE_DIR, cache_dir
from eulergen.files import write_atomic

ENTRY = "entry.json"
TRAIN_C = "c_train"   # the manifest key of an op's C of training (docs/internals.md, "Manifest")
FILES = ("cuda", "numpy", "c", TRAIN_C)   # the manifest keys of an op's files, each with a _sha256


def reusable(prev: dict | None, key: str, root: Path) -> dict[str, bytes] | None:
    """The files of an op built before with the same key, if they are intact under `root`."""
    if not prev or prev.get("build_key") != key:
        return None
    files = {}
    for path_key in FILES:
        rel, sha_key = prev.get(path_key), f"{path_key}_sha256"
        if rel is None:
            continue
        try:
            data = (root / rel).read_bytes()
        except OSError:
            return None
        if hashlib.sha256(data).hexdigest() != prev.get(sha_key):
            return None
        files[rel] = data
    return files


def reused(prev: dict, key_of, root: Path) -> dict[str, bytes] | None:
    """The files of an earlier entry whose key, as its listed templates give it
    (`key_of(templates)`), is still its build key."""
    if not isinstance(prev, dict) or (templates := _listed_templates(prev)) is None:
        return None
    try:
        return reusable(prev, key_of(templates), root)
    except OSError:   # a listed template is gone
        return None


def _listed_templates(entry: dict) -> list[Path] | None:
    """The templates a manifest entry says its op renders through (None: it says none)."""
    listed = entry.get("templates")
    if not (isinstance(listed, list) and all(isinstance(t, str) for t in listed)):
        return None
    return [PACKAGE_DIR / t for t in listed]   # relative to the package, or absolute


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
