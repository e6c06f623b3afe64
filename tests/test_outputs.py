"""The one rule for what a command writes (eulergen/outputs.py): a folder eulergen replaces
whole lists what it wrote and is replaced again only while it holds nothing else; a file is
written only where nothing is; a folder named through a link is written in place."""
from __future__ import annotations

import os

import pytest

from eulergen import outputs
from eulergen.errors import EulerError


def test_a_folder_is_replaced_while_it_holds_only_what_the_command_wrote(tmp_path):
    out = tmp_path / "out"
    outputs.replace_folder(out, {"a.json": b"1", "b.bin": lambda p: p.write_bytes(b"2")},
                           by="export")
    assert outputs.listed(out, "export") == {"a.json", "b.bin", ".eulergen-export"}
    outputs.replace_folder(out, {"a.json": b"3"}, by="export")   # b.bin goes: it was ours
    assert sorted(p.name for p in out.iterdir()) == [".eulergen-export", "a.json"]
    (out / "notes.md").write_text("the user's")
    with pytest.raises(EulerError, match=r"holds files export did not write \(notes.md\)"):
        outputs.replace_folder(out, {"a.json": b"4"}, by="export")
    assert (out / "a.json").read_bytes() == b"3" and (out / "notes.md").read_text() == "the user's"
    # another command's marker is not this one's
    with pytest.raises(EulerError, match="holds files prepare did not write"):
        outputs.replace_folder(out, {"a.json": b"4"}, by="prepare")


def test_a_file_is_written_only_where_nothing_is(tmp_path):
    path = tmp_path / "t.json"
    outputs.write_new(path, b"first", by="tokenizer train")
    for there in (path, tmp_path / "link"):
        if there.name == "link":
            os.symlink("nowhere", there)   # a dangling link is something there too
        with pytest.raises(EulerError, match="a file is there already: not overwritten"):
            outputs.write_new(there, b"second", by="tokenizer train")
    assert path.read_bytes() == b"first" and os.readlink(tmp_path / "link") == "nowhere"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "t.json"]   # no temp file left


def test_a_folder_named_through_a_link_is_checked_in_place_but_never_replaced(tmp_path):
    (tmp_path / "real").mkdir()
    os.symlink("real", tmp_path / "out")
    outputs.check_folder(tmp_path / "out", lambda name: False, by="prepare")   # empty: fine
    (tmp_path / "real" / "mine.txt").write_text("x")
    with pytest.raises(EulerError, match=r"holds files prepare did not write \(mine.txt\)"):
        outputs.check_folder(tmp_path / "out", lambda name: False, by="prepare")
    with pytest.raises(EulerError, match="a symlink .to real.: export replaces its folder whole"):
        outputs.replace_folder(tmp_path / "out", {"a": b""}, by="export")
    assert os.readlink(tmp_path / "out") == "real"


def test_into_a_marked_folder_a_file_is_replaced_elsewhere_never(tmp_path):
    outputs.write_into(tmp_path, "loss.png", b"1", command="run", by="plot")
    with pytest.raises(EulerError, match="not overwritten"):
        outputs.write_into(tmp_path, "loss.png", b"2", command="run", by="plot")
    outputs.marker(tmp_path, "run").write_text("{}")
    outputs.write_into(tmp_path, "loss.png", b"3", command="run", by="plot")
    assert (tmp_path / "loss.png").read_bytes() == b"3"
