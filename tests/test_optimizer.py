"""training.optimizer on numpy: the shipped update ops (lion, sgd_momentum, muon) against
references written here, which op steps each parameter and where its state lies, their
checkpoints resumed bitwise, and the names and combinations refused."""
from __future__ import annotations

import numpy as np
import pytest

from eulergen.errors import EulerError
from eulergen.runtime.engine.backend import NUMPY
from eulergen.runtime.engine.ops import OpLibrary
from eulergen.runtime.model.arch import arch_of
from eulergen.runtime.model.optimizer_plan import plan_optimizer, update_ops
from eulergen.runtime.model.params import param_count, parameters
from eulergen.runtime.train import checkpoint
from eulergen.runtime.train.config import load_config
from eulergen.runtime.train.trainer import Trainer
from runs import losses

QUINTIC = (3.4445, -4.7750, 2.0315)
F32 = np.float32


@pytest.fixture(scope="module")
def lib():
    return OpLibrary(NUMPY)


def _orthogonalise(u, steps=5, eps=1e-7):
    """modded-nanogpt's zeropower_via_newtonschulz5, in float32."""
    a, b, c = (F32(k) for k in QUINTIC)
    x = u / (np.sqrt(np.sum(u * u)) + F32(eps))
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    for _ in range(steps):
        A = x @ x.T
        B = b * A + c * (A @ A)
        x = a * x + B @ x
    return x.T if tall else x


def _muon(p, g, m, lr, momentum=F32(0.95), scale=F32(5.0)):
    """Nesterov momentum, its update orthogonalised, scaled by sqrt(max(1, rows/cols)) and
    muon.yaml's lr_scale (its learning rate over the run's)."""
    m = momentum * m + g
    o = _orthogonalise(g + momentum * m)
    rows, cols = p.shape
    return p - lr * scale * F32(np.sqrt(max(1.0, rows / cols))) * o, m


@pytest.mark.parametrize("shape", [(24, 80), (80, 24), (48, 48)])
def test_muon_matches_newton_schulz_written_here_in_float32(lib, shape):
    """Three steps of lib.step("muon") (its generated phases around the runtime's GEMMs)
    within 1e-5 of the reference: float32 rounding only (the same products, summed in
    another order by the GEMMs)."""
    rng = np.random.default_rng(0)
    p = rng.standard_normal(shape).astype(F32)
    m, u = np.zeros(shape, F32), np.zeros(shape, F32)
    want, wm = p.copy(), m.copy()
    lr = F32(1e-2)
    for _ in range(3):
        g = rng.standard_normal(shape).astype(F32)
        lib.step("muon", p, g, m, u, control=np.array([0, 1, lr], F32))
        want, wm = _muon(want, g, wm, lr)
        assert want.dtype == F32
        err = np.abs(p - want).max() / np.abs(want).max()
        assert err < 1e-5, f"muon {shape}: {err:.2e}"
        np.testing.assert_array_equal(m, wm)


def test_a_skipped_muon_step_writes_nothing(lib):
    rng = np.random.default_rng(1)
    p, g, m = (rng.standard_normal((16, 32)).astype(F32) for _ in range(3))
    before = p.copy(), m.copy()
    lib.step("muon", p, g, m, np.zeros_like(p), control=np.array([1, 1, 1e-2], F32))
    assert np.array_equal(p, before[0]) and np.array_equal(m, before[1])


def test_lion_and_sgd_momentum_match_their_definitions(lib):
    rng = np.random.default_rng(2)
    p, g, m = (rng.standard_normal(64) for _ in range(3))
    lr, wd = 1e-2, 0.1
    state = [p.copy(), m.copy()]
    lib.step("lion", state[0], g, state[1], lr=lr, weight_decay=wd)
    c = 0.9 * m + 0.1 * g
    np.testing.assert_allclose(state[0], p * (1 - lr * wd) - lr * 0.2 * np.sign(c), rtol=1e-15)
    np.testing.assert_allclose(state[1], 0.99 * m + 0.01 * g, rtol=1e-15)
    state = [p.copy(), m.copy()]
    lib.step("sgd_momentum", state[0], g, state[1], lr=lr, weight_decay=wd)
    b = 0.9 * m + g + wd * p   # torch.optim.SGD: the decay joins the gradient
    np.testing.assert_allclose(state[1], b, rtol=1e-15)
    np.testing.assert_allclose(state[0], p - lr * b, rtol=1e-15)


