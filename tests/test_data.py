"""Token files (llm.c shards, nanoGPT .bin), the resumable loader, builtin:stdlib."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from eulergen.errors import EulerError
from eulergen.runtime.train.config import load_config
from eulergen.runtime.data.loader import (HEADER_BYTES, DataLoader, make_loaders, open_tokens,
                                   stdlib_files, stdlib_tokens, write_shard)
from eulergen.runtime.data.tokenizer import BYTE_EOT


def _header(magic, version, count):
    h = np.zeros(256, dtype="<i4")
    h[:3] = (magic, version, count)
    return h.tobytes()


def test_llmc_uint16_shard_round_trips(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16) * 50
    digest = write_shard(tmp_path / "d_train_000001.bin", tokens)
    assert digest == hashlib.sha256((tmp_path / "d_train_000001.bin").read_bytes()).hexdigest()
    got = open_tokens(tmp_path / "d_train_000001.bin")
    assert got.dtype == np.uint16 and isinstance(got, np.memmap)
    np.testing.assert_array_equal(got, tokens)
    assert (tmp_path / "d_train_000001.bin").stat().st_size == HEADER_BYTES + 2000


def test_llmc_uint32_shard_under_magic_20240801(tmp_path):
    tokens = np.array([0, 70000, 100000, 3], dtype=np.uint32)
    write_shard(tmp_path / "wide.bin", tokens)
    got = open_tokens(tmp_path / "wide.bin")
    assert got.dtype == np.uint32
    np.testing.assert_array_equal(got, tokens)
    assert list(np.fromfile(tmp_path / "wide.bin", dtype="<i4", count=3)) == [20240801, 7, 4]


def test_nanogpt_headerless_bin(tmp_path):
    tokens = np.array([5, 6, 7, 50256], dtype=np.uint16)
    tokens.tofile(tmp_path / "train.bin")
    np.testing.assert_array_equal(open_tokens(tmp_path / "train.bin"), tokens)


def test_model_checkpoint_magic_is_named(tmp_path):
    path = tmp_path / "train_000001.bin"
    path.write_bytes(_header(20240326, 3, 10) + bytes(40))
    with pytest.raises(EulerError) as err:
        open_tokens(path)
    assert str(err.value) == (f"{path}: header magic 20240326 is a model checkpoint, "
                              "not a token shard (expected 20240520 or 20240801)")


def test_wrong_magic_on_an_llmc_shard_name(tmp_path):
    path = tmp_path / "fineweb_val_000000.bin"
    path.write_bytes(_header(12345, 1, 10) + bytes(20))
    with pytest.raises(EulerError, match="header magic 12345 is not an llm.c token shard"):
        open_tokens(path)


def test_truncated_body_is_reported(tmp_path):
    path = tmp_path / "t_train_000001.bin"
    path.write_bytes(_header(20240520, 1, 100) + bytes(150))
    with pytest.raises(EulerError, match="truncated: header says 100 tokens, body holds 75"):
        open_tokens(path)


def test_truncated_header_and_odd_nanogpt_file(tmp_path):
    short = tmp_path / "short.bin"
    short.write_bytes(_header(20240520, 1, 100)[:100])
    with pytest.raises(EulerError, match="shorter than the 1024-byte header"):
        open_tokens(short)
    odd = tmp_path / "train.bin"
    odd.write_bytes(bytes(7))
    with pytest.raises(EulerError, match="not a whole number of uint16 tokens"):
        open_tokens(odd)


def test_wrong_version_is_reported(tmp_path):
    path = tmp_path / "v.bin"
    path.write_bytes(_header(20240520, 7, 1) + bytes(2))
    with pytest.raises(EulerError, match="header version 7 is not supported under magic 20240520 "
                                         r"\(expected 1\)"):
        open_tokens(path)


def test_missing_paths(tmp_path):
    with pytest.raises(EulerError, match="token file not found"):
        open_tokens(tmp_path / "nope.bin")
    with pytest.raises(EulerError, match="no token files match"):
        DataLoader(str(tmp_path / "*_train_*.bin"), 2, 4)


def _shards(tmp_path, sizes):
    start = 0
    for i, n in enumerate(sizes):
        write_shard(tmp_path / f"x_train_{i:06d}.bin", np.arange(start, start + n) % 65536)
        start += n
    return str(tmp_path / "x_train_*.bin")


def test_batches_are_shifted_int32_windows(tmp_path):
    loader = DataLoader(_shards(tmp_path, [1000]), 2, 8, seed=0, shuffle=False)
    x, y = next(loader)
    assert x.dtype == np.int32 and x.shape == (2, 8)
    np.testing.assert_array_equal(x.ravel(), np.arange(16))
    np.testing.assert_array_equal(y.ravel(), np.arange(1, 17))
    x, _ = next(loader)
    np.testing.assert_array_equal(x.ravel(), np.arange(16, 32))


def test_one_epoch_covers_every_row_once_then_reshuffles(tmp_path):
    # rows of T+1 = 9 tokens at stride 8: 20, 40 and 12 rows, all used by batches of 2
    loader = DataLoader(_shards(tmp_path, [161, 321, 97]), 2, 8, seed=3)
    batches = (20 + 40 + 12) // 2
    first = np.concatenate([next(loader)[0][:, 0] for _ in range(batches)]).tolist()
    assert len(set(first)) == 72
    assert loader.state()["epoch"] == 0
    second = np.concatenate([next(loader)[0][:, 0] for _ in range(batches)]).tolist()
    assert sorted(second) == sorted(first) and second != first
    assert loader.state()["epoch"] == 1


def test_shuffled_batch_rows_come_from_all_over_the_shard(tmp_path):
    loader = DataLoader(_shards(tmp_path, [8001]), 4, 8, seed=0)
    x, y = next(loader)
    starts = sorted(x[:, 0].tolist())
    assert all(s % 8 == 0 for s in starts)
    assert starts != list(range(starts[0], starts[0] + 32, 8))   # not one contiguous block
    np.testing.assert_array_equal(y[:, :-1], x[:, 1:])


def test_same_seed_same_stream_other_seed_other_stream(tmp_path):
    pattern = _shards(tmp_path, [500, 500])
    a = [next(DataLoader(pattern, 2, 8, seed=1))[0] for _ in range(3)]
    b = [next(DataLoader(pattern, 2, 8, seed=1))[0] for _ in range(3)]
    c = [next(DataLoader(pattern, 2, 8, seed=2))[0] for _ in range(3)]
    np.testing.assert_array_equal(np.stack(a), np.stack(b))
    assert not np.array_equal(np.stack(a), np.stack(c))


def test_restore_continues_at_the_same_position_across_epochs(tmp_path):
    pattern = _shards(tmp_path, [200, 90, 300])
    loader = DataLoader(pattern, 2, 8, seed=7)
    for _ in range(37):  # past the end of the first epoch (12 + 5 + 18 batches)
        next(loader)
    saved = dict(loader.state())
    expected = [next(loader) for _ in range(40)]
    resumed = DataLoader(pattern, 2, 8, seed=7, position=saved)
    for (x, y), (rx, ry) in zip(expected, (next(resumed) for _ in range(40))):
        np.testing.assert_array_equal(x, rx)
        np.testing.assert_array_equal(y, ry)


def test_restore_with_another_seed_is_refused(tmp_path):
    pattern = _shards(tmp_path, [200])
    state = DataLoader(pattern, 2, 8, seed=7).state()
    with pytest.raises(EulerError, match="saved with seed 7"):
        DataLoader(pattern, 2, 8, seed=8, position=state)


def test_token_ids_past_the_vocabulary_are_refused(tmp_path):
    write_shard(tmp_path / "g_train_000000.bin", np.full(100, 50256))
    loader = DataLoader(str(tmp_path / "g_train_*.bin"), 2, 8, vocab_size=256)
    with pytest.raises(EulerError, match=r"g_train_000000.bin: token id 50256 is outside the "
                                         r"model's vocabulary \(model.vocab_size 256\)"):
        next(loader)


def test_too_little_data_for_one_batch(tmp_path):
    with pytest.raises(EulerError, match=r"too few tokens for one batch.*B\*T\+1 = 65"):
        DataLoader(_shards(tmp_path, [50]), 8, 8)


def test_stdlib_files_are_sorted_source_without_site_packages():
    files = stdlib_files()
    assert len(files) > 100
    assert all(f.suffix == ".py" and "site-packages" not in f.parts for f in files)
    assert any(f.name == "difflib.py" for f in files)


def test_builtin_stdlib_is_cached_byte_level_split(tmp_path):
    paths = stdlib_tokens(tmp_path)
    train, val = open_tokens(paths["train"]), open_tokens(paths["val"])
    assert 5 * len(val) < len(train)
    assert int(train.max()) < 256 and train[-1] == BYTE_EOT
    mtime = paths["train"].stat().st_mtime_ns
    assert stdlib_tokens(tmp_path) == paths and paths["train"].stat().st_mtime_ns == mtime
    files = stdlib_files()
    first, tenth = files[0].read_bytes(), files[9].read_bytes()
    assert bytes(train[:len(first)].astype(np.uint8)) == first
    assert bytes(val[:len(tenth)].astype(np.uint8)) == tenth


def test_make_loaders_for_the_default_config(tmp_path):
    cfg = load_config()
    train, val = make_loaders(cfg, cache_dir=tmp_path)
    assert train.files[0].name == "train.bin" and val.files[0].name == "val.bin"
    x, y = next(train)
    assert x.shape == (cfg.training.batch_size, cfg.training.seq_len) and int(x.max()) < 256
    np.testing.assert_array_equal(next(val)[0], next(make_loaders(load_config(), tmp_path)[1])[0])
