"""`eulergen export-c --train` on the CPU: a run of the CPU default's ops (smaller) and one of
a user's own ops (a gated activation and a norm from YAML, RoPE in place, grouped-query
attention, a soft-capped score, a padded vocabulary, gradient accumulation, a linear
schedule, Lion, a spike guard that skips updates: its closest call is 2% off), each trained 24
steps on numpy over two small token files (so that the batches cross files and epochs),
exported from its step-4 checkpoint with --train, built with `make cpu` and continued 20
steps by train_cpu. Its losses are the numpy run's within 1e-5 (float32 in other orders:
they differ by a few 1e-7); its checkpoint is the run's (the same step, data position and
update count) and samples in `eulergen sample`; `eulergen train --resume` continues it.
What it does not cover, and bad files, are refused in one line."""
from __future__ import annotations

import ctypes
import json
import re
import shutil
import subprocess

import numpy as np
import pytest
from click.testing import CliRunner

from eulergen import GENERATED_DIR, PACKAGE_DIR, TEMPLATES_DIR
from eulergen.cli import main
from eulergen.errors import EulerError
from eulergen.generator.build import ensure_built
from eulergen.runtime.data.loader import write_shard
from eulergen.runtime.engine.backend import NUMPY
from eulergen.runtime.engine.ops import OpLibrary
from eulergen.runtime.model.arch import ops_used
from eulergen.runtime.train import checkpoint
from eulergen.runtime.train.config import load_config
from eulergen.runtime.train.continued import checkpoint_of, continued
from eulergen.runtime.train.trainer import Trainer
from c_calls import shared_library
from exported import SHORT, USER_OPS, cache, program  # noqa: F401 (cache: a fixture)

pytestmark = pytest.mark.skipif(shutil.which("cc") is None or shutil.which("make") is None,
                                reason="no C compiler or make")
TOL = 1e-5
RUN = [*SHORT, "training.total_steps=24", "training.checkpoint_every=4",
       "training.keep_checkpoints=10", "model.max_seq_len=32", "training.seq_len=32",
       "model.hidden_dim=64", "model.num_heads=2", "model.vocab_size=256"]
DEFAULT_LIKE = ["model.num_layers=2", "model.mlp_hidden=256"]   # the CPU default's ops
USER_MODEL = ["model.preset=nanoeuler", "model.num_layers=1", "model.num_heads=4",
              "model.num_kv_heads=2", "model.mlp_hidden=96", "model.norm=rmsnorm_plus",
              "model.activation=bswiglu", "model.attention=softcap_attention",
              "model.vocab_size=257", "data.tokenizer=byte", "training.gradient_accumulation=2",
              "training.schedule=linear", "training.spike_factor=1.1", "training.optimizer=lion"]