def _arch(lib):
    return arch_of(load_config(None, ["model.num_layers=2"]).model, lib)


def test_muon_takes_the_linear_weights_alone_and_adamw_the_rest(lib):
    a = _arch(lib)
    plan = plan_optimizer(a, update_ops(lib, "muon"))
    owner = dict(plan.owner)
    specs = parameters(a)
    assert {s.name for s in specs if owner[s.name] == "muon"} == \
        {s.name for s in specs if s.linear} and "wte.weight" not in \
        {s.name for s in specs if owner[s.name] == "muon"}
    matrices = [g for g in plan.groups if g.op == "muon"]
    assert all(g.shape is not None and g.size == g.shape[0] * g.shape[1] for g in matrices)
    assert [g.at for g in matrices] == list(np.cumsum([0] + [g.size for g in matrices[:-1]]))
    rest = [g for g in plan.groups if g.op == "adamw"]
    assert [g.decay for g in rest] == [True, False]   # the embeddings, then the 1-D ones
    sizes = dict(plan.sizes)
    assert sizes["muon"] == sum(g.size for g in matrices)
    assert sizes["adamw"] == sum(g.size for g in rest)
    names = dict(plan.buffers())
    assert set(names) == {"muon.m", "muon.u", "muon.newton_schulz", "adamw.m", "adamw.v"}
    assert names["muon.u"] == max(g.size for g in matrices)


@pytest.mark.parametrize("op, params", [("muon", {"lr": 1e-2}), ("adamw", {"lr": 1e-2, "step": 1})])
def test_half_is_refused_on_numpy_and_for_an_op_without_a_matrix_step(lib, op, params):
    x = np.zeros((8, 8), np.float32)
    with pytest.raises(EulerError, match="half= iterates a matrix step in bf16, on a GPU only"):
        lib.step(op, x, x, x.copy(), x.copy(), half=True, **params)


def test_half_views_fit_the_workspace_of_every_shape():
    from eulergen.runtime.engine.newton_schulz import half_views, workspace_elements
    for shape in [(1, 1), (3, 5), (8, 8), (9, 7), (64, 192), (768, 3072), (3072, 768)]:
        ws = np.zeros(workspace_elements(*shape), np.float32)
        sumsq, x, y, a, b = half_views(ws, *shape)
        s = min(shape)
        assert [v.shape for v in (x, y, a, b)] == [shape, shape, (s, s), (s, s)]
        assert all(v.dtype == np.uint16 for v in (x, y, a, b)) and sumsq.dtype == np.float32
        starts = sorted(v.__array_interface__["data"][0] for v in (sumsq, x, y, a, b))
        assert all(p % 256 == starts[0] % 256 for p in starts)   # each 256-byte aligned
        x[...], y[...], a[...], b[...] = 1, 2, 3, 4   # no two overlap
        assert sumsq[0, 0] == 0 and (x == 1).all() and (y == 2).all() and (a == 3).all()


