"""`eulergen export-c`'s CUDA build on the GPU (`pytest -m gpu tests/gpu/test_export_c_gpu.py`):
a RoPE model with grouped-query attention, RMSNorm, SwiGLU with biases and a soft-capped
score (head dim 64, a size the flash kernels take), trained a few steps on numpy, exported,
built with `make cuda` and run. Its greedy tokens equal `eulergen sample`'s on CuPy in fp32
for 200 tokens, through the cache's crops (both compute in float32, in other orders: only a
tie between the top two logits could part them), and `eulergen sample` in bf16 (bf16 weights
and activations, float32 sums) agrees with it on the first 32; a seeded sample repeats
itself."""
from __future__ import annotations

import shutil

import pytest

from eulergen.runtime.engine.backend import get_backend
from eulergen.runtime.engine.ops import OpLibrary
from eulergen.runtime.interop.c_export import export_c
from eulergen.runtime.model.arch import arch_of
from exported import TOKENS, Trained, ids, make

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")]
MODEL = ["model.preset=nanoeuler", "model.bias=true", "model.hidden_dim=128",
         "model.num_heads=2", "model.num_kv_heads=1", "model.num_layers=2",
         "model.mlp_hidden=192", "model.vocab_size=256", "model.max_seq_len=48",
         "training.seq_len=48", "model.attention=softcap_attention", "data.tokenizer=byte",
         "training.total_steps=4"]


@pytest.fixture(scope="module")
def built(cp, tmp_path_factory, shard) -> Trained:
    t = Trained(tmp_path_factory.mktemp("cuda"), shard, MODEL)
    no_cuda = export_c(arch_of(t.weights.cfg.model, t.lib), t.weights.params, t.tok, t.out,
                       context=48)
    assert not no_cuda, no_cuda
    make(t.out, "-j8", "cuda")
    return t


def test_greedy_tokens_equal_eulergen_sample_on_cupy_in_fp32(built):
    want = built.reference(OpLibrary(get_backend("cuda"), built.manifests), temperature=0)
    assert ids(built.out / "run_cuda", "--temperature", "0") == want and len(want) == TOKENS


def test_greedy_tokens_of_eulergen_sample_in_bf16_agree_on_the_first_32(built):
    want = built.reference(OpLibrary(get_backend("cuda"), built.manifests), dtype="bf16",
                           temperature=0)
    assert ids(built.out / "run_cuda", "--temperature", "0")[:32] == want[:32]


def test_a_seeded_sample_repeats_itself(built):
    args = ("--seed", "3", "--temperature", "0.9", "--top-k", "40")
    first = ids(built.out / "run_cuda", *args)
    assert first == ids(built.out / "run_cuda", *args) and len(first) == TOKENS
