"""What the tests of `eulergen export-c` share (tests/test_export_c.py and
test_export_c_train.py on the CPU, tests/gpu/test_export_c_gpu.py on a GPU): a user's own
ops, a run trained a few steps on numpy, `make` in an exported folder, the program's runs,
`eulergen sample`'s tokens to hold them against, and a module's cache of its own."""
from __future__ import annotations

import subprocess

import pytest

from eulergen.generator.build import ensure_built
from eulergen.runtime.data.tokenizer import load_tokenizer
from eulergen.runtime.engine.backend import NUMPY
from eulergen.runtime.engine.ops import OpLibrary
from eulergen.runtime.model.arch import ops_used
from eulergen.runtime.train.config import load_config
from eulergen.runtime.train.evaluate import open_model, open_sampler
from eulergen.runtime.train.trainer import Trainer

PROMPT = "def "
TOKENS = 200          # past the context: the cache crops, in C as in the sampler

# a user's own: a gated activation with a param, a norm, over RoPE, GQA and a soft cap
USER_OPS = {
    "bswiglu.yaml": """\
name: bswiglu
kind: pointwise
doc: a gated SiLU whose gate has a slope, a·sigmoid(beta·a)·b
inputs: [a, b]
params: {beta: 1.5}
outputs:
  y: a*sigmoid(beta*a)*b
""",
    "rmsnorm_plus.yaml": """\
name: rmsnorm_plus
kind: row
doc: RMSNorm with eps outside the root
inputs: {x: row, w: weight}
params: {eps: 1.0e-5}
reduce:
  ms: mean(x**2)
outputs:
  y: w*x/(sqrt(ms) + eps)
"""}
SHORT = ["training.batch_size=4", "training.warmup_steps=1", "training.eval_every=0",
         "training.sample_tokens=0"]


class Trained:
    """A run trained on numpy in root/run (its ops built from `ops_dirs` too), its
    weights and tokenizer; its export goes to root/c."""

    def __init__(self, root, shard, sets, ops_dirs=()):
        cfg = load_config(None, [f"run_dir={root / 'run'}", f"data.dataset={shard}",
                                 f"data.val_dataset={shard}", *SHORT, *sets])
        self.manifests = ensure_built(ops_used(cfg.model, cfg.training.optimizer), ops_dirs)
        self.lib = OpLibrary(NUMPY, self.manifests)
        Trainer(cfg, self.lib, progress=False, tensorboard=False).run()
        self.run, self.out = root / "run", root / "c"
        self.weights = open_model(self.run)
        self.tok = load_tokenizer(self.weights.cfg.data)

    def reference(self, lib, dtype="float32", **settings) -> list[int]:
        """`eulergen sample`'s tokens for PROMPT (cli/sample.py's sampler, in `dtype` on
        lib's backend)."""
        sampler = open_sampler(self.weights, lib, batch=1, dtype=dtype, notify=lambda m: None)
        (row,) = sampler.samples(self.tok.encode(PROMPT), TOKENS, stop=self.tok.eot, **settings)
        return row


def make(out, *targets) -> None:
    done = subprocess.run(["make", *targets], cwd=out, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def program(binary, *args) -> subprocess.CompletedProcess:
    """A run of the program; its text as UTF-8 (a byte-level model may draw any byte)."""
    return subprocess.run([str(binary), *args], capture_output=True, encoding="utf-8",
                          errors="replace", timeout=300)


def ids(binary, *args) -> list[int]:
    """The new ids the program draws after PROMPT."""
    done = program(binary, "--prompt", PROMPT, "--max-new-tokens", str(TOKENS), "--ids", *args)
    assert done.returncode == 0, done.stderr
    return [int(t) for t in done.stdout.split()]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache of the module's own (user ops build into it), and no EULERGEN_OPS_PATH."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EULERGEN_CACHE", str(tmp_path_factory.mktemp("cache")))
        mp.delenv("EULERGEN_OPS_PATH", raising=False)
        yield