def test_a_gpu_plan_spreads_the_matrices_over_lanes_by_their_newton_schulz_flops(lib):
    """Largest first, each to the least loaded lane: 2 layers of GPT-2's four Linear shapes
    over 4 lanes end within one matrix's FLOPs of each other; every lane past the first
    has its own work buffer, workspace and GEMM workspace."""
    from eulergen.runtime.engine.cublas import WORKSPACE_BYTES
    from eulergen.runtime.engine.newton_schulz import flops
    a = _arch(lib)
    one, four = (plan_optimizer(a, update_ops(lib, "muon"), lanes=n) for n in (1, 4))
    assert {g.lane for g in one.groups} == {0} and one.lanes == 1
    matrices = [g for g in four.groups if g.shape is not None]
    assert four.lanes == 4 and {g.lane for g in matrices} == {0, 1, 2, 3}
    assert [(g.lo, g.hi, g.at) for g in four.groups] == [(g.lo, g.hi, g.at) for g in one.groups]
    load = [sum(flops(*g.shape) for g in matrices if g.lane == k) for k in range(4)]
    assert max(load) - min(load) <= max(flops(*g.shape) for g in matrices)
    names = dict(four.buffers())
    for k in (1, 2, 3):
        assert names[f"muon.u.{k}"] == names["muon.u"]
        assert names[f"muon.newton_schulz.{k}"] == names["muon.newton_schulz"]
        assert names[f"muon.gemm_ws.{k}"] * 4 == WORKSPACE_BYTES
    assert "muon.gemm_ws" not in names   # the first lane's GEMMs are the model's
    few = plan_optimizer(a, update_ops(lib, "muon"), lanes=64)
    assert few.lanes == len(matrices)   # no lane without a matrix


def test_lion_takes_the_linear_weights_as_one_range_and_adamw_the_rest(lib):
    """lion.yaml's `rest: adamw`: Lion's sign step on the Linear weights (one range: they
    lie together among the decayed parameters), AdamW's on the embeddings (decayed) and
    the 1-D parameters, each op's state as large as what it steps."""
    a = _arch(lib)
    ops = update_ops(lib, "lion")
    assert (ops.main.name, ops.rest.name, ops.slots) == \
        ("lion", "adamw", ("skip", "grad_scale", "lr", "step"))
    plan = plan_optimizer(a, ops)
    owner, specs = dict(plan.owner), parameters(a)
    assert {s.name for s in specs if owner[s.name] == "lion"} == {s.name for s in specs if s.linear}
    assert [(g.op, g.decay, g.shape) for g in plan.groups] == \
        [("adamw", True, None), ("lion", True, None), ("adamw", False, None)]
    assert [g.at for g in plan.groups] == [0, 0, plan.groups[0].size]
    assert plan.groups[0].hi == plan.groups[1].lo and plan.groups[1].hi == plan.groups[2].lo
    linear = sum(int(np.prod(s.shape)) for s in specs if s.linear)
    assert plan.groups[1].size == linear
    other = a.param_layout.total - linear
    assert dict(plan.buffers()) == {"lion.m": linear, "adamw.m": other, "adamw.v": other}


def test_a_lion_step_is_lion_s_on_the_linear_weights_and_adamw_s_on_the_others(lib):
    """One Optimizer.step of lion against the two ops stepped by hand, parameter by
    parameter: lib.step("lion") on the Linear weights, lib.step("adamw") on the others, the
    config's weight decay on the decayed ones (the embeddings among them)."""
    from eulergen.runtime.model.gpt import build
    from eulergen.runtime.train.optimizer import Optimizer
    cfg = load_config(None, ["model.num_layers=1", "model.hidden_dim=32", "model.num_heads=1",
                             "model.num_kv_heads=1", "model.max_seq_len=16",
                             "model.mlp_hidden=64", "training.optimizer=lion"])
    ops = update_ops(lib, "lion")
    model = build(cfg.model, lib, 2, 16, optimizer=ops)
    opt = Optimizer(model, ops, cfg.training)
    mem, rng = model.mem, np.random.default_rng(3)
    ranges = [(s, slice(at, at + int(np.prod(s.shape))))
              for s, at in model.arch.param_layout.entries]
    for _, sl in ranges:   # the parameters', not the padding between them
        mem.arenas["params"][sl] = rng.standard_normal(sl.stop - sl.start)
        mem.arenas["grads"][sl] = rng.standard_normal(sl.stop - sl.start)
    p0, g = mem.arenas["params"].copy(), mem.arenas["grads"].copy()
    lr, wd = 1e-2, cfg.training.weight_decay
    opt.step(np.array([0, 1, lr, 1]))   # float64: the values lib.step passes by hand
    want = p0.copy()
    for s, sl in ranges:
        w, m, v = want[sl].copy(), np.zeros_like(want[sl]), np.zeros_like(want[sl])
        decay = wd if s.decay else 0.0
        if s.linear:
            lib.step("lion", w, g[sl].copy(), m, lr=lr, weight_decay=decay)
        else:
            lib.step("adamw", w, g[sl].copy(), m, v, lr=lr, step=1.0, weight_decay=decay)
        want[sl] = w
    np.testing.assert_array_equal(mem.arenas["params"], want)