class Continued:
    """A run trained 24 steps on numpy in root/run, exported from its step-4 checkpoint with
    --train into root/c, `make cpu`, and train_cpu's 20 steps into root/crun."""

    def __init__(self, root, files, sets, ops_dirs=()):
        self.root, self.files = root, files
        self.ops = [arg for d in ops_dirs for arg in ("--ops", str(d))]
        cfg = load_config(None, [f"run_dir={root / 'run'}", f"data.dataset={root}/*_train.bin",
                                 f"data.val_dataset={files[0]}", *RUN, *sets])
        self.lib = OpLibrary(NUMPY, ensure_built(ops_used(cfg.model), ops_dirs))
        self.losses = Trainer(cfg, self.lib, progress=False, tensorboard=False).run().losses
        self.ckpt, self.out, self.crun = root / "run" / "ckpt_00000004", root / "c", root / "crun"
        result = export(self.ckpt, self.out, *self.ops)
        assert result.exit_code == 0, result.output
        done = subprocess.run(["make", "-j2", "cpu"], cwd=self.out, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
        self.done = program(self.out / "train_cpu", "--steps", "20", "--run-dir", str(self.crun))
        assert self.done.returncode == 0, self.done.stderr
        self.c_losses = {int(s): float(v)
                         for s, v in re.findall(r"step (\d+): loss (\S+),", self.done.stdout)}


def export(run, out, *args):
    return CliRunner().invoke(main, ["export-c", str(run), "--out", str(out), "--train", *args])


def _files(root):
    """Two token files of the package's source text, of 15 and 7 batches of 4 x 32."""
    text = np.frombuffer(b"".join(p.read_bytes() for p in sorted((PACKAGE_DIR / "runtime")
                                                                 .rglob("*.py"))), np.uint8)
    files = [root / "a_train.bin", root / "b_train.bin"]
    write_shard(files[0], text[:2000])
    write_shard(files[1], text[2000:3000])
    return files


@pytest.fixture(scope="module")
def default(tmp_path_factory, cache) -> Continued:
    root = tmp_path_factory.mktemp("default")
    return Continued(root, _files(root), DEFAULT_LIKE)


@pytest.fixture(scope="module")
def user(tmp_path_factory, cache) -> Continued:
    root = tmp_path_factory.mktemp("user")
    ops = root / "ops"
    ops.mkdir()
    for name, text in USER_OPS.items():
        (ops / name).write_text(text)
    return Continued(root, _files(root), USER_MODEL, [ops])


@pytest.mark.parametrize("model", ["default", "user"])
def test_20_steps_of_train_cpu_have_the_numpy_runs_losses(model, request):
    m = request.getfixturevalue(model)
    assert sorted(m.c_losses) == list(range(5, 25)), m.done.stdout
    worst = max(abs(m.c_losses[s] - m.losses[s]) for s in m.c_losses)
    assert worst < TOL, f"{model}: losses differ by up to {worst:.1e}"


def test_the_spike_guard_skips_the_updates_the_numpy_run_skipped(user):
    skipped = [int(s) for s in re.findall(r"step (\d+): [^\n]*update skipped", user.done.stdout)]
    records = [json.loads(line) for line in (user.root / "run" / "metrics.jsonl").open()]
    assert skipped and skipped == [r["step"] for r in records if r.get("skipped") and r["step"] > 4]


@pytest.mark.parametrize("model", ["default", "user"])
def test_its_checkpoint_is_the_runs_and_samples_in_eulergen_sample(model, request):
    m = request.getfixturevalue(model)
    c, py = checkpoint.load(m.crun), checkpoint.load(m.root / "run")
    assert c.step == py.step == 24
    for key in ("data", "adam_updates", "config", "tokenizer_digest"):
        assert c.state[key] == py.state[key], key
    assert sorted(c.params) == sorted(py.params) and sorted(c.optim) == sorted(py.optim)
    result = CliRunner().invoke(main, ["sample", str(m.crun), "--max-new-tokens", "8",
                                       "--temperature", "0", *m.ops])
    assert result.exit_code == 0, result.output


def test_eulergen_train_resume_continues_its_run(default, tmp_path):
    """Two more steps from the C run's checkpoint, and from the numpy run's own."""
    losses = {}
    for name in ("crun", "run"):
        shutil.copytree(default.root / name, tmp_path / name)
        result = CliRunner().invoke(main, ["train", "--resume", str(tmp_path / name), "--device",
                                           "numpy", "--set", "training.total_steps=26"])
        assert result.exit_code == 0, result.output
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").open()]
        losses[name] = {r["step"]: r["train_loss"] for r in records if "train_loss" in r}
    assert abs(losses["crun"][26] - losses["run"][26]) < TOL


def test_the_inference_files_are_those_of_an_export_without_train(default, tmp_path):
    result = CliRunner().invoke(main, ["export-c", str(default.ckpt), "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    for path in tmp_path.iterdir():
        if path.name not in ("Makefile", "README.md", ".eulergen-export-c"):
            assert path.read_bytes() == (default.out / path.name).read_bytes(), path.name


def test_the_checkpoint_is_read_once(default, tmp_path, monkeypatch):
    """Its weights and optimizer state from one read of each tensor file (the inference
    files' weights, the trainer's arenas), the same folder as the fixture's export."""
    reads, read = [], checkpoint.read_safetensors
    monkeypatch.setattr(checkpoint, "read_safetensors",
                        lambda path, what: reads.append(path.name) or read(path, what))
    result = export(default.ckpt, tmp_path / "c")
    assert result.exit_code == 0, result.output
    assert sorted(reads) == [checkpoint.MODEL_FILE, checkpoint.OPTIM_FILE]
    for path in (tmp_path / "c").iterdir():
        assert path.read_bytes() == (default.out / path.name).read_bytes(), path.name


def test_forward_and_backward_are_the_tapes_calls(user):
    """The generated ops' C, not a hand-written derivative: each op's backward is called."""
    forward, backward = ((user.out / f).read_text() for f in ("forward.c", "backward.c"))
    for name in ("rmsnorm_plus_forward_add(", "bswiglu_forward(", "rope_forward(",
                 "softcap_attention_forward(", "cross_entropy_forward("):
        assert name in forward, name
    for name in ("rmsnorm_plus_backward_add(", "bswiglu_backward(", "rope_backward(",
                 "softcap_attention_backward(", "cross_entropy_backward(", "embedding_backward("):
        assert name in backward, name
    training = (user.out / "training.c").read_text()
    assert "lion_step(" in training, "the run's optimizer's C"
    assert "adamw_step(" in training, "lion's rest op's C (the embeddings, the 1-D parameters)"


def test_the_batch_order_is_numpys_permutation(tmp_path):
    """data.c's default_rng(words).permutation(n): seeds of one word, of several, past 2^32,
    and lengths past 2^16 (its draws of 32 bits)."""
    c = TEMPLATES_DIR / "c"
    so = shared_library([c / "data.c", c / "files.c", c / "error.c"], tmp_path / "data.so",
                        std="c11")
    for words in ([1337, 0], [1337, 2, 1], [0], [2**40 + 5, 7]):
        for n in (1, 2, 31, 70000):
            got = np.empty(n, np.int64)
            so.data_permutation((ctypes.c_uint64 * len(words))(*words), len(words),
                                ctypes.c_longlong(n), got.ctypes.data_as(ctypes.c_void_p))
            assert np.array_equal(got, np.random.default_rng(words).permutation(n)), (words, n)


def _fails(binary, *args, started: bool = False) -> str:
    """The one line of a run that fails (`started`: after its first line on stdout)."""
    done = program(binary, *args)
    assert done.returncode != 0 and len(done.stdout.splitlines()) == started, done.stdout
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]


def test_bad_token_files_and_state_are_one_line(default, user, tmp_path):
    binary, data = default.out / "train_cpu", default.files[0].read_bytes()
    run = ["--run-dir", str(tmp_path / "run")]
    (tmp_path / "short.bin").write_bytes(data[:len(data) - 10])
    assert "truncated: header says" in _fails(binary, *run, str(tmp_path / "short.bin"))
    write_shard(tmp_path / "wide_train.bin", np.full(300, 300, np.uint16))
    assert "outside the model's vocabulary" in _fails(binary, *run,
                                                      str(tmp_path / "wide_train.bin"))
    (tmp_path / "tokenizer.bin").write_bytes(np.array([20240328, 2, 0], "<i4").tobytes())
    assert "is a tokenizer file, not a token shard" in _fails(binary, *run,
                                                            str(tmp_path / "tokenizer.bin"))
    assert "cannot open it" in _fails(binary, *run, str(tmp_path / "none.bin"))
    state = (default.out / "train_state.bin").read_bytes()
    (tmp_path / "state.bin").write_bytes(state[:-4])
    assert "truncated" in _fails(binary, *run, "--state", str(tmp_path / "state.bin"))
    assert "this program was exported for" in _fails(
        binary, *run, "--state", str(user.out / "train_state.bin"))
    assert "this program was exported for" in _fails(
        binary, *run, "--weights", str(user.out / "weights.bin"))
    assert "--steps" in _fails(binary, *run, "--steps", "0")
    weights = bytearray((default.out / "weights.bin").read_bytes())
    weights[-4:] = np.float32(np.nan).tobytes()   # ln_f's last bias
    (tmp_path / "nan.bin").write_bytes(weights)
    line = _fails(binary, *run, "--weights", str(tmp_path / "nan.bin"), started=True)
    assert re.search(r"loss is -?nan at step 5; stopped", line), line
    assert not list((tmp_path / "run").glob("ckpt_*")), "no checkpoint of a step not done"


def test_a_cuda_training_build_is_refused_in_one_line(default):
    done = subprocess.run(["make", "train_cuda"], cwd=default.out, capture_output=True,
                          text=True)
    assert done.returncode != 0 and "no CUDA training build" in done.stderr


def test_an_op_without_c_of_training_is_refused_before_anything_is_written(default, tmp_path):
    """A manifest whose layernorm has no .train.c (a kind that prints no C of training)."""
    manifest = json.loads((GENERATED_DIR / "manifest.json").read_text())
    entry = {k: v for k, v in manifest["ops"]["layernorm"].items()
             if k not in ("c_train", "c_train_sha256")}
    (tmp_path / "manifest.json").write_text(json.dumps({"format": 3, "ops": {"layernorm": entry}}))
    lib = OpLibrary(NUMPY, [tmp_path / "manifest.json"])
    with pytest.raises(EulerError, match="op 'layernorm' .* no C printer of its training") as err:
        continued(checkpoint_of(default.ckpt), lib)
    assert err.value.key == "model.norm"


def test_what_it_does_not_cover_is_refused_in_one_line(default, tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    result = export(tmp_path / "hf", tmp_path / "out")
    assert result.exit_code == 2 and "has no optimizer state" in result.output
    for key, value, says in (("dtype", "bf16", "bf16 run is not covered"),
                             ("recompute", "blocks", "'blocks' is not covered"),
                             ("optimizer", "muon", "op 'muon' (update kind) has no C printer")):
        ck = shutil.copytree(default.ckpt, tmp_path / key / "ckpt_00000004")
        state = json.loads((ck / "state.json").read_text())
        state["config"]["training"][key] = value
        (ck / "state.json").write_text(json.dumps(state))
        result = export(ck, tmp_path / "out")
        assert result.exit_code == 2 and says in result.output, result.output
    assert not (tmp_path / "out").exists()
