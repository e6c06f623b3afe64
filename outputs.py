"""Where a command writes: one rule for every folder and file eulergen writes (run folders,
`export --out`, `prepare --out`, plot's loss.png, `tokenizer train --out`).

A command writes into a folder only when the folder is new, empty, or eulergen's own, and
never over an entry it did not write. A folder is eulergen's when it carries the marker of
the command that made it (`.eulergen-<command>`: a run folder's `.eulergen-run`, an
export's `.eulergen-export`, which lists the files it wrote) or, for prepare, the manifest
prepare.json, which lists its shards; the command says which entries it owns (`owns`), and
any other entry makes the folder foreign: refused, untouched. A folder named through a
symlink is written in place; one a command replaces whole (export) must be named itself.
A single file a command is told to write (`tokenizer train --out`) is written only where
nothing is: eulergen cannot tell its own file from another, so it never replaces one.
Writes are atomic (files.py).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

from eulergen.errors import EulerError
from eulergen.files import write_atomic
from eulergen.userfiles import Fields, read_json


def marker(folder: str | Path, command: str) -> Path:
    return Path(folder) / f".eulergen-{command}"


def marked(folder: str | Path, command: str) -> bool:
    """Whether `folder` carries `command`'s marker: a file of its own, not a link (the run
    marker is written to)."""
    path = marker(folder, command)
    return path.is_file() and not path.is_symlink()


def check_folder(folder: str | Path, owns: Callable[[str], bool], *, by: str,
                 key: str | None = None) -> None:
    """Refuse, writing nothing, a `folder` that is not a folder or holds an entry `owns`
    does not claim (a folder that does not exist yet is fine)."""
    folder = Path(folder)
    if folder.is_symlink() and not folder.exists():
        raise EulerError(f"a symlink to {os.readlink(folder)}, which does not exist",
                         file=str(folder), key=key)
    if folder.exists() and not folder.is_dir():
        raise EulerError(f"exists and is not a folder: {by} writes a folder there, never "
                         "over a file", file=str(folder), key=key)
    if not folder.is_dir():
        return
    foreign = sorted(p.name for p in folder.iterdir() if not owns(p.name))
    if foreign:
        shown = ", ".join(foreign[:3]) + (", …" if len(foreign) > 3 else "")
        raise EulerError(f"holds files {by} did not write ({shown}): never written over; name "
                         "a new or empty folder", file=str(folder), key=key)


def listed(folder: str | Path, command: str) -> frozenset[str]:
    """The names a folder's marker lists as written by `command` (none: no marker, or an
    unreadable one), and the marker itself."""
    path = marker(folder, command)
    if not marked(folder, command):
        return frozenset()
    try:
        names = Fields(read_json(path, "marker"), str(path)).list("files")
    except EulerError:
        return frozenset()
    return frozenset(n for n in names if isinstance(n, str)) | {path.name}


def replace_folder(out: str | Path, files: dict[str, bytes | Callable[[Path], None]], *,
                   by: str, key: str | None = None) -> None:
    """Write `files` (name -> bytes, or a function writing that file) as the folder `out`,
    with `by`'s marker listing them:
    into a temp folder beside it, then renamed into place. An existing `out` is replaced only
    when it is empty or holds nothing but what the same command wrote there."""
    out = Path(out)
    if out.is_symlink():   # the rename below would replace the link, not its folder
        raise EulerError(f"a symlink (to {os.readlink(out)}): {by} replaces its folder whole, "
                         "so name the folder itself", file=str(out), key=key)
    check_folder(out, listed(out, by).__contains__, by=by, key=key)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{by}-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        for name, content in files.items():
            if callable(content):
                content(tmp / name)
            else:
                (tmp / name).write_bytes(content)
        marker(tmp, by).write_text(json.dumps({"written_by": "eulergen", "files": sorted(files)})
                                   + "\n", encoding="utf-8")
        if out.is_dir():
            old = out.parent / f".tmp-{by}-old-{out.name}-{os.getpid()}"
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_new(path: str | Path, *, by: str, key: str | None = None) -> None:
    """Refuse a `path` where something is already (a file, a folder, a link)."""
    if Path(path).is_dir():
        raise EulerError(f"a folder: {by} writes a new file, never over anything",
                         file=str(path), key=key)
    if os.path.lexists(path):
        raise EulerError(f"a file is there already: not overwritten ({by} cannot tell its own "
                         "from another's); remove it or name another", file=str(path), key=key)


def write_new(path: str | Path, data: bytes, *, by: str, key: str | None = None) -> None:
    """Write `data` as the file `path`, atomically, only where nothing is: written to a temp
    file, then hard-linked into place, which fails rather than replace anything that
    appeared meanwhile."""
    path = Path(path)
    check_new(path, by=by, key=key)
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    write_atomic(tmp, data)
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise EulerError(f"a file appeared there while {by} wrote it: not overwritten",
                         file=str(path), key=key) from None
    finally:
        tmp.unlink(missing_ok=True)


def write_into(folder: str | Path, name: str, data: bytes, *, command: str, by: str) -> Path:
    """Write the file `name` into `folder`: replaced when `folder` is `command`'s (its
    marker), else only where there is no such file yet (plot's loss.png beside a metrics
    file the user keeps)."""
    path = Path(folder) / name
    if marked(folder, command):
        write_atomic(path, data)
    else:
        write_new(path, data, by=by)
    return path
