"""`eulergen export-c` on the CPU: the CPU default model (trained by Muon) and a model of a
user's own ops (an activation and a norm from YAML, RoPE, grouped-query attention, a
soft-capped score), each trained a few steps on numpy, exported, built with `make cpu` and
run. Greedy tokens and a seeded sample equal `eulergen sample`'s on numpy for 200 tokens,
through the cache's crops; the program refuses bad weights and a long prompt in one line;
export-c refuses what it cannot write, before writing anything. `make cuda` (slow: nvcc
compiles the ops' kernels) where nvcc is on PATH."""
from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
from click.testing import CliRunner

from eulergen import GENERATED_DIR
from eulergen.cli import main
from eulergen.errors import EulerError
from eulergen.runtime.engine.backend import NUMPY
from eulergen.runtime.engine.ops import OpLibrary
from eulergen.runtime.interop.c_export import export_c
from eulergen.runtime.model.arch import arch_of
from exported import PROMPT, TOKENS, USER_OPS, Trained, cache, ids, make, program  # noqa: F401 (cache: a fixture)

pytestmark = pytest.mark.skipif(shutil.which("cc") is None or shutil.which("make") is None,
                                reason="no C compiler or make")
USER_MODEL = ["model.preset=nanoeuler", "model.hidden_dim=64", "model.num_layers=2",
              "model.num_heads=4", "model.num_kv_heads=2", "model.mlp_hidden=96",
              "model.vocab_size=256", "model.max_seq_len=32", "training.seq_len=32",
              "model.norm=rmsnorm_plus", "model.activation=bswiglu",
              "model.attention=softcap_attention", "data.tokenizer=byte"]


def _export(run, out):
    return CliRunner().invoke(main, ["export-c", str(run), "--out", str(out)])


@pytest.fixture(scope="module")
def default(tmp_path_factory, shard, cache) -> Trained:
    """The CPU default model, trained 4 steps by Muon (its optimizer state, Muon's and its
    rest op AdamW's, is not exported), exported through the command."""
    m = Trained(tmp_path_factory.mktemp("default"), shard,
                ["training.total_steps=4", "training.optimizer=muon"])
    assert m.weights.cfg.training.optimizer == "muon"
    result = _export(m.run, m.out)
    assert result.exit_code == 0, result.output
    make(m.out, "cpu")
    return m


@pytest.fixture(scope="module")
def user(tmp_path_factory, shard, cache) -> Trained:
    """A model of the user's own ops, trained 4 steps, exported by export_c."""
    root = tmp_path_factory.mktemp("user")
    ops = root / "ops"
    ops.mkdir()
    for name, text in USER_OPS.items():
        (ops / name).write_text(text)
    m = Trained(root, shard, ["training.total_steps=4", *USER_MODEL], [ops])
    export_c(arch_of(m.weights.cfg.model, m.lib), m.weights.params, m.tok, m.out,
             context=m.weights.cfg.training.seq_len)
    make(m.out, "cpu")
    return m


@pytest.mark.parametrize("model", ["default", "user"])
def test_greedy_tokens_equal_eulergen_sample_on_numpy(model, request):
    m = request.getfixturevalue(model)
    want = m.reference(m.lib, temperature=0)
    assert ids(m.out / "run_cpu", "--temperature", "0") == want and len(want) == TOKENS


@pytest.mark.parametrize("model", ["default", "user"])
def test_a_seeded_sample_repeats_itself_and_is_eulergen_samples(model, request):
    m = request.getfixturevalue(model)
    binary = m.out / "run_cpu"
    args = ("--seed", "7", "--temperature", "0.9", "--top-k", "40", "--top-p", "0.95")
    first = ids(binary, *args)
    assert first == ids(binary, *args), "a seed draws the same tokens again"
    assert first != ids(binary, "--seed", "8", *args[2:]), "another seed draws others"
    assert first == m.reference(m.lib, temperature=0.9, top_k=40, top_p=0.95, seed=7), \
        "the draw is eulergen's: the same tokens from (nearly) the same logits"


