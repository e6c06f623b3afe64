"""benchmarks/step_profile.py on the numpy backend: its stand-ins time every node of the
step without changing what the step computes."""
from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest

from eulergen import PACKAGE_DIR
from eulergen.runtime.engine.backend import NUMPY
from eulergen.runtime.model.gpt import build
from eulergen.runtime.engine.ops import OpLibrary
from eulergen.runtime.model.optimizer_plan import update_ops
from eulergen.runtime.train.optimizer import Optimizer


def _step_profile():
    spec = importlib.util.spec_from_file_location(
        "step_profile", PACKAGE_DIR / "benchmarks" / "step_profile.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


sp = _step_profile()
spans = sys.modules["step_spans"]   # imported by step_profile from benchmarks/
B, T = 2, 16


@pytest.fixture(scope="module")
def lib():
    return OpLibrary(NUMPY)


def _cfg(preset: str):
    return sp.config(preset, B, T, "fp32", "training.device=numpy", "model.num_layers=2",
                     "model.hidden_dim=32", "model.num_heads=2", "model.num_kv_heads=2",
                     "model.vocab_size=100", "model.max_seq_len=16")


def _model(lib, cfg):
    """A model and its one-step call (the trainer's Stepper, uncaptured: numpy)."""
    ops = update_ops(lib, cfg.training.optimizer)
    model = build(cfg.model, lib, B, T, dtype="float32", optimizer=ops)
    model.init_weights(0)
    return model, sp.eulergen_stepper(model, Optimizer(model, ops, cfg.training),
                                      cfg.training)[1]


@pytest.mark.parametrize("preset", ["gpt2", "nanoeuler"])
def test_a_timed_step_computes_what_the_plain_step_does_and_times_every_node(lib, preset):
    cfg = _cfg(preset)
    plain, timed = _model(lib, cfg), _model(lib, cfg)
    nodes = list(timed[0].tape.nodes)
    spans = sp.Spans(NUMPY)
    shadows = {id(o): set(vars(o)) for o in (timed[0], timed[0].tape, timed[0].lib)}
    undo = sp.instrument(timed[0], spans)
    rng = np.random.default_rng(1)
    x, y = (rng.integers(0, 100, (B, T)) for _ in "xy")
    for _ in range(2):
        losses = [step(x, y) for _, step in (plain, timed)]
        assert losses[0] == losses[1]
        lines = spans.collect()
    for arena in ("params", "grads", "optimizer"):
        np.testing.assert_array_equal(plain[0].mem.arenas[arena], timed[0].mem.arenas[arena])
    undo()   # the plain step again: its own nodes and methods, nothing timed
    assert timed[0].tape.nodes == nodes
    assert {id(o): set(vars(o)) for o in (timed[0], timed[0].tape, timed[0].lib)} == shadows
    assert timed[1](x, y) == plain[1](x, y)
    assert spans.collect() == {}

    names = {name for name, _ in lines}
    kinds = {kind for _, kind in lines}
    assert kinds <= set(sp.KINDS)
    # no "add": the residual adds are the norms' (one micro-step: no gradient added via scratch)
    assert {"gemm", "attention fwd", "attention bwd", "norm", "activation", "embedding",
            "loss", "optimizer"} <= kinds
    assert {"grad norm", "adamw"} <= names
    # each node has its forward line (a Linear's: its GEMM's), calls summed over the layers
    calls = sum(n for (name, _), (_, n, _, _) in lines.items()
                if name.endswith(" fwd") or name.endswith(" fwd gemm"))
    assert calls == len(nodes)
    assert not any("h.0." in name or "h.1." in name for name in names), "layers not folded"


def test_the_gemm_lines_count_six_flops_per_weight_and_token(lib):
    """Forward, input gradient and weight gradient of every Linear (the LM head's too): 2
    FLOPs a multiply-add each, over B·T tokens; the biases' GEMMs are counted apart."""
    cfg = _cfg("gpt2")
    model, step = _model(lib, cfg)
    spans = sp.Spans(NUMPY)
    sp.instrument(model, spans)
    step(np.zeros((B, T)), np.ones((B, T)))
    lines = spans.collect()
    weights = sum(v.size for name, v in model.params.items()
                  if name == "wte.weight" or (name.endswith(".weight") and ".c_" in name))
    main = sum(f for (name, kind), (_, _, f, _) in lines.items()
               if kind == "gemm" and name.split()[-1] in ("gemm", "dgrad", "wgrad"))
    assert main == 6 * B * T * weights
    # c_fc's bias is the activation's (its `bias` fusion): no GEMM of its own
    bias = sum(v.size for name, v in model.params.items()
               if name.endswith(".bias") and ".c_" in name and ".c_fc." not in name)
    grads = sum(f for (name, kind), (_, _, f, _) in lines.items() if name.endswith("bias grad"))
    assert grads == 2 * B * T * bias


def test_muon_s_line_counts_its_newton_schulz_flops_and_adamw_steps_the_rest(lib):
    """With training.optimizer=muon: a muon line a Linear weight (its three phases and
    GEMMs; ‖X‖² and 5 steps of A = XXᵀ, A·A, BX), an adamw line a range of the rest."""
    cfg = sp.config("gpt2", B, T, "fp32", "training.device=numpy", "model.num_layers=2",
                    "model.hidden_dim=32", "model.num_heads=2", "model.num_kv_heads=2",
                    "model.vocab_size=100", "model.max_seq_len=16", "training.optimizer=muon")
    model, step = _model(lib, cfg)
    spans = sp.Spans(NUMPY)
    sp.instrument(model, spans)
    step(np.zeros((B, T)), np.ones((B, T)))
    lines = spans.collect()
    matrices = [v.shape for name, v in model.params.items()
                if name.endswith(".weight") and ".c_" in name]
    flops = sum(2 * min(s) * max(s) + 5 * 2 * (2 * min(s) ** 2 * max(s) + min(s) ** 3)
                for s in matrices)
    assert lines[("muon", "optimizer")][1:3] == [len(matrices), flops]
    assert lines[("adamw", "optimizer")][1] == 2   # the embeddings, then the 1-D parameters


def test_the_embedding_backward_bytes_follow_its_kernels(lib):
    cfg = _cfg("gpt2")
    model, _ = _model(lib, cfg)
    from eulergen.runtime.model.tape import Embedding
    (emb,) = [n for n in model.tape.nodes if isinstance(n, Embedding)]
    ids = np.arange(B * T) % 5
    model.load_tokens(ids.reshape(B, T))
    n, (V, C) = B * T, emb.table.shape
    # sort 4n + 8n + 4V, merge 16n, table 8n + 4V + n·C·4 + the 5 ids' rows of dtable read
    # and written (the tied head wrote it first), positions n·C·4 + T·C·4 (wpe's rows)
    want = 36 * n + 8 * V + 4 * n * C + 2 * 5 * C * 4 + 4 * n * C + emb.positions.nbytes
    assert emb.dtable.add
    assert spans._embedding_bytes(emb, backward=True) == want


def test_with_bias_epilogues_each_linear_is_its_gemms_alone(lib):
    """A GEMM that takes the bias epilogues (cuBLASLt's; numpy_gemm is their reference):
    the bias is in the forward GEMM's line and its gradient in the wgrad's, no separate
    bias or 1ᵀ·dy GEMM is timed, and the FLOPs are still 6 per weight and token."""
    cfg = _cfg("gpt2")
    model, step = _model(lib, cfg)
    model.tape.epilogues = True
    spans = sp.Spans(NUMPY)
    sp.instrument(model, spans)
    step(np.zeros((B, T)), np.ones((B, T)))
    lines = spans.collect()
    roles = {name.split(" fwd ")[-1].split(" bwd ")[-1] for name, kind in lines
             if kind == "gemm"}
    assert roles == {"gemm", "gemm+bias", "dgrad", "wgrad", "wgrad+bias grad"}
    weights = sum(v.size for name, v in model.params.items()
                  if name == "wte.weight" or (name.endswith(".weight") and ".c_" in name))
    assert sum(f for (_, kind), (_, _, f, _) in lines.items() if kind == "gemm") == \
        6 * B * T * weights
