"""training.recompute on the CPU (runtime/model/recompute.py): the blocks plan keeps a
layer's x and ln_1 and one block's other values; the tape runs each block's forward again
before its backward (but the last block's) without adding a node; the loss and every
gradient are the bits of recompute none, in fp32 and, through tests/test_bf16_model.py's
rounding library, in bf16 and autocast; a run, its checkpoints, a resume in the other mode
and ZeRO's ranks repeat none's bits; `eulergen plan` shows the saving and the cost. (On the
GPU: tests/gpu/test_recompute_gpu.py.)"""
from __future__ import annotations

import numpy as np
import pytest

from eulergen.errors import EulerError
from eulergen.runtime.engine.backend import NUMPY
from eulergen.runtime.engine.ops import OpLibrary
from eulergen.runtime.model.arch import arch_of
from eulergen.runtime.model.gpt import GPT, build
from eulergen.runtime.model.memory import Memory
from eulergen.runtime.model.plan import plan_model
from eulergen.runtime.model.recompute import Replay, rerun
from eulergen.runtime.model.tape import Norm
from eulergen.runtime.train import budget
from eulergen.runtime.train.config import load_config
from test_bf16_model import COMMON, STRUCTURES, RoundingLibrary, rounding_gemm
from runs import losses
from test_ddp import _train
from test_zero import _stop_at_3

LIB = OpLibrary(NUMPY)
# three layers: a first block, a middle one and the last, whose forward is not run again
THREE = [*COMMON, "model.num_layers=3"]
CONFIGS = {**{s: [*sets, *THREE] for s, sets in STRUCTURES.items()},
           "cpu-default": ["training.batch_size=2"]}   # its model, an eighth of its batch


def _cfg(name):
    return load_config(None, CONFIGS[name])


def _batch(cfg, seed=0):
    rng = np.random.default_rng(seed)
    t, vocab = cfg.training, cfg.model.vocab_size
    return (rng.integers(0, vocab, (t.batch_size, t.seq_len)),
            rng.integers(0, vocab, (t.batch_size, t.seq_len)))


def _bits(model, cfg):
    """The losses and gradients of two micro-steps (the second adds to the first's), from
    seeded weights."""
    model.init_weights(3)
    losses = []
    for seed in (0, 1):
        model.load_tokens(*_batch(cfg, seed))
        losses.append(model.loss_and_grad(accumulate=seed == 1)[0].copy())
    return np.array(losses), model.mem.arenas["grads"].copy()


def test_blocks_keeps_a_layer_s_x_and_ln_1_and_one_block_s_other_values():
    a = arch_of(_cfg("nanoeuler").model, LIB)
    g, kept = a.graph, a.graph.kept()
    none, blocks = (plan_model(a, 2, 32, recompute=m) for m in ("none", "blocks"))
    layers = {b.name for b in blocks.buffers if b.name.startswith("h.") and
              b.arena == "activations"}
    assert layers == {f"h.{i}.{n}" for i in range(3) for n in ("x", "ln_1")}
    again = {b.name.removeprefix("block.") for b in blocks.buffers if b.name.startswith("block.")}
    assert again == {v for v in kept if f"h.0.{v}" in none.index} - {"x", "ln_1"}
    assert "qkv" in again and "lse" in again and "act" in again
    # what a layer no longer keeps, for all but one of them
    per_layer = sum(none.buffer(f"h.0.{v}").nbytes for v in again)
    assert none.total_bytes - blocks.total_bytes == 2 * per_layer
    assert plan_model(a, 2, 32, recompute="none") == plan_model(a, 2, 32)
    assert [n.outputs for n in g.block if n not in rerun(g)] == [("next", "next_ln")]


def test_a_deep_recomputing_plan_is_priced_from_two_small_plans():
    """The one block's values are in the one- and the two-layer plan alike, so the budget's
    extrapolation is the plan's total, and the refusal prices the recomputing plan."""
    a = arch_of(load_config(None, ["model.num_layers=7"]).model, LIB)

    def plan_of(arch):
        return plan_model(arch, 8, 64, recompute="blocks")
    assert budget.plan_bytes(a, plan_of) == plan_of(a).total_bytes
    assert plan_of(a).total_bytes < plan_model(a, 8, 64).total_bytes


