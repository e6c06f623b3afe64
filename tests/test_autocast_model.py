"""training.precision=autocast without a GPU: a bf16 model that keeps what torch.autocast
keeps in float32 (runtime/model/plan.py's Precision): its plan (the residual stream, its
gradient and the parameter gradients in float32, the gradient's bf16 copy for the GEMMs),
its tape's wiring (the norms' autocast kernels over the stream and the master weights, the
embedding's float32 tables, the GEMMs of the stream's branches reading the copy), its
loss and gradients against fp32, and a checkpoint resumed bitwise, on the CPU library of
tests/test_bf16_model.py that rounds as the kernels do (the kernels themselves:
tests/test_autocast_emulated.py; on the GPU: tests/gpu/test_bf16_gpu.py)."""
from __future__ import annotations

import numpy as np
import pytest

from eulergen.errors import EulerError
from eulergen.runtime.engine.bf16 import from_bf16, to_bf16
from eulergen.runtime.model.arch import arch_of
from eulergen.runtime.model.plan import plan_model
from eulergen.runtime.model.tape import Embedding, Linear, Norm
from eulergen.runtime.model.optimizer_plan import plan_optimizer, update_ops
from eulergen.runtime.train.config import load_config
from eulergen.runtime.train.optimizer import Optimizer
from test_bf16_model import (COMMON, GRAD_TOLERANCE, LOSS_TOLERANCE, STRUCTURES, _batch,
                             _bf16_model, _cfg, _weights, fp32_reference,
                             lib)  # noqa: F401 (the fixture)

STREAM = ("h.0.x", "h.0.x_mid", "h.1.x", "h.1.x_mid", "x_final", "d.x", "scratch")


def _autocast_model(lib, cfg):
    return _bf16_model(lib, cfg, "autocast")


def _wide(a) -> np.ndarray:
    return from_bf16(a) if a.dtype == np.uint16 else np.asarray(a)


def test_the_autocast_plan_keeps_the_stream_and_the_gradients_in_float32(lib):
    arch = arch_of(_cfg("gpt2").model, lib)
    adamw = plan_optimizer(arch, update_ops(lib, "adamw"))
    plan = plan_model(arch, 2, 32, dtype="bf16", precision="autocast", optimizer=adamw)
    bf16 = plan_model(arch, 2, 32, dtype="bf16", optimizer=adamw)
    dtypes = {a.name: a.dtype for a in plan.arenas}
    assert dtypes["stream"] == dtypes["grads"] == "float32" and dtypes["workspace"] == "bf16"
    assert [b.name for b in plan.buffers if b.arena == "stream"] == list(STREAM)
    for name in STREAM[:-1]:   # the bf16 plan's buffers, twice the bytes
        assert plan.buffer(name).shape == bf16.buffer(name).shape
        assert plan.buffer(name).nbytes == 2 * bf16.buffer(name).nbytes, name
    assert plan.buffer("d.x_bf16").dtype == "bf16"
    assert plan.buffer("d.x_bf16").shape == plan.buffer("d.x").shape
    assert plan.arena("grads").nbytes == 2 * bf16.arena("grads").nbytes
    assert "grad_rows" not in plan.index and "grad_rows" in bf16.index
    for same in ("params", "params_bf16", "optimizer"):   # what a checkpoint holds
        assert plan.arena(same) == bf16.arena(same)
    assert plan_model(arch, 2, 32, precision="autocast") == plan_model(arch, 2, 32)  # fp32


def test_the_plan_command_shows_the_autocast_stream(lib):
    from click.testing import CliRunner

    from eulergen.cli import main
    overrides = STRUCTURES["gpt2"] + COMMON + ["training.dtype=bf16",
                                               "training.precision=autocast"]
    result = CliRunner().invoke(main, ["plan", *(a for o in overrides for a in ("--set", o))])
    assert result.exit_code == 0, result.output
    rows = {r[0]: r for r in ([c.strip() for c in line.split("│")[1:-1]]
                              for line in result.output.splitlines() if line.startswith("│"))}
    assert rows["stream total"][2] == rows["d.x"][2] == rows["grads"][2] == "float32"
    assert rows["d.x_bf16"][2] == "bf16"
    assert "training, bf16 (autocast)" in " ".join(result.output.split())


def test_config_takes_the_precision_and_names_the_choices():
    assert load_config(None, []).training.precision == "autocast"
    assert load_config(None, ["training.precision=bf16"]).training.precision == "bf16"
    with pytest.raises(EulerError, match=r"'autocas' is not one of bf16, autocast \(did you "
                                         r"mean 'autocast'\?\)") as err:
        load_config(None, ["training.precision=autocas"])
    assert err.value.key == "training.precision" and "\n" not in str(err.value)