def test_adamw_alone_is_two_ranges_over_every_parameter(lib):
    a = _arch(lib)
    plan = plan_optimizer(a, update_ops(lib, "adamw"))
    lo_hi = [(g.lo, g.hi, g.at, g.decay) for g in plan.groups]
    end = lo_hi[0][1]
    assert lo_hi == [(0, end, 0, True), (end, lo_hi[1][1], end, False)]
    assert dict(plan.buffers()) == {"adamw.m": lo_hi[1][1], "adamw.v": lo_hi[1][1]}


@pytest.mark.parametrize("name, says", [
    ("adamx", "'adamx' is no op (did you mean 'adamw'?); an optimizer is an update op: "
              "adamw, lion, muon, sgd_momentum"),
    ("gelu", "'gelu' is a pointwise op; an optimizer is an update op"),
])
def test_an_optimizer_that_is_no_update_op_is_refused_naming_the_key(lib, name, says):
    with pytest.raises(EulerError) as err:
        update_ops(lib, name)
    assert err.value.key == "training.optimizer" and says in err.value.message


def test_muon_with_zero_is_refused_at_plan_time(lib):
    from eulergen.runtime.distributed.buckets import plan_buckets
    a = _arch(lib)
    with pytest.raises(EulerError, match="needs whole matrices") as err:
        plan_optimizer(a, update_ops(lib, "muon"), plan_buckets(a, 2, zero=True))
    assert err.value.key == "training.zero"


def _run(shard, run_dir, optimizer, **training):
    t = dict(batch_size=2, seq_len=16, total_steps=6, warmup_steps=1, eval_every=0,
             checkpoint_every=3, log_every=1, sample_tokens=0, optimizer=optimizer)
    t.update(training)
    return load_config(None, [f"run_dir={run_dir}", f"data.dataset={shard}",
                              f"data.val_dataset={shard}", "model.hidden_dim=32",
                              "model.num_layers=1", "model.num_heads=1", "model.num_kv_heads=1",
                              "model.max_seq_len=16", "model.mlp_hidden=64",
                              *(f"training.{k}={v}" for k, v in t.items())])


@pytest.mark.parametrize("optimizer", ["lion", "muon"])
def test_a_resumed_run_repeats_the_uninterrupted_losses_bitwise(lib, shard, tmp_path, optimizer):
    straight = Trainer(_run(shard, tmp_path / "a", optimizer), lib, progress=False,
                       tensorboard=False).run()
    Trainer(_run(shard, tmp_path / "b", optimizer), lib, progress=False,
            tensorboard=False).run(stop_after=4)   # checkpointed at 3; step 4 is lost
    Trainer(_run(shard, tmp_path / "b", optimizer), lib, resume=True, progress=False,
            tensorboard=False).run()
    assert losses(tmp_path / "b") == losses(tmp_path / "a") == straight.losses
    held = checkpoint.load(checkpoint.latest(tmp_path / "b")).optim
    a = arch_of(_run(shard, tmp_path, optimizer).model, lib)
    owner = dict(plan_optimizer(a, update_ops(lib, optimizer)).owner)
    states = {"lion": {"m"}, "muon": {"m"}, "adamw": {"m", "v"}}
    assert set(held) == {f"{s}.{p}" for p, op in owner.items() for s in states[op]}


