"""The bad-input corpus (tests/bad_inputs/cases.py) through the CLI, in process: each
case exits with its code (2: a refused input), prints one error line naming the file or
flag at fault with the expected fragment, no traceback, and changes nothing on disk."""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from bad_inputs.cases import CASES, QUICK, Case
from eulergen.cli import main


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest()
                                         if p.is_file() else "dir")
            for p in sorted(folder.rglob("*"))}


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory, shard) -> dict[str, Path]:
    """The shared inputs cases copy in: a byte-level shard, and a finished two-step run."""
    root = tmp_path_factory.mktemp("fixtures")
    shutil.copy(shard, root / "text_train.bin")
    got = CliRunner().invoke(main, ["train", "--run-dir", str(root / "run"), *QUICK,
                                    "--set", f"data.dataset={shard}",
                                    "--set", "data.val_dataset=null"])
    assert got.exit_code == 0, got.output
    return {"shard": root / "text_train.bin", "run": root / "run"}


def _lay_out(case: Case, folder: Path, fixtures) -> None:
    for use in case.uses:
        if use == "shard":
            (folder / "data").mkdir(exist_ok=True)
            shutil.copy(fixtures["shard"], folder / "data" / "text_train.bin")
        else:
            shutil.copytree(fixtures[use], folder / use)
    for name, content in case.files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")


def test_the_corpus_is_large_and_its_ids_unique():
    assert len(CASES) >= 60
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, tmp_path, fixtures, monkeypatch):
    folder = tmp_path / "case"
    folder.mkdir()
    _lay_out(case, folder, fixtures)
    monkeypatch.chdir(folder)
    monkeypatch.setenv("EULERGEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("EULERGEN_OPS_PATH", raising=False)
    for key, value in case.env.items():
        monkeypatch.setenv(key, value)
    before = digest(folder)
    got = CliRunner().invoke(main, list(case.args), input=case.stdin)
    output = got.output
    assert got.exit_code == case.code, output
    assert "Traceback" not in output and not isinstance(got.exception, Exception) or \
        isinstance(got.exception, SystemExit), (got.exception, output)
    # (chat's "> " prompt has no newline after it: the terminal echoes the user's)
    lines = [line for line in (text.removeprefix("> ") for text in output.splitlines())
             if line.lower().startswith(("error:", "warning:"))]
    assert len(lines) == 1, output
    assert case.says in lines[0], output
    where = case.where or next(iter(case.files), None)
    assert where is None or where in lines[0], f"the message names no {where!r}: {lines[0]}"
    after = digest(folder)
    if case.new_files:
        after = {k: v for k, v in after.items() if k in before}
    assert after == before, "the command changed files it was given"
