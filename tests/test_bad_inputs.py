"""The bad-input corpus (tests/bad_inputs/) through the CLI, in process: each case exits
with its code (2: a refused input), prints one line on stderr naming the file, key or flag
at fault with the expected fragment (besides eulergen's own status lines), no traceback,
answers within its bound (a watchdog turns a hang into a failure), and changes nothing it
was given on disk (special files and links are compared without being read)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import stat
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from bad_inputs.case import FAULTS, QUICK, Case, Special
from bad_inputs.cases import CASES, SURFACES
from eulergen.cli import main


def digest(folder: Path) -> dict[str, str]:
    """Every entry under `folder`: a file's sha256 (past 1 MiB, a case's sparse file, its
    size and mtime), a link's target, or its kind."""
    out = {}
    for p in sorted(folder.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(folder))] = (
            f"-> {os.readlink(p)}" if stat.S_ISLNK(st.st_mode) else
            f"{st.st_size} bytes at {st.st_mtime_ns}" if stat.S_ISREG(st.st_mode) and
            st.st_size > 1 << 20 else
            hashlib.sha256(p.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else
            "dir" if stat.S_ISDIR(st.st_mode) else f"mode {stat.S_IFMT(st.st_mode):o}")
    return out


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory, shard) -> dict[str, Path]:
    """The shared inputs cases copy in: a byte-level shard, a finished two-step run, that
    run with a NaN weight, and recording a tokenizer (tok.json, which a case brings) other
    than the one it names now, and the run exported as a transformers folder would be saved
    (no export marker, a generation_config.json)."""
    from safetensors.numpy import load_file, save_file
    root = tmp_path_factory.mktemp("fixtures")
    shutil.copy(shard, root / "text_train.bin")
    cli = CliRunner()
    got = cli.invoke(main, ["train", "--run-dir", str(root / "run"), *QUICK,
                            "--set", f"data.dataset={shard}", "--set", "data.val_dataset=null"])
    assert got.exit_code == 0, got.output
    shutil.copytree(root / "run", root / "nanrun")
    weights = next((root / "nanrun").glob("ckpt_*")) / "model.safetensors"
    tensors = load_file(weights)
    tensors["h.0.ln_1.weight"] = np.full_like(tensors["h.0.ln_1.weight"], np.nan)
    save_file(tensors, weights)
    shutil.copytree(root / "run", root / "tokrun")   # trained with a tok.json since changed
    state = next((root / "tokrun").glob("ckpt_*")) / "state.json"
    record = json.loads(state.read_text())
    record["config"]["data"]["tokenizer"] = "tok.json"
    record["tokenizer_digest"] = "sha256:" + "0" * 64
    state.write_text(json.dumps(record))
    got = cli.invoke(main, ["export", str(root / "run"), "--out", str(root / "hf")])
    assert got.exit_code == 0, got.output
    (root / "hf" / ".eulergen-export").unlink()
    (root / "hf" / "generation_config.json").write_text('{"max_length": 20}')
    return {"shard": root / "text_train.bin", "run": root / "run", "nanrun": root / "nanrun",
            "tokrun": root / "tokrun", "hf": root / "hf"}


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
        path.unlink(missing_ok=True)   # a fixture's file the case replaces (or takes away)
        if isinstance(content, Special):
            if content.kind == "fifo":
                os.mkfifo(path)
            elif content.kind == "link":
                os.symlink(content.arg, path)
            elif content.kind == "sparse":
                with open(path, "wb") as f:
                    f.truncate(content.arg)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")


@contextmanager
def watchdog(seconds: float):
    """Raise TimeoutError in the command after `seconds`: a hang fails, never blocks CI."""
    def expire(signum, frame):
        raise TimeoutError(f"no answer within {seconds:g} s")
    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_the_corpus_is_large_covers_every_surface_and_class_and_its_ids_are_unique():
    assert len(CASES) >= 200
    assert len({c.id for c in CASES}) == len(CASES)
    assert {c.surface for c in CASES} == set(SURFACES)
    assert {c.fault for c in CASES} == set(FAULTS)


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
    start = time.monotonic()
    with watchdog(case.seconds + 10):
        got = CliRunner().invoke(main, list(case.args), input=case.stdin)
    took = time.monotonic() - start
    assert got.exception is None or isinstance(got.exception, SystemExit), \
        (got.exception, got.output)
    assert "Traceback" not in got.output, got.output
    assert got.exit_code == case.code, got.output
    lines = [line for line in got.stderr.splitlines() if line.strip()]
    said = [line for line in lines if line.lower().startswith(("error:", "warning:"))]
    assert len(said) == 1, got.stderr
    assert all(line in said or line.startswith("eulergen") for line in lines), got.stderr
    assert case.says in said[0], said[0]
    where = case.where or next(iter(case.files), None)
    assert where is None or where in said[0], f"the message names no {where!r}: {said[0]}"
    assert took <= case.seconds, f"answered after {took:.1f} s, past its {case.seconds:g} s"
    after = digest(folder)
    if case.new_files:
        after = {k: v for k, v in after.items() if k in before}
    assert after == before, "the command changed files it was given"
