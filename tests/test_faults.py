"""Faults during a run: an update that overflows is never saved as a checkpoint and the
error names the last good one; a disk that fills during a save (injected, and a real small
tmpfs where the machine lets us mount one) leaves the earlier checkpoints intact and ends
in one line; `sample` refuses weights it cannot sample and says when a sample is empty."""
from __future__ import annotations

import errno
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from click.testing import CliRunner

from eulergen.cli import main
from eulergen.errors import EulerError
from eulergen.runtime.train import checkpoint
from eulergen.runtime.engine.backend import NUMPY
from eulergen.runtime.train.config import load_config
from eulergen.runtime.engine.ops import OpLibrary
from eulergen.runtime.train.trainer import Trainer

from test_run_dir import cli_sets, tiny, tree_digest


@pytest.fixture(scope="module")
def lib():
    return OpLibrary(NUMPY)


def trainer(lib, shard, run, **training):
    return Trainer(load_config(None, tiny(shard, run, **training)), lib, progress=False,
                   tensorboard=False)


def test_an_overflowing_update_is_not_saved_and_the_error_names_the_last_good_one(
        lib, shard, tmp_path):
    run = tmp_path / "run"
    t = trainer(lib, shard, run, total_steps=6, checkpoint_every=2)
    step, updates = t.optim.step, []

    def overflow(control):   # the update of step 4 leaves an Inf weight (its loss was finite)
        step(control)
        updates.append(control)
        if len(updates) == 4:
            t.model.params["h.0.mlp.c_fc.weight"][0, 0] = np.inf
    t.optim.step = overflow
    with pytest.raises(EulerError, match="h.0.mlp.c_fc.weight is not finite after step 4"
                                         r".*last good checkpoint: .*ckpt_00000002"):
        t.run()
    assert [p.name for _, p in checkpoint._checkpoints(run)] == ["ckpt_00000002"]
    assert np.isfinite(checkpoint.load(run).params["h.0.mlp.c_fc.weight"]).all()


def test_sample_refuses_weights_holding_nan(lib, shard, tmp_path):
    run = tmp_path / "run"
    trainer(lib, shard, run, total_steps=2).run()
    ck = checkpoint.load(run)
    ck.params["ln_f.weight"][:] = np.nan
    nan_run = tmp_path / "nan"
    shutil.copytree(run, nan_run)
    checkpoint.save(nan_run, 2, ck.params, ck.optim, ck.state)
    got = CliRunner().invoke(main, ["sample", str(nan_run), "--device", "numpy"])
    assert got.exit_code == 2, got.output
    assert "ln_f.weight: 32 of its 32 values are NaN or Inf" in got.output
    assert "model.safetensors" in got.output


def test_sample_says_when_the_sample_is_empty(lib, shard, tmp_path):
    run = tmp_path / "run"
    trainer(lib, shard, run, total_steps=2).run()
    ck = checkpoint.load(run)
    # every position predicts byte 0, the byte tokenizer's end of text
    ck.params["ln_f.weight"][:] = 0.0
    ck.params["ln_f.bias"][:] = 1.0
    ck.params["wte.weight"][:] = 0.0
    ck.params["wte.weight"][0] = 10.0
    checkpoint.save(run, 2, ck.params, ck.optim, ck.state)
    got = CliRunner().invoke(main, ["sample", str(run), "--device", "numpy", "--prompt", "x"])
    assert got.exit_code == 0, got.output
    assert "the sample is empty: the model drew its end of text first" in got.output


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_disk_that_fills_during_a_save_keeps_the_earlier_checkpoints(shard, tmp_path,
                                                                       monkeypatch):
    run = tmp_path / "run"
    runner = CliRunner()
    first = runner.invoke(main, ["train", "--device", "numpy",
                                 *cli_sets(tiny(shard, run, total_steps=2))])
    assert first.exit_code == 0, first.output
    before = tree_digest(run / "ckpt_00000002")
    real = safetensors.numpy.save_file

    def half_then_full(tensors, path, *args):   # a partial file, then the disk is full
        Path(path).write_bytes(b"\0" * 100)
        _no_space()
    monkeypatch.setattr(safetensors.numpy, "save_file", half_then_full)
    got = runner.invoke(main, ["train", "--resume", str(run), "--set", "training.total_steps=4"])
    monkeypatch.setattr(safetensors.numpy, "save_file", real)
    assert got.exit_code == 2, got.output
    errors = [line for line in got.output.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {run / 'ckpt_00000004'}: checkpoint of step 4 not saved: No "
                      "space left on device; the latest saved one is ckpt_00000002"], got.output
    assert "Traceback" not in got.output
    assert tree_digest(run / "ckpt_00000002") == before
    assert sorted(p.name for p in run.iterdir() if "ckpt" in p.name) == ["ckpt_00000002"]
    assert checkpoint.load(run).step == 2