def test_a_block_s_backward_first_runs_its_forward_again_but_the_last_block_s():
    cfg = _cfg("nanoeuler")
    t = cfg.training
    none = build(cfg.model, LIB, t.batch_size, t.seq_len)
    blocks = build(cfg.model, LIB, t.batch_size, t.seq_len, recompute="blocks")
    nodes = blocks.tape.nodes
    assert len(nodes) == len(none.tape.nodes)   # data parallel's buckets count them
    replays = [(i, n) for i, n in enumerate(nodes) if isinstance(n, Replay)]
    steps = blocks.graph.steps()
    closing = [i for i, (layer, node, _) in enumerate(steps)
               if node is blocks.graph.block[-1] and layer is not None and layer >= 0]
    assert [i for i, _ in replays] == closing[:-1]   # blocks 0 and 1, not 2
    for i, replay in replays:
        assert isinstance(replay.node, Norm) and replay.node.branch is not None
        layer = steps[i][0]
        own = [n for (at, node, _), n in zip(steps, nodes) if at == layer
               and node in rerun(blocks.graph)]
        # c_attn, rope, attention, c_proj, the add norm, c_fc's two GEMMs, swiglu, c_proj
        assert len(replay.again) == len(own) == 9
        assert all(a is b for a, b in zip(replay.again, own))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_recomputing_blocks_gives_the_loss_and_every_gradient_bit_for_bit(name):
    cfg = _cfg(name)
    t = cfg.training
    want = _bits(build(cfg.model, LIB, t.batch_size, t.seq_len), cfg)
    got = _bits(build(cfg.model, LIB, t.batch_size, t.seq_len, recompute="blocks"), cfg)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def _rounding_model(cfg, precision, recompute):
    """A bf16 model on the CPU (tests/test_bf16_model.py's rounding library)."""
    t = cfg.training
    arch = arch_of(cfg.model, LIB)
    plan = plan_model(arch, t.batch_size, t.seq_len, dtype="bf16", precision=precision,
                      recompute=recompute)
    model = GPT(arch, RoundingLibrary(LIB), Memory(plan, np), t.batch_size, t.seq_len)
    model.tape.gemm = rounding_gemm
    return model


@pytest.mark.parametrize("name, precision", [("gpt2", "bf16"), ("nanoeuler", "autocast")])
def test_recomputing_in_bf16_and_autocast_gives_the_same_bits(name, precision):
    cfg = _cfg(name)
    want = _bits(_rounding_model(cfg, precision, "none"), cfg)
    got = _bits(_rounding_model(cfg, precision, "blocks"), cfg)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def _checkpoint(run, step: int) -> dict:
    folder = run / f"ckpt_{step:08d}"
    return {f: (folder / f).read_bytes() for f in ("model.safetensors", "optim.safetensors")}


def test_a_recomputing_run_and_its_resume_without_recomputing_are_the_run_without(
        shard, tmp_path):
    """Six AdamW steps: a run that recomputes up to its checkpoint at 3 and resumes without
    recomputing has the losses and checkpoints of the run that never recomputed."""
    straight = _train(shard, tmp_path / "none", 4)
    _stop_at_3(shard, tmp_path / "blocks", 4, recompute="blocks")
    assert _checkpoint(tmp_path / "blocks", 3) == _checkpoint(tmp_path / "none", 3)
    _train(shard, tmp_path / "blocks", 4, resume=True)
    assert losses(tmp_path / "blocks") == straight
    assert _checkpoint(tmp_path / "blocks", 6) == _checkpoint(tmp_path / "none", 6)


def test_the_config_takes_recompute_and_names_the_choices():
    assert load_config(None, []).training.recompute == "none"
    assert load_config(None, ["training.recompute=blocks"]).training.recompute == "blocks"
    with pytest.raises(EulerError, match=r"'block' is not one of none, blocks \(did you mean "
                                         r"'blocks'\?\)") as err:
        load_config(None, ["training.recompute=block"])
    assert err.value.key == "training.recompute" and "\n" not in str(err.value)


@pytest.mark.parametrize("mode", ["none", "blocks"])
def test_the_plan_command_shows_what_recomputing_saves_and_costs(mode):
    """Both plans' bytes of block values and totals, and the forwards run twice: a third of
    a block's training FLOPs (6 a weight and 12·H·hd·T of attention, a token), per block but
    the last."""
    from click.testing import CliRunner

    from eulergen.cli import main
    from eulergen.runtime.model.memory import format_bytes
    from eulergen.runtime.model.recompute import kept_bytes
    from eulergen.runtime.train.resolve import resolve
    sets = [*CONFIGS["gpt2"], f"training.recompute={mode}"]
    result = CliRunner().invoke(main, ["plan", *(a for s in sets for a in ("--set", s))])
    assert result.exit_code == 0, result.output
    line = " ".join(result.output.split()).split("training.recompute ")[-1]
    plans = {m: resolve(load_config(None, [*sets, f"training.recompute={m}"]), LIB,
                        for_gpu=True).plan for m in ("none", "blocks")}
    g = arch_of(_cfg("gpt2").model, LIB).graph
    for m, plan in plans.items():
        assert format_bytes(kept_bytes(g, plan)) in line and format_bytes(plan.total_bytes) in line
    assert kept_bytes(g, plans["blocks"]) < kept_bytes(g, plans["none"]) / 2
    d, f, T, tokens = 64, 96, 32, 2 * 32
    block = 6 * (d * 3 * d + 3 * d + d * d + d + d * f + f + f * d + d + 2 * 2 * d) + 12 * d * T
    assert line.startswith(mode)
    assert f"of 2 of 3 blocks run again in the backward, +{2 * block / 3 * tokens / 1e6:.3g} " \
           "MFLOP a step" in line
