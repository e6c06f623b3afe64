"""What a prepared folder's manifest, prepare.json, holds (runtime/data/prepare.py writes
it), read with every field typed; and whether token files are a tokenizer's, as the
manifest beside them (or builtin:stdlib, which is bytes) says."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from eulergen.errors import EulerError
from eulergen.runtime.data.loader import is_stdlib_folder
from eulergen.runtime.data.tokenizer import BYTE
from eulergen.userfiles import Fields, read_json

STATE_FILE = "prepare.json"
FORMAT = 1


@dataclass(frozen=True)
class ShardRecord:
    file: str
    tokens: int
    sha256: str


@dataclass(frozen=True)
class PrepareState:
    """What prepare.json holds: `settings` must match on a rerun; the rest is progress."""
    settings: dict
    shards: tuple[ShardRecord, ...] = ()
    documents: int = 0        # documents wholly written (or skipped)
    carry: int = 0            # tokens of document `documents` already in the shards
    tokens: int = 0
    skipped: int = 0          # documents left out as not UTF-8 (--on-bad-text skip)
    done: bool = False

    def to_json(self) -> bytes:
        data = {"format": FORMAT, **asdict(self)}
        return (json.dumps(data, indent=1) + "\n").encode("utf-8")

    @classmethod
    def read(cls, path: Path) -> "PrepareState":
        """A manifest, every field typed (a shard's file a name in its folder)."""
        f = Fields(read_json(path, "prepare manifest"), str(path))
        if f.data.get("format") != FORMAT:
            raise f.error("format", f"{show(f.data.get('format'))}: not a prepare manifest "
                                    f"this version reads (format {FORMAT})")
        shards = []
        for n, item in enumerate(f.list("shards", [])):
            shard = Fields(item, str(path), f"shards.{n}.")
            file = shard.text("file")
            if Path(file).name != file:
                raise shard.error("file", f"{file!r} is not a file name in this folder")
            shards.append(ShardRecord(file, shard.int("tokens"), shard.text("sha256")))
        return cls(settings=f.fields("settings").data, shards=tuple(shards),
                   documents=f.int("documents", 0), carry=f.int("carry", 0),
                   tokens=f.int("tokens", 0), skipped=f.int("skipped", 0),
                   done=f.flag("done", False))


def check_prepared_with(files, name: str, digest: str, key: str = "data.tokenizer") -> None:
    """Refuse token files that another tokenizer made than the one named `name` whose
    digest is `digest` (ids of one tokenizer read through another are noise the model would
    learn): as a prepared folder's manifest says, or builtin:stdlib's, which is bytes."""
    for folder in sorted({Path(f).parent for f in files}):
        if is_stdlib_folder(folder):
            made, where = {"tokenizer": BYTE, "tokenizer_digest": BYTE}, folder
        elif (folder / STATE_FILE).exists():
            made, where = PrepareState.read(folder / STATE_FILE).settings, folder / STATE_FILE
        else:
            continue
        if made.get("tokenizer_digest") != digest:
            raise EulerError(f"the data was prepared with tokenizer {made.get('tokenizer')!r}, "
                             f"not {name!r} (digests differ): name the tokenizer it was made "
                             "with", file=str(where), key=key)



def show(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 120 else text[:117] + "…"   # a source may list many files
