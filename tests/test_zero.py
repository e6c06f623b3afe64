"""Gradient buckets and ZeRO-1 on the CPU collective (runtime/distributed/buckets.py,
runtime/distributed/data_parallel.py): buckets cover the arena and are final when issued, a rank's
shares partition it, the GPU's stream order on stand-ins, N ranks x B with ZeRO train as
1 x N·B, a ZeRO checkpoint resumes on another world size."""
from __future__ import annotations

import json

import numpy as np
import pytest

from eulergen.runtime.model.arch import arch_of
from eulergen.runtime.engine.backend import NUMPY
from eulergen.runtime.distributed.buckets import param_ready, plan_buckets
from eulergen.runtime.train.checkpoint import load
from eulergen.runtime.train.config import load_config
from eulergen.runtime.model.gpt import build
from eulergen.runtime.engine.ops import OpLibrary
from test_ddp import _cfg, _on_ranks, _train, max_rel

SMALL = ["model.hidden_dim=32", "model.num_layers=2", "model.num_heads=2",
         "model.max_seq_len=32", "model.mlp_hidden=64"]
LIB = OpLibrary(NUMPY)
BUCKET_MB = "0.01"   # ~2.6k float32 gradients a bucket: the tiny model's fill eight


def _arch(*sets):
    return arch_of(load_config(None, [*SMALL, *sets]).model, LIB)


@pytest.mark.parametrize("sets", [(), ("model.positions=rope", "model.activation=swiglu",
                                       "model.norm=rmsnorm", "model.bias=false")])
def test_buckets_cover_the_arena_in_the_order_their_gradients_become_final(sets):
    a = _arch(*sets)
    plan = plan_buckets(a, 2, bucket_mb=float(BUCKET_MB))
    spans = sorted((b.lo, b.hi) for b in plan.buckets)
    assert spans[0][0] == 0 and spans[-1][1] == plan.total
    assert all(hi == lo for (_, hi), (lo, _) in zip(spans, spans[1:]))   # no gap, no overlap
    assert [b.ready for b in plan.buckets] == sorted(b.ready for b in plan.buckets)
    assert len(plan.buckets) > 4   # overlap needs buckets issued before the end
    # the tied table's gradient is final only after the embedding, the last node
    assert param_ready(a)["wte.weight"] == plan.nodes - 1


@pytest.mark.parametrize("recompute", ["none", "blocks"])
def test_a_bucket_holds_its_final_gradients_when_the_backward_reaches_it(shard, recompute):
    """The backward's hook sees each bucket's gradients as they are after the whole
    backward: no later node writes into a bucket once it is issued (training.recompute
    blocks: a block's forward run again inside the backward moves none)."""
    cfg = load_config(None, [*SMALL, "training.batch_size=2", "training.seq_len=16"])
    model = build(cfg.model, LIB, 2, 16, recompute=recompute)
    model.init_weights(0)
    plan = plan_buckets(model.arch, 2, bucket_mb=float(BUCKET_MB))
    tokens = np.frombuffer(shard.read_bytes()[1024:1024 + 2 * 17], np.uint8).reshape(2, 17)
    model.load_tokens(tokens[:, :-1], tokens[:, 1:])
    grads, seen = model.mem.arenas["grads"], {}

    def after(node):
        for b in plan.buckets:
            if b.ready == node:
                seen[b] = grads[b.lo:b.hi].copy()
    model.loss_and_grad(after=after)
    assert set(seen) == set(plan.buckets)
    for b, early in seen.items():
        assert np.array_equal(early, grads[b.lo:b.hi]), b


@pytest.mark.parametrize("ranks", [2, 3])
def test_zero_shares_cover_every_gradient_once_and_tails_on_every_rank(ranks):
    plan = plan_buckets(_arch(), ranks, zero=True, bucket_mb=float(BUCKET_MB))
    count = np.zeros(plan.total, int)
    for r in range(ranks):
        owned = plan.owned(r)
        assert sum(s.hi - s.lo for s in owned) == plan.moments   # one moment size a rank
        assert [s.at for s in owned] == list(np.cumsum([0] + [s.hi - s.lo for s in owned])[:-1])
        for s in owned:
            count[s.lo:s.hi] += 1 if not s.tail else 0
            assert s.lo % 64 == 0 and (s.hi - s.lo) % 64 == 0
    tails = np.zeros(plan.total, bool)
    for s in plan.owned(0):
        tails[s.lo:s.hi] |= s.tail
    assert (count[~tails] == 1).all() and (count[tails] == 0).all()
    assert plan.moments < plan.total / ranks + len(plan.buckets) * ranks * 64