def test_an_autocast_tape_reads_the_master_weights_in_the_norms_and_the_embedding(lib):
    """The norms and the embedding read the float32 master, the GEMMs its bf16 copy; every
    norm runs its autocast kernels, and writes the bf16 copy of the stream's gradient where
    a GEMM reads it later in the backward (every norm but the stem's, whose dx only the
    embedding reads); the GEMMs of the stream's branches read that copy."""
    cfg = _cfg("gpt2")
    model = _autocast_model(lib, cfg)
    model.load_state_dict(_weights(lib, cfg))
    master, copy = model.mem.arenas["params"], model.mem.arenas["params_bf16"]
    nodes = model.tape.nodes
    norms = [n for n in nodes if isinstance(n, Norm)]
    assert len(norms) == 1 + 2 * cfg.model.num_layers
    for n in norms:
        assert n.precision == "autocast" and n.x.dtype == np.float32
        assert all(np.shares_memory(w, master) for w in n.weights)
        assert n.outputs[-1].dtype == np.uint16 and n.dx.buf.dtype == np.float32
    assert norms[0].copy is None and all(n.copy is model.mem["d.x_bf16"] for n in norms[1:])
    (embedding,) = [n for n in nodes if isinstance(n, Embedding)]
    assert np.shares_memory(embedding.table, master) and embedding.out.dtype == np.float32
    linears = [n for n in nodes if isinstance(n, Linear)]
    assert all(np.shares_memory(n.w, copy) for n in linears)
    reading = [n for n in linears if np.shares_memory(n.dy, model.mem["d.x_bf16"])]
    assert len(reading) == 2 * cfg.model.num_layers   # attn.c_proj, mlp.c_proj
    assert all(n.dw.buf.dtype == np.float32 for n in linears)


@pytest.mark.parametrize("structure", sorted(STRUCTURES))
def test_autocast_gradients_match_fp32_at_least_as_well_as_bf16(lib, structure):
    """Against fp32 with the same weights and batch: the loss and every gradient within the
    bf16 tolerances, and the gradients closer on average than bf16 precision's (fewer
    roundings: no bf16 stream, no bf16 gradient)."""
    cfg = _cfg(structure)
    weights, (x, y), ref, ref_loss = fp32_reference(lib, cfg)
    errors = {}
    for precision in ("bf16", "autocast"):
        model = _bf16_model(lib, cfg, precision)
        model.load_state_dict(weights)
        model.load_tokens(x, y)
        assert float(model.loss_and_grad()[0]) == pytest.approx(ref_loss, rel=LOSS_TOLERANCE)
        errors[precision] = {name: np.linalg.norm(_wide(model.grads[name]) - g)
                             / max(np.linalg.norm(g), 1e-30) for name, g in ref.grads.items()}
        assert model.grad_norm() == pytest.approx(ref.grad_norm(), rel=GRAD_TOLERANCE)
    bad = {k: f"{v:.2e}" for k, v in errors["autocast"].items() if v > GRAD_TOLERANCE}
    assert not bad, f"autocast gradients off: {bad}"
    mean = {p: float(np.mean(list(e.values()))) for p, e in errors.items()}
    assert mean["autocast"] <= mean["bf16"], mean


def test_an_autocast_step_from_a_checkpoint_is_the_step_without_one(lib):
    """Master weights and moments are what a checkpoint holds (state_dict: float32, as in
    bf16 precision): a model loaded from them takes the next step bit for bit as the one
    that kept running (AdamW's autocast step from float32 gradients writes the copy)."""
    cfg = _cfg("nanoeuler")
    batch = _batch(cfg)
    control = {"skip": 0.0, "grad_scale": 1.0, "lr": 1e-3, "step": 1.0}

    def step(model, optim):
        model.load_tokens(*batch)
        model.loss_and_grad()
        optim.step(np.array([control[s] for s in optim.slots]))

    running = _autocast_model(lib, cfg)
    running.load_state_dict(_weights(lib, cfg))
    optim = Optimizer(running, update_ops(lib, "adamw"), cfg.training)
    step(running, optim)
    resumed = _autocast_model(lib, cfg)
    resumed.load_state_dict(running.state_dict())
    again = Optimizer(resumed, update_ops(lib, "adamw"), cfg.training)
    again.load_state_dict(optim.state_dict())
    for model, o in ((running, optim), (resumed, again)):
        step(model, o)
    for arena in ("params", "params_bf16", "optimizer"):
        np.testing.assert_array_equal(resumed.mem.arenas[arena], running.mem.arenas[arena],
                                      err_msg=arena)
    np.testing.assert_array_equal(running.mem.arenas["params_bf16"],
                                  to_bf16(running.mem.arenas["params"]))
