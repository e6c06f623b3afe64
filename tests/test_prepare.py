"""`eulergen prepare` on data the tests make: shard layout, byte-identical reruns and
worker counts, resume after a stop, the output folder's guards, every source format,
bad text, unreachable datasets, and prepare → train → sample through the CLI."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from eulergen import PACKAGE_DIR
from eulergen.cli import main
from eulergen.errors import EulerError
from eulergen.runtime.data import prepare as prep
from eulergen.runtime.data.loader import HEADER_BYTES, open_tokens
from eulergen.runtime.data.prepare import STATE_FILE, Settings, prepare
from eulergen.runtime.data.sources import HubDataset, LocalFiles
from eulergen.runtime.data.tokenizer import ByteTokenizer, train_bpe

# Documents the tests own: this package's Python source, one file a document.
DOCS = [p.read_text(encoding="utf-8") for p in sorted((PACKAGE_DIR / "runtime").rglob("*.py"))]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return train_bpe(DOCS, 400, tmp_path_factory.mktemp("tok") / "tok.json")


@pytest.fixture
def texts(tmp_path) -> Path:
    folder = tmp_path / "texts"
    folder.mkdir()
    for i, doc in enumerate(DOCS):
        (folder / f"doc{i:02d}.txt").write_text(doc, encoding="utf-8")
    return folder


def _files(out: Path) -> list[Path]:
    """The shards in order: val 000000 first, then train 000001, …"""
    return sorted(out.glob("*.bin"), key=lambda p: p.stem[-6:])


def _shards(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in _files(out)}


def _tokens(out: Path) -> np.ndarray:
    return np.concatenate([np.asarray(open_tokens(p)) for p in _files(out)])


SMALL = Settings(shard_tokens=20_000, val_tokens=8_000)


def test_val_shard_then_train_shards_with_eot_before_every_document(texts, tmp_path):
    out = tmp_path / "out"
    state = prepare(LocalFiles([str(texts)]), out, ByteTokenizer(), SMALL, workers=1)
    expected = np.concatenate([np.frombuffer(b"\0" + d.encode(), dtype=np.uint8) for d in DOCS])
    names = [p.name for p in _files(out)]
    assert names[0] == "out_val_000000.bin" and names[1] == "out_train_000001.bin"
    assert len(open_tokens(out / names[0])) == 8_000
    assert all(len(open_tokens(out / n)) == 20_000 for n in names[1:-1])
    np.testing.assert_array_equal(_tokens(out), expected)
    assert state.done and state.tokens == expected.size and state.documents == len(DOCS)
    manifest = json.loads((out / STATE_FILE).read_text())
    assert [s["file"] for s in manifest["shards"]] == names
    assert manifest["settings"]["tokenizer"] == "byte" and manifest["settings"]["shard_tokens"] == 20_000


def test_shards_are_byte_identical_across_worker_counts_and_reruns(texts, tmp_path, bpe):
    one, two = tmp_path / "one" / "d", tmp_path / "two" / "d"
    prepare(LocalFiles([str(texts)]), one, bpe, SMALL, workers=1)
    prepare(LocalFiles([str(texts)]), two, bpe, SMALL, workers=2)
    assert _shards(one) == _shards(two) and len(_shards(one)) >= 3
    assert int(_tokens(one).max()) >= 256, "the BPE's merges should appear"
    times = {p: p.stat().st_mtime_ns for p in one.iterdir()}
    state = prepare(LocalFiles([str(texts)]), one, bpe, SMALL, workers=2)
    assert state.done and {p: p.stat().st_mtime_ns for p in one.iterdir()} == times


class _Stop(Exception):
    pass


def _stop_after(monkeypatch, calls: int, target: str):
    """Make the `calls`+1-th call of prep.<target> raise, as a kill at that point would."""
    real, seen = getattr(prep, target), []

    def wrapped(*args, **kwargs):
        if len(seen) == calls:
            raise _Stop
        seen.append(args)
        return real(*args, **kwargs)
    monkeypatch.setattr(prep, target, wrapped)


class _CountingTokenizer(ByteTokenizer):
    encoded: list[str] = []

    def encode(self, text):
        self.encoded.append(text)
        return super().encode(text)


@pytest.mark.parametrize("where", ["before the 4th shard", "between a shard and the state"])
def test_a_stopped_run_resumes_to_the_same_bytes_without_retokenizing(texts, tmp_path, monkeypatch, where):
    prepare(LocalFiles([str(texts)]), tmp_path / "straight" / "d", ByteTokenizer(), SMALL, workers=1)
    out = tmp_path / "stopped" / "d"
    with monkeypatch.context() as m:
        if where == "before the 4th shard":
            _stop_after(m, 3, "write_shard")
        else:   # shard 3 under its final name, prepare.json still says 3 shards
            _stop_after(m, 4, "write_atomic")    # the first write is the fresh state
        with pytest.raises(_Stop):
            prepare(LocalFiles([str(texts)]), out, ByteTokenizer(), SMALL, workers=1)
    (out / ".d_train_000004.bin.x1y2.tmp").write_bytes(b"half a shard")   # a killed write
    state = json.loads((out / STATE_FILE).read_text())
    assert len(state["shards"]) == 3 and not state["done"]
    tok = _CountingTokenizer()
    tok.encoded = []
    prepare(LocalFiles([str(texts)]), out, tok, SMALL, workers=1)
    assert _shards(out) == _shards(tmp_path / "straight" / "d")
    assert not list(out.glob(".*.tmp"))
    # the 3 finished shards' documents are skipped: only the one they cut is read again
    assert len(tok.encoded) == len(DOCS) - state["documents"]
    assert tok.encoded[0] == DOCS[state["documents"]]


def test_rerun_with_other_settings_is_refused(texts, tmp_path, bpe):
    out = tmp_path / "d"
    prepare(LocalFiles([str(texts)]), out, ByteTokenizer(), SMALL, workers=1)
    with pytest.raises(EulerError) as err:
        prepare(LocalFiles([str(texts)]), out, ByteTokenizer(), Settings(10_000, 8_000), workers=1)
    assert str(err.value) == (f"{out / STATE_FILE}: shard_tokens: this folder was prepared with "
                              "shard_tokens = 20000, not 10000: rerun with its settings, or name "
                              "another folder")
    with pytest.raises(EulerError, match="prepared with tokenizer = \"byte\", not \"/"):
        prepare(LocalFiles([str(texts)]), out, bpe, SMALL, workers=1)


def test_an_output_path_that_is_a_file_is_refused(texts, tmp_path):
    out = tmp_path / "shards"
    out.write_text("mine")
    with pytest.raises(EulerError) as err:
        prepare(LocalFiles([str(texts)]), out, ByteTokenizer(), SMALL, workers=1)
    assert str(err.value) == (f"{out}: --out: exists and is not a folder: prepare writes a folder "
                              "there, never over a file")
    assert out.read_text() == "mine"

def test_an_output_folder_with_foreign_files_is_refused(texts, tmp_path):
    out = tmp_path / "d"
    out.mkdir()
    (out / "notes.md").write_text("mine")
    with pytest.raises(EulerError, match=r"holds files prepare did not write \(notes.md\): never "
                                         r"written over; name a new or empty folder"):
        prepare(LocalFiles([str(texts)]), out, ByteTokenizer(), SMALL, workers=1)
    (out / "notes.md").unlink()
    prepare(LocalFiles([str(texts)]), out, ByteTokenizer(), SMALL, workers=1)
    (out / "notes.md").write_text("mine")
    with pytest.raises(EulerError, match=r"holds files prepare did not write \(notes.md\)"):
        prepare(LocalFiles([str(texts)]), out, ByteTokenizer(), SMALL, workers=1)


def test_a_truncated_or_replaced_shard_is_detected_on_rerun(texts, tmp_path):
    out = tmp_path / "d"
    prepare(LocalFiles([str(texts)]), out, ByteTokenizer(), SMALL, workers=1)
    shard = out / "d_train_000002.bin"
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    with pytest.raises(EulerError) as err:
        prepare(LocalFiles([str(texts)]), out, ByteTokenizer(), SMALL, workers=1)
    assert str(err.value) == f"{shard}: truncated: header says 20000 tokens, body holds 19950"
    checkpoint_header = np.zeros(256, dtype="<i4")
    checkpoint_header[:3] = (20240326, 3, 10)
    shard.write_bytes(checkpoint_header.tobytes() + data[HEADER_BYTES:])
    with pytest.raises(EulerError, match="header magic 20240326 is a model checkpoint"):
        prepare(LocalFiles([str(texts)]), out, ByteTokenizer(), SMALL, workers=1)
    changed = bytearray(data)
    changed[-1] ^= 1
    shard.write_bytes(bytes(changed))
    with pytest.raises(EulerError, match=r"shard differs from what prepare.json recorded .*delete "
                                         r"the folder to prepare it again"):
        prepare(LocalFiles([str(texts)]), out, ByteTokenizer(), SMALL, workers=1)


def test_jsonl_and_parquet_sources_give_the_txt_tokens(texts, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    half = len(DOCS) // 2
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"id": i, "body": d}) + "\n"
                                              for i, d in enumerate(DOCS[:half])))
    pq.write_table(pa.table({"body": DOCS[half:]}), tmp_path / "b.parquet", row_group_size=3)
    mixed = prepare(LocalFiles([str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet")], "body"),
                    tmp_path / "mixed", ByteTokenizer(), SMALL, workers=2)
    prepare(LocalFiles([str(texts)]), tmp_path / "txt", ByteTokenizer(), SMALL, workers=1)
    np.testing.assert_array_equal(_tokens(tmp_path / "mixed"), _tokens(tmp_path / "txt"))
    assert mixed.documents == len(DOCS)
    # resuming inside the parquet file skips whole row groups, then rows
    source = LocalFiles([str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet")], "body")
    assert [d.text for d in source.documents(skip=half + 4)] == DOCS[half + 4:]


def test_a_jsonl_line_without_the_text_field_names_file_and_line(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n{"body": "two"}\n')
    with pytest.raises(EulerError) as err:
        prepare(LocalFiles([str(tmp_path / "a.jsonl")]), tmp_path / "d", ByteTokenizer(), SMALL)
    assert str(err.value) == (f"{tmp_path / 'a.jsonl'}:2: text: no string field 'text' (has: body); "
                              "--text-key names the field")


def test_a_jsonl_text_field_that_is_not_a_string_names_its_type(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n{"text": 2}\n')
    with pytest.raises(EulerError) as err:
        prepare(LocalFiles([str(tmp_path / "a.jsonl")]), tmp_path / "d", ByteTokenizer(), SMALL)
    assert str(err.value) == f"{tmp_path / 'a.jsonl'}:2: text: field 'text' holds int, not text"

def test_parquet_without_the_column_lists_the_columns(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"content": ["a"], "url": ["u"]}), tmp_path / "a.parquet")
    with pytest.raises(EulerError, match=r"a.parquet: text: no column 'text' \(has: content, url\)"):
        prepare(LocalFiles([str(tmp_path / "a.parquet")]), tmp_path / "d", ByteTokenizer(), SMALL)


def test_text_that_is_not_utf8_stops_with_file_and_byte_offset_or_is_skipped(texts, tmp_path):
    bad = texts / "doc03.txt"
    data = bad.read_bytes()
    bad.write_bytes(data[:1234] + b"\xff\xfe" + data[1234:])
    with pytest.raises(EulerError) as err:
        prepare(LocalFiles([str(texts)]), tmp_path / "stop", ByteTokenizer(), SMALL, workers=1)
    assert str(err.value) == (f"{bad}: not UTF-8 at byte 1234 (--on-bad-text skip leaves such "
                              "documents out)")
    warnings = []
    state = prepare(LocalFiles([str(texts)]), tmp_path / "skip", ByteTokenizer(),
                    Settings(20_000, 8_000, "skip"), workers=2, warn=warnings.append)
    assert warnings == [f"skipped: {bad}: not UTF-8 at byte 1234"]
    assert state.skipped == 1 and state.documents == len(DOCS)
    assert state.tokens == sum(len(d.encode()) + 1 for i, d in enumerate(DOCS) if i != 3)


def test_empty_and_too_small_sources_are_clear_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(EulerError, match=r"empty: no .txt, .jsonl, .parquet files in this folder"):
        LocalFiles([str(tmp_path / "empty")])
    with pytest.raises(EulerError, match=r"nothing.txt: no such file"):
        LocalFiles([str(tmp_path / "nothing.txt")])
    (tmp_path / "blank.txt").write_text("")
    (tmp_path / "short.txt").write_text("x" * 500)
    with pytest.raises(EulerError) as err:
        prepare(LocalFiles([str(tmp_path / "blank.txt")]), tmp_path / "d", ByteTokenizer(), SMALL)
    assert str(err.value) == ("--val-tokens: the sources hold 0 tokens: too few for a validation "
                              "shard of --val-tokens 8,000 and any training tokens after it; pass "
                              "a smaller --val-tokens")
    # the same folder again with a val size that fits: nothing was written, so it starts over
    state = prepare(LocalFiles([str(tmp_path / "short.txt")]), tmp_path / "d", ByteTokenizer(),
                    Settings(1000, 300))
    assert [s.tokens for s in state.shards] == [300, 201]


def test_a_tokenizer_without_end_of_text_is_refused(texts, tmp_path):
    class NoEot(ByteTokenizer):
        eot = None
    with pytest.raises(EulerError, match="has no end-of-text token; prepare writes one before each"):
        prepare(LocalFiles([str(texts)]), tmp_path / "d", NoEot(), SMALL)


# -- Hugging Face datasets (never downloaded here: a stand-in `datasets` module) -------------

class _Stream:
    def __init__(self, rows):
        self.rows = rows

    def skip(self, n):
        return _Stream(self.rows[n:])

    def __iter__(self):
        return iter(self.rows)


def _fake_datasets(monkeypatch, load_dataset):
    module = types.ModuleType("datasets")
    module.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", module)


def test_a_streamed_dataset_is_prepared_and_resumed(texts, tmp_path, monkeypatch):
    calls = []

    def load_dataset(name, subset, split, streaming):
        calls.append((name, subset, split, streaming))
        return _Stream([{"text": d, "url": "u"} for d in DOCS])
    _fake_datasets(monkeypatch, load_dataset)
    source = HubDataset("HuggingFaceFW/fineweb-edu", "sample-10BT")
    with monkeypatch.context() as m:
        _stop_after(m, 2, "write_shard")
        with pytest.raises(_Stop):
            prepare(source, tmp_path / "hub", ByteTokenizer(), SMALL, workers=2)
    prepare(source, tmp_path / "hub", ByteTokenizer(), SMALL, workers=2)
    prepare(LocalFiles([str(texts)]), tmp_path / "local" / "hub", ByteTokenizer(), SMALL, workers=1)
    assert _shards(tmp_path / "hub") == _shards(tmp_path / "local" / "hub")
    assert calls[0] == ("HuggingFaceFW/fineweb-edu", "sample-10BT", "train", True)


def test_an_unreachable_dataset_says_so_and_suggests_local_files(tmp_path, monkeypatch):
    def load_dataset(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'HuggingFaceFW/fineweb-edu' on the Hub (LocalEntryNotFoundError)")
    _fake_datasets(monkeypatch, load_dataset)
    got = CliRunner().invoke(main, ["prepare", "--dataset", "HuggingFaceFW/fineweb-edu", "--subset",
                                    "sample-10BT", "--tokenizer", "byte", "--out", str(tmp_path / "d")])
    assert got.exit_code == 2
    assert got.output.strip() == (
        "error: --dataset: cannot reach Hugging Face dataset HuggingFaceFW/fineweb-edu (sample-10BT) "
        "(ConnectionError: Couldn't reach 'HuggingFaceFW/fineweb-edu' on the Hub "
        "(LocalEntryNotFoundError)); where the hub is unreachable, download its files elsewhere and "
        "pass the local .parquet or .jsonl files instead")


def test_the_real_datasets_library_offline_gives_the_same_error(tmp_path):
    pytest.importorskip("datasets")
    # a fresh process: huggingface_hub reads HF_HUB_OFFLINE when it is first imported
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    got = subprocess.run([sys.executable, "-c", "from eulergen.cli import main; main()", "prepare",
                          "--dataset", "no-such-user/no-such-set", "--tokenizer", "byte",
                          "--out", str(tmp_path / "d")], env=env, capture_output=True, text=True)
    assert got.returncode == 2
    assert got.stderr.startswith("error: --dataset: cannot reach Hugging Face dataset "
                                 "no-such-user/no-such-set (ConnectionError: ")
    assert got.stderr.rstrip().endswith("pass the local .parquet or .jsonl files instead")
    assert not (tmp_path / "d").exists()


# -- the whole path through the CLI ------------------------------------------------------------

def test_prepare_then_train_then_sample_through_the_cli(texts, tmp_path, bpe, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    got = runner.invoke(main, ["prepare", str(texts), "--out", "data/src", "--tokenizer",
                               str(bpe.name), "--shard-tokens", "10k", "--val-tokens", "4k",
                               "--workers", "2", "--quiet"])
    assert got.exit_code == 0, got.output
    line = next(x for x in got.output.splitlines() if x.startswith("train on it: eulergen train"))
    sets = shlex.split(line.removeprefix("train on it: eulergen train"))
    assert sets[1] == "data.dataset=data/src/src_train_*.bin" and sets[-1] == "model.vocab_size=400"
    tiny = ["model.hidden_dim=64", "model.num_layers=1", "model.max_seq_len=32",
            "model.mlp_hidden=128", "training.batch_size=4", "training.total_steps=6",
            "training.warmup_steps=2", "training.eval_every=3", "training.eval_steps=1",
            "training.sample_tokens=8", "run_dir=run"]
    got = runner.invoke(main, ["train", "--device", "numpy", *sets,
                               *(a for s in tiny for a in ("--set", s))])
    assert got.exit_code == 0, got.output
    assert "val loss" in got.output
    got = runner.invoke(main, ["sample", "run", "--prompt", "def ", "--max-new-tokens", "5",
                               "--device", "numpy"])
    assert got.exit_code == 0, got.output
    assert got.output.startswith("def ") and len(got.output) > len("def \n")


def test_prepare_cli_rejects_sources_and_dataset_together(texts, tmp_path):
    got = CliRunner().invoke(main, ["prepare", str(texts), "--dataset", "x/y", "--out", str(tmp_path)])
    assert got.exit_code == 2
    assert got.output.strip() == "error: --dataset: give local SOURCES or --dataset, not both"


@pytest.mark.parametrize("value", ["1.5x", "0", "2.5", "-3M"])
def test_token_counts_take_k_m_g_and_refuse_the_rest(texts, tmp_path, value):
    got = CliRunner().invoke(main, ["prepare", str(texts), "--out", str(tmp_path / "d"),
                                    "--tokenizer", "byte", "--shard-tokens", value])
    assert got.exit_code == 2
    assert f"'{value}' is not a positive token count (e.g. 20000, 10M, 1.5G)" in got.output
    assert not (tmp_path / "d").exists()