def test_on_the_gpu_buckets_reduce_on_a_side_stream_the_step_stream_waits_for():
    """DataParallel's GPU side on stand-ins of CuPy's streams and events and of NCCL (the
    calls are recorded, not run): each bucket's collectives go to the side stream after an
    event the step's stream records once the bucket is final, one group each time; the
    loss joins the last group; `finish` makes the step's stream wait for the side stream."""
    import contextlib
    import types

    from eulergen.runtime.distributed.data_parallel import DataParallel
    log, current = [], ["step"]

    class Stream:
        def __init__(self, name="side", non_blocking=False):
            self.name = name

        def __enter__(self):
            current.append(self.name)

        def __exit__(self, *exc):
            current.pop()

        def wait_event(self, event):
            log.append(("wait", self.name, event.name))

    class Event:
        names = iter(("ready", "done"))

        def __init__(self, disable_timing=False):
            self.name = next(Event.names)

        def record(self, stream=None):
            log.append(("record", self.name, stream.name if stream else current[-1]))

    class Nccl:
        rank, world_size = 0, 2

        @contextlib.contextmanager
        def group(self):
            log.append(("group", current[-1]))
            yield
            log.append(("end", current[-1]))

        def all_reduce_sum(self, a):
            log.append(("all_reduce", a.size, current[-1]))

        def reduce_scatter(self, a, out):
            log.append(("reduce_scatter", a.size, out.size, current[-1]))

    plan = plan_buckets(_arch(), 2, zero=True, bucket_mb=float(BUCKET_MB))
    cuda = types.SimpleNamespace(Stream=Stream, Event=Event,
                                 get_current_stream=lambda: Stream(current[-1]))

    class Memory(dict):
        arenas = {"grads": np.zeros(plan.total, np.float32)}
    model = types.SimpleNamespace(backend=types.SimpleNamespace(is_gpu=True),
                                  xp=types.SimpleNamespace(cuda=cuda),
                                  mem=Memory(dp_loss=np.zeros(1, np.float32)))
    dp = DataParallel(model, Nccl(), plan)
    for node in range(plan.nodes):
        dp.after(node)
    dp.finish()
    groups = [i for i, e in enumerate(log) if e[0] == "group"]
    assert len(groups) == len({b.ready for b in plan.buckets})   # one a node that ends any
    for i in groups:   # the side stream, after the step stream's word that the bucket is final
        assert log[i - 2:i + 1] == [("record", "ready", "step"), ("wait", "side", "ready"),
                                    ("group", "side")]
    calls = [e for e in log if e[0] in ("all_reduce", "reduce_scatter")]
    assert {e[-1] for e in calls} == {"side"}
    # every gradient once: a bucket's 2 shares reduce-scattered, its tail all-reduced
    assert sum(e[1] for e in calls) == plan.total + 1   # and the loss
    assert log[-4:] == [("all_reduce", 1, "side"), ("end", "side"), ("record", "done", "side"),
                        ("wait", "step", "done")]


def _three_zero_ranks(shard, run_dir) -> dict:
    out = _on_ranks(3, lambda c: _train(shard, run_dir, 4, c, zero=1, bucket_mb=BUCKET_MB),
                    timeout=60)
    assert not any(isinstance(o, Exception) for o in out), out
    assert out[0] == out[1] == out[2]
    return out[0]


def test_zero_ranks_of_b_match_one_process_of_3b_and_repeat_bitwise(shard, tmp_path):
    """Three ranks: buckets that do not split in three leave tails, all-reduced."""
    assert any(s.tail for s in plan_buckets(_arch(), 3, zero=True,
                                            bucket_mb=float(BUCKET_MB)).owned(0))
    one = _train(shard, tmp_path / "one", 12)
    zero = _three_zero_ranks(shard, tmp_path / "zero")
    # the sums of three shares of every gradient (each pre-divided by 3) and of the norm's
    # squares, where one process sums each whole: ~1e-7 relative over six steps
    rel = max_rel(zero, one)
    print(f"max relative loss difference, ZeRO 3 x 4 against 1 x 12: {rel:.2e}")
    assert rel < 1e-6
    assert _three_zero_ranks(shard, tmp_path / "again") == zero
    # one rank-independent checkpoint: every moment whole, by name, as a 1-process run's
    ours, theirs = load(tmp_path / "zero"), load(tmp_path / "one")
    assert ours.optim.keys() == theirs.optim.keys()
    # Adam's update is nearly lr·sign(m) where |m| is small, so the rounding differences of
    # near-zero gradient elements move those weights by up to lr and the later gradients
    # follow: elements drift apart over six steps (seen: up to 2e-4 of a tensor's largest
    # element, with the data this package's source makes). The whole tensor stays close:
    # its relative L2 difference, seen at most 6.5e-5.
    for name, value in theirs.optim.items():
        err = np.linalg.norm(ours.optim[name] - value) / np.linalg.norm(value)
        assert err < 2e-4, (name, err)