def test_an_adamw_checkpoint_keeps_its_names_and_refuses_another_optimizer(lib, shard,
                                                                            tmp_path):
    Trainer(_run(shard, tmp_path / "a", "adamw", total_steps=3), lib, progress=False,
            tensorboard=False).run()
    held = checkpoint.load(checkpoint.latest(tmp_path / "a")).optim
    names = [s.name for s in parameters(arch_of(_run(shard, tmp_path, "adamw").model, lib))]
    assert set(held) == {f"{k}.{n}" for k in "mv" for n in names}   # as before issue 35
    cfg = _run(shard, tmp_path / "a", "lion", total_steps=4)
    with pytest.raises(EulerError, match="optimizer state holds v.* which lion has no place"):
        Trainer(cfg, lib, resume=True, progress=False, tensorboard=False)


def test_the_plan_command_shows_each_op_s_state(tmp_path):
    from click.testing import CliRunner

    from eulergen.cli import main
    result = CliRunner().invoke(main, ["plan", "--set", "training.optimizer=muon",
                                       "--set", "model.num_layers=1"])
    assert result.exit_code == 0, result.output
    for name in ("muon.m", "muon.u", "muon.newton_schulz", "adamw.m", "adamw.v",
                 "optimizer total"):
        assert name in result.output


@pytest.mark.parametrize("optimizer", ["lion", "adamw"])
def test_the_plan_command_says_which_op_steps_which_parameters(lib, optimizer):
    from click.testing import CliRunner

    from eulergen.cli import main
    result = CliRunner().invoke(main, ["plan", "--set", f"training.optimizer={optimizer}",
                                       "--set", "model.num_layers=1"])
    assert result.exit_code == 0, result.output
    a = arch_of(load_config(None, ["model.num_layers=1"]).model, lib)
    linear = [s for s in parameters(a) if s.linear]
    n = sum(int(np.prod(s.shape)) for s in linear)
    says = {"lion": f"training.optimizer lion: the Linear weights ({len(linear)} parameters, "
                    f"{n:,} elements); its rest op adamw: the embeddings and the 1-D parameters "
                    f"({len(parameters(a)) - len(linear)} parameters, "
                    f"{param_count(a) - n:,} elements)",
            "adamw": f"training.optimizer adamw: every parameter ({param_count(a):,} "
                     "elements)"}[optimizer]
    assert says in " ".join(result.output.split())


@pytest.mark.parametrize("optimizer, zero", [("sgd_momentum", 1), ("lion", 1), ("muon", 0)])
def test_two_ranks_of_4_train_as_one_process_of_8(shard, tmp_path, optimizer, zero):
    """Data parallel on the CPU collective: sgd_momentum's state shared by ZeRO-1 (each rank
    its share, gathered whole into the checkpoint), and lion's and its rest op adamw's,
    muon on whole gradients (its matrix step needs whole matrices): the losses of 1 x 8
    within float32 summation order."""
    from test_ddp import _on_ranks, _train, max_rel
    one = _train(shard, tmp_path / "one", 8, optimizer=optimizer)
    out = _on_ranks(2, lambda c: _train(shard, tmp_path / "two", 4, c, optimizer=optimizer,
                                        zero=zero, bucket_mb="0.01"), timeout=60)
    assert not any(isinstance(o, Exception) for o in out), out
    rel = max_rel(out[0], one)
    print(f"{optimizer}: 2 x 4 against 1 x 8, max relative loss difference {rel:.2e}")
    assert rel < 1e-5
    ours, theirs = checkpoint.load(tmp_path / "two"), checkpoint.load(tmp_path / "one")
    assert ours.optim.keys() == theirs.optim.keys()
