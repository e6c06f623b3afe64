"""The one reader of foreign files (eulergen/userfiles.py): links to regular files are read
(a data folder of links, the Hugging Face cache), what is no regular file is refused before
it is read, whole reads are bounded, JSON fields typed, safetensors tensors read exactly."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

from eulergen.errors import EulerError
from eulergen.userfiles import Fields, read_bytes, read_json, read_safetensors


def test_a_link_to_a_regular_file_is_read_and_a_fifo_refused_without_waiting(tmp_path):
    (tmp_path / "blob").write_text('{"a": 1}')
    os.symlink("blob", tmp_path / "config.json")
    assert read_json(tmp_path / "config.json", "config file") == {"a": 1}
    os.mkfifo(tmp_path / "pipe")   # no writer: opening it for reading would block
    start = time.monotonic()
    with pytest.raises(EulerError, match="pipe: a FIFO, not a regular file"):
        read_bytes(tmp_path / "pipe", "config file")
    assert time.monotonic() - start < 1


def test_a_whole_read_is_refused_past_its_limit_from_the_size(tmp_path):
    path = tmp_path / "big"
    with open(path, "wb") as f:
        f.truncate(1 << 40)   # a terabyte of holes: refused from its size, never read
    with pytest.raises(EulerError, match="1,099,511,627,776 bytes: a spec file is at most 100"):
        read_bytes(path, "spec file", limit=100)
    (tmp_path / "small").write_bytes(b"a" * 100)
    assert read_bytes(tmp_path / "small", "spec file", limit=100) == b"a" * 100


def test_fields_are_typed_and_ranged_naming_the_key():
    f = Fields({"n": 3, "b": True, "s": "x", "o": {"k": "v"}, "big": 10**30}, "c.json")
    assert (f.int("n", lo=1), f.flag("b"), f.text("s"), f.fields("o").text("k")) == (3, True, "x", "v")
    assert f.int("gone", None) is None and f.number("gone", 2) == 2.0
    for call, says in ((lambda: f.int("b"), "c.json: b: expected an integer, got true"),
                       (lambda: f.int("n", hi=2), "c.json: n: 3 is outside 0..2"),
                       (lambda: f.number("s"), 'c.json: s: expected a finite number, got the string "x"'),
                       (lambda: f.fields("o").int("k"), 'c.json: o.k: expected an integer'),
                       (lambda: f.int("big", hi=2**31), "c.json: big: 1000000000000000000000000000000 is outside"),
                       (lambda: f.text("missing"), "c.json: missing: missing")):
        with pytest.raises(EulerError) as err:
            call()
        assert str(err.value).startswith(says), str(err.value)


def test_safetensors_are_read_bit_exact_in_float32(tmp_path):
    from safetensors.numpy import save_file
    rng = np.random.default_rng(0)
    tensors = {"a": rng.standard_normal((3, 5)).astype(np.float32),
               "b": rng.standard_normal(7).astype(np.float16), "empty": np.zeros((0, 4), np.float32)}
    save_file(tensors, str(tmp_path / "w.safetensors"))
    back = read_safetensors(tmp_path / "w.safetensors")
    assert back.keys() == tensors.keys()
    for name, value in tensors.items():
        assert back[name].dtype == np.float32 and back[name].shape == value.shape
        assert np.array_equal(back[name], value.astype(np.float32)), name