def test_buckets_wait_for_the_last_micro_step_of_gradient_accumulation(shard, tmp_path):
    """2 ranks x 2 micro-steps of B=2 with ZeRO: the buckets are issued from the last
    micro-step's backward only, and the step is one process's 1 x 8."""
    one = _train(shard, tmp_path / "one", 8)
    out = _on_ranks(2, lambda c: _train(shard, tmp_path / "acc", 2, c, zero=1,
                                        bucket_mb=BUCKET_MB, gradient_accumulation=2),
                    timeout=60)
    assert not any(isinstance(o, Exception) for o in out), out
    assert max_rel(out[0], one) < 1e-6


def test_a_zero_checkpoint_resumes_on_one_rank_and_a_one_rank_one_on_two(shard, tmp_path):
    """2 x 4 with ZeRO to step 3, then 1 x 8 to the end; 1 x 8 to step 3, then 2 x 4 with
    ZeRO: both continue the uninterrupted 1 x 8 run (the data position counts global
    batches of 8 rows)."""
    straight = _train(shard, tmp_path / "straight", 8)
    for first, then in (("zero", "one"), ("one", "zero")):
        run = tmp_path / f"{first}-then-{then}"
        if first == "zero":
            out = _on_ranks(2, lambda c: _stop_at_3(shard, run, 4, c, zero=1,
                                                    bucket_mb=BUCKET_MB), timeout=60)
            assert out == [None, None], out
            resumed = _train(shard, run, 8, resume=True)
        else:
            _stop_at_3(shard, run, 8)
            out = _on_ranks(2, lambda c: _train(shard, run, 4, c, resume=True, zero=1,
                                                bucket_mb=BUCKET_MB), timeout=60)
            assert not any(isinstance(o, Exception) for o in out), out
            resumed = out[0]
        assert sorted(resumed) == [4, 5, 6]
        for step, loss in resumed.items():
            assert abs(loss - straight[step]) <= 1e-6 * straight[step], (first, step)
        state = json.loads((run / "ckpt_00000006" / "state.json").read_text())
        assert state["data"]["rows"] == 8


def _stop_at_3(shard, run_dir, batch, collective=None, **training):
    from eulergen.runtime.train.trainer import Trainer
    cfg = load_config(None, _cfg(shard, run_dir, batch, **training))
    Trainer(cfg, LIB, progress=False, tensorboard=False, collective=collective).run(stop_after=3)


def test_the_plan_command_shows_one_rank_s_memory_with_zero():
    """`eulergen plan --nproc 4` with training.zero=1: AdamW's moments are one rank's share
    (the bucket plan's), every other arena as without ZeRO but for the share's norms."""
    from click.testing import CliRunner

    from eulergen.cli import main

    def shown(*args):
        sets = [*SMALL, "training.batch_size=2", "training.seq_len=32", "training.dtype=fp32",
                *args]
        result = CliRunner().invoke(main, ["plan", "--nproc", "4",
                                           *(a for o in sets for a in ("--set", o))])
        assert result.exit_code == 0, result.output
        rows = [[c.strip() for c in line.split("│")[1:-1]] for line in result.output.splitlines()
                if line.startswith("│")]
        return {r[0]: r for r in rows}, result.output
    zero, text = shown("training.zero=1", f"training.bucket_mb={BUCKET_MB}")
    full, _ = shown()
    plan = plan_buckets(_arch(), 4, zero=True, bucket_mb=float(BUCKET_MB))
    assert "one rank of 4 with ZeRO-1" in " ".join(text.split())   # the title may wrap
    assert zero["adamw.m"][1] == zero["adamw.v"][1] == str(plan.moments) != full["adamw.m"][1]
    assert full["adamw.m"][1] == str(plan.total)
    assert zero["params total"] == full["params total"]
    saved = 2 * 4 * (plan.total - plan.moments)   # two float32 moments
    # less the share's float32 norms, one a span (the GPU's sum of squares), 64 aligned
    norms = 4 * -(-len(plan.owned(0)) // 64) * 64
    assert zero["shard_norms"][1] == str(len(plan.owned(0))) and "shard_norms" not in full
    bytes_of = {k: int(v[3].split()[0].replace(",", "")) for k, v in (("zero", zero["total"]),
                                                                     ("full", full["total"]))}
    assert bytes_of["full"] - bytes_of["zero"] == saved - norms
