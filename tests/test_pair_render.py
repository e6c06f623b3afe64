"""Pair kernels (generator/render.py `_pair`, templates/pair.cu.j2): what is computed once per
(token, k) and what per element, and the runtime's block size. Their numbers are checked by
tests/test_cuda_emulated.py (CPU) and tests/gpu/test_kernels.py."""
from __future__ import annotations

import re

import pytest

from eulergen import GENERATED_DIR
from eulergen.generator.derive import derive
from eulergen.generator.kinds.pair import kernel_values
from eulergen.generator.ops_path import find_ops
from eulergen.generator.spec import load_spec
from eulergen.launch import Pair
from eulergen.runtime.engine.manifest import load_manifest

TRANSCENDENTAL = re.compile(r"\b(powf|eg_sinf|eg_cosf|expf|logf)\(")


def _rope_kernels() -> list[dict]:
    """Each stage's template values, its loads and stores the pointer arguments of the
    kernel's signature in the manifest (const: loaded)."""
    body = derive(load_spec(find_ops()["rope"])).body
    entry = load_manifest(GENERATED_DIR / "manifest.json").ops["rope"]
    kernels = []
    for stage, code in (("forward", body.forward), ("backward", body.backward)):
        ptrs = [(n, t) for n, t in entry.kernel(stage, "f32").args if t.endswith("*")]
        loads = [n for n, t in ptrs if t.startswith("const ")]
        stores = [n for n, t in ptrs if not t.startswith("const ")]
        kernels.append(kernel_values(f"rope_{stage}", stage, loads, stores, code, body.index))
    return kernels


@pytest.mark.parametrize("k", _rope_kernels(), ids=lambda k: k["stage"])
def test_rope_angle_and_its_sine_and_cosine_are_tabled_not_computed_per_element(k):
    table = "\n".join(k["table"].lines)
    element = "\n".join(k["code"].lines)
    assert "powf(" in table and "eg_sinf(" in table and "eg_cosf(" in table, table
    assert not TRANSCENDENTAL.search(element), element
    assert len(k["cached"]) == 2, k["cached"]          # cos θ and sin θ; θ itself is not kept
    assert not k["elem_index"], k["elem_index"]        # no index symbol left per element


@pytest.mark.parametrize("H,D,dtype_vec,threads", [
    (32, 128, 4, 256),     # 512 fp32 vectors a token: the plan's 256 threads loop
    (32, 128, 8, 256),     # 256 bf16 vectors
    (12, 64, 8, 64),       # GPT-2 small in bf16: 48 vectors, two warps
    (1, 2, 4, 32),         # one pair: one warp
    (2, 528, 8, 64),       # D/2 = 264: sized by the 256-pair table chunk, 2 × 32 vectors
])
def test_pair_block_has_a_thread_per_vector_of_a_token_in_whole_warps(H, D, dtype_vec, threads):
    geometry = Pair(threads=256, vec=dtype_vec, table_pairs=256, min_blocks=6, grid_max=792)
    assert geometry.launch(1, H, D).block == (threads,)


@pytest.mark.parametrize("tokens,H,D,grid", [
    (8192, 32, 128, 792),  # B=8 T=1024, blocks of 256: grid_max full blocks loop over the tokens
    (8192, 12, 64, 3168),  # quarter-size blocks (64 threads): four times as many
    (16, 32, 128, 16),     # a decode step of 16 sequences: a block each
    (0, 32, 128, 1),
])
def test_pair_grid_is_grid_max_scaled_to_the_launched_block_size(tokens, H, D, grid):
    geometry = Pair(threads=256, vec=8, table_pairs=256, min_blocks=6, grid_max=792)
    assert geometry.launch(tokens, H, D).grid == (grid,)   # grid_max counts blocks of 256