def _can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                           capture_output=True)
    return probe.returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _can_mount_tmpfs(), reason="no user namespace to mount a tmpfs in")
def test_a_real_full_tmpfs_during_a_save_keeps_the_earlier_checkpoints(lib, shard, tmp_path):
    """The same on a real small file system (mounted in a private mount namespace): the
    trainer itself meets ENOSPC."""
    trainer(lib, shard, tmp_path / "measure", total_steps=2).run()
    ckpt = sum(p.stat().st_size for p in (tmp_path / "measure" / "ckpt_00000002").iterdir())
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    run = mnt / "run"
    # room for two checkpoints and a half: the third save fills the disk
    size_k = (5 * ckpt // 2) // 1024 + 16
    sets = tiny(shard, run, total_steps=8, checkpoint_every=2, keep_checkpoints=5)
    script = ("from eulergen.cli import main; main(['train', '--device', 'numpy', "
              + ", ".join(repr(a) for a in cli_sets(sets)) + "])")
    shell = (f"mount -t tmpfs -o size={size_k}k tmpfs {mnt} && {sys.executable} -c \"{script}\"; "
             f"rc=$?; ls {run}; {sys.executable} -c \"from eulergen.runtime.train import checkpoint; "
             f"print('loaded', checkpoint.load('{run}').step)\"; exit $rc")
    got = subprocess.run(["unshare", "-rm", "sh", "-c", shell], capture_output=True, text=True,
                         timeout=300)
    assert got.returncode == 2, got.stdout + got.stderr
    errors = [line for line in got.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "No space left on device" in errors[0], got.stderr
    assert "Traceback" not in got.stderr
    saved = [line for line in got.stdout.split() if line.startswith("ckpt_")]
    assert saved == ["ckpt_00000002", "ckpt_00000004"], got.stdout
    assert "loaded 4" in got.stdout, got.stdout + got.stderr
    assert "checkpoint of step 6 not saved" in errors[0], errors
    assert "the latest saved one is ckpt_00000004" in errors[0], errors


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="no user namespace to mount in")
def test_read_only_run_folder_prepare_out_and_cache_are_one_line_each(shard, tmp_path):
    """A read-only bind mount (root ignores file modes, so a mount it is): each command
    that would write there ends in one line naming the place."""
    ro = tmp_path / "ro"
    ro.mkdir()
    (tmp_path / "a.txt").write_text("hello\n")
    cli = f"{sys.executable} -c 'from eulergen.cli import main; main()'"
    quick = " ".join(cli_sets(tiny(shard, ro / "run")))
    commands = {
        "run": f"{cli} train --device numpy {quick}",
        "out": f"{cli} prepare {tmp_path / 'a.txt'} --out {ro / 'out'} --tokenizer byte --quiet",
        "cache": f"EULERGEN_CACHE={ro / 'cache'} {cli} train --device numpy "
                 f"--run-dir {tmp_path / 'rw'} --set training.total_steps=1 "
                 "--set training.warmup_steps=0 --set training.sample_tokens=0",
    }
    shell = f"mount --bind {ro} {ro} && mount -o remount,ro,bind {ro} || exit 9\n" + "".join(
        f"echo '== {name}'; {command} 2>&1; echo \"rc=$?\"\n" for name, command in commands.items())
    got = subprocess.run(["unshare", "-rm", "sh", "-c", shell], capture_output=True, text=True,
                         timeout=300)
    assert got.returncode == 0, got.stdout + got.stderr
    parts = dict(part.split("\n", 1) for part in got.stdout.split("== ")[1:])
    for name in commands:
        out = parts[name]
        errors = [line for line in out.splitlines() if line.startswith("error:")]
        assert "rc=2" in out and "Traceback" not in out, out
        assert len(errors) == 1 and str(ro / name) in errors[0], out
        assert "Read-only file system" in errors[0], out
