"""Checkpoints: safetensors + state.json, atomic, pruned, resilient to interrupted saves."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from eulergen.errors import EulerError
from eulergen.runtime.train import checkpoint


def _tensors(seed):
    rng = np.random.default_rng(seed)
    params = {"wte.weight": rng.standard_normal((16, 4), dtype=np.float32),
              "h.0.ln_1.weight": rng.standard_normal(4, dtype=np.float32)}
    optim = {f"{k}.{s}": rng.standard_normal(v.shape, dtype=np.float32)
             for k, v in params.items() for s in ("m", "v")}
    return params, optim


def test_save_then_load_round_trips_exactly(tmp_path):
    params, optim = _tensors(0)
    state = {"data": {"epoch": 0, "shard": 1, "batch": 5, "seed": 3},
             "rng": np.random.default_rng(1).bit_generator.state, "metrics": [{"step": 1, "train_loss": 2.5}]}
    path = checkpoint.save(tmp_path, 10, params, optim, state)
    assert path.name == "ckpt_00000010"
    assert sorted(p.name for p in path.iterdir()) == ["model.safetensors", "optim.safetensors", "state.json"]
    ck = checkpoint.load(path)
    assert ck.step == 10 and ck.state["data"] == state["data"] and ck.state["metrics"] == state["metrics"]
    assert ck.state["rng"] == json.loads(json.dumps(state["rng"]))
    for got, want in ((ck.params, params), (ck.optim, optim)):
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype
            np.testing.assert_array_equal(got[k], want[k])


def test_no_pickle_in_checkpoint_files(tmp_path):
    path = checkpoint.save(tmp_path, 1, *_tensors(0), {})
    for f in path.iterdir():
        assert b"\x80\x04\x95" not in f.read_bytes()[:64], f"{f.name} looks like a pickle"


def test_keeps_only_the_last_k_and_latest_is_newest(tmp_path):
    for step in (100, 200, 300, 400):
        checkpoint.save(tmp_path, step, *_tensors(step), {}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt_00000300", "ckpt_00000400"]
    assert checkpoint.latest(tmp_path).name == "ckpt_00000400"
    assert checkpoint.load(tmp_path).step == 400


def test_steps_sort_numerically_past_the_padding(tmp_path):
    checkpoint.save(tmp_path, 99_999_999, *_tensors(0), {})
    checkpoint.save(tmp_path, 123_456_789, *_tensors(0), {})
    assert checkpoint.load(tmp_path).step == 123_456_789


def test_saving_a_step_again_replaces_it(tmp_path):
    checkpoint.save(tmp_path, 5, *_tensors(0), {"tag": "first"})
    checkpoint.save(tmp_path, 5, *_tensors(1), {"tag": "second"})
    ck = checkpoint.load(tmp_path)
    assert ck.state["tag"] == "second"
    np.testing.assert_array_equal(ck.params["wte.weight"], _tensors(1)[0]["wte.weight"])
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt_00000005"]


def test_leftover_temp_folder_is_ignored_by_readers_and_cleaned_by_the_next_save(tmp_path):
    checkpoint.save(tmp_path, 1, *_tensors(0), {})
    partial = tmp_path / ".tmp-ckpt_00000002-999"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half")
    assert checkpoint.latest(tmp_path).name == "ckpt_00000001"
    assert checkpoint.load(tmp_path).step == 1
    # it may be a running trainer's save in progress: a reader leaves it
    assert (partial / "model.safetensors").read_bytes() == b"half"
    checkpoint.save(tmp_path, 2, *_tensors(0), {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt_00000001", "ckpt_00000002"]


def test_incomplete_checkpoint_is_skipped_by_latest(tmp_path):
    checkpoint.save(tmp_path, 1, *_tensors(0), {})
    broken = checkpoint.save(tmp_path, 2, *_tensors(0), {})
    (broken / "optim.safetensors").unlink()
    assert checkpoint.latest(tmp_path).name == "ckpt_00000001"
    with pytest.raises(EulerError, match="incomplete checkpoint: optim.safetensors is missing"):
        checkpoint.load(broken)


def test_corrupt_tensor_file_is_a_one_line_error(tmp_path):
    path = checkpoint.save(tmp_path, 1, *_tensors(0), {})
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(EulerError, match="model.safetensors: corrupt tensors"):
        checkpoint.load(path)


def test_missing_checkpoint_and_empty_run(tmp_path):
    with pytest.raises(EulerError, match="checkpoint not found"):
        checkpoint.load(tmp_path / "nope")
    with pytest.raises(EulerError, match="no checkpoint in this run folder"):
        checkpoint.load(tmp_path)
    assert checkpoint.latest(tmp_path / "nope") is None


def test_non_numpy_tensor_is_refused_before_writing(tmp_path):
    with pytest.raises(TypeError, match="expected a numpy array"):
        checkpoint.save(tmp_path, 1, {"w": [1.0, 2.0]}, {}, {})
    assert list(tmp_path.iterdir()) == []


_KILL_LOOP = """
import sys, numpy as np
from eulergen.runtime.train import checkpoint
big = {"w": np.ones((2048, 2048), np.float32)}
step = 0
while True:
    step += 1
    checkpoint.save(sys.argv[1], step, big, big, {"n": step}, keep=2)
    print(step, flush=True)
"""


def test_kill_9_during_saves_leaves_a_loadable_latest(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _KILL_LOOP, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    for _ in range(3):  # wait for three completed saves, then kill mid-stream
        proc.stdout.readline()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    ck = checkpoint.load(tmp_path)
    assert ck.step >= 3 and ck.state["n"] == ck.step
    assert ck.params["w"].shape == (2048, 2048)
    # the save the kill interrupted left a temp folder or none; the next save removes it
    checkpoint.save(tmp_path, ck.step + 1, ck.params, ck.optim, {"n": ck.step + 1}, keep=2)
    assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())