def test_the_text_is_the_prompt_and_its_continuation(default):
    done = program(default.out / "run_cpu", "--prompt", PROMPT, "--max-new-tokens", "20")
    assert done.returncode == 0 and done.stdout.startswith(PROMPT), done.stderr
    assert "tokens/s" in done.stderr


def test_the_block_in_model_c_is_the_graphs(user):
    """model.c is written from graph.py: its block's calls, in order, are the graph's nodes."""
    graph = arch_of(user.weights.cfg.model, user.lib).graph
    text = (user.out / "model.c").read_text()
    block = text[text.index("static void block("):text.index("static void head(")]
    comments = re.findall(r"/\* ([\w, ]+) -> (\w+) ([\w.]+)", block)
    assert comments == [(", ".join(n.inputs), n.kind, n.op.name if n.op else ", ".join(n.weights))
                        for n in graph.block]
    assert "bswiglu_forward(" in block and "rmsnorm_plus_forward_add(" in block
    assert "softcap_attention_decode(" in block and "rope_forward(" in block


def _fails(out, *args) -> str:
    done = program(out / "run_cpu", *args)
    assert done.returncode != 0 and not done.stdout.strip()
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]


def test_missing_truncated_and_foreign_weights_are_one_line(default, user, tmp_path):
    out = default.out
    assert "cannot open it" in _fails(out, "--weights", str(tmp_path / "none.bin"))
    data = (out / "weights.bin").read_bytes()
    (tmp_path / "short.bin").write_bytes(data[:len(data) // 2])
    assert "truncated" in _fails(out, "--weights", str(tmp_path / "short.bin"))
    (tmp_path / "header.bin").write_bytes(data[:100])
    assert "truncated" in _fails(out, "--weights", str(tmp_path / "header.bin"))
    assert "not an eulergen weights file" in _fails(out, "--weights", str(out / "tokenizer.bin"))
    other = _fails(out, "--weights", str(user.out / "weights.bin"))
    assert "this program was exported for" in other, other


def test_a_prompt_longer_than_the_context_is_refused(default):
    line = _fails(default.out, "--prompt", "x" * 65)
    assert "65 tokens, more than the model's context of 64" in line


def test_bad_options_are_one_line(default):
    out = default.out
    assert "--top-p" in _fails(out, "--top-p", "0")
    assert "--temperature" in _fails(out, "--temperature", "warm")
    assert "unknown option" in _fails(out, "--beam", "4")
    assert "not UTF-8" in _fails(out, "--prompt", "caf\udce9")


def test_an_out_with_foreign_files_is_refused_untouched(default, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    result = _export(default.run, tmp_path)
    assert result.exit_code == 2 and "notes.txt" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_an_earlier_export_is_replaced_once_its_build_is_cleaned(default, tmp_path):
    again = tmp_path / "again"
    shutil.copytree(default.out, again)
    built = _export(default.run, again)
    assert built.exit_code == 2 and "run_cpu" in built.output, "make's files are not export-c's"
    make(again, "clean")
    result = _export(default.run, again)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in again.iterdir()) == sorted(p.name for p in default.out.iterdir()
                                                             if p.name != "run_cpu")


def test_an_op_without_a_c_printer_is_refused_before_anything_is_written(default, tmp_path):
    """A manifest whose layernorm has no C (a kind the C printer does not cover)."""
    manifest = json.loads((GENERATED_DIR / "manifest.json").read_text())
    entry = {k: v for k, v in manifest["ops"]["layernorm"].items()
             if k not in ("c", "c_sha256", "c_functions")}
    (tmp_path / "manifest.json").write_text(json.dumps({"format": 3, "ops": {"layernorm": entry}}))
    lib = OpLibrary(NUMPY, [tmp_path / "manifest.json"])
    with pytest.raises(EulerError, match="op 'layernorm' .* has no C printer") as err:
        export_c(arch_of(default.weights.cfg.model, lib), default.weights.params, default.tok,
                 tmp_path / "out", context=64)
    assert err.value.key == "model.norm" and not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
def test_make_cuda_compiles(default, tmp_path):
    shutil.copytree(default.out, tmp_path / "c")
    done = subprocess.run(["make", "-j2", "cuda"], cwd=tmp_path / "c", capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "c" / "run_cuda").is_file()
