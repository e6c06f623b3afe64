"""bf16 mixed precision without a GPU: the dtype bookkeeping of a bf16 model (its plan,
which arrays are bf16 and which float32, the bf16 weight copy, the padded logits' -inf,
the gradient norm and clipping, AdamW from bf16 gradients) run on the CPU. (The bf16
GEMM calls against a cublasGemmEx stand-in: tests/test_model_gemm.py.)

The CPU model runs the numpy backend behind a library that rounds as the bf16 kernels do:
every op reads its bf16 operands widened to float32, computes in float32 and rounds its
bf16 outputs once (per-row values, a loss and lse, stay float32), and every GEMM sums in
float32 and rounds once. Only the kernels and cuBLAS are not exercised here
(tests/gpu/test_bf16_gpu.py runs the same comparisons on the GPU).

Tolerances (the same as on the GPU): bf16 keeps 8 significant bits, so each rounding is
off by up to 2^-9 ≈ 2e-3 of the value; a two-layer model rounds every activation and
gradient a few dozen times along a path, and the errors, independent, add in quadrature
to ~1e-2 of a gradient's norm. Per parameter ‖g_bf16 − g_fp32‖ / ‖g_fp32‖ < 2e-2, the
loss (summed in float32 from bf16 logits) within 1e-2 relative; a wrong gradient is off by
order 1.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from eulergen.errors import EulerError
from eulergen.runtime.engine import bf16
from eulergen.runtime.train.optimizer import Optimizer
from eulergen.runtime.model.arch import arch_of
from eulergen.runtime.engine.backend import NUMPY, Backend
from eulergen.runtime.train.config import load_config
from eulergen.runtime.model.memory import Memory, storage
from eulergen.runtime.model.gpt import GPT, build
from eulergen.runtime.model.optimizer_plan import plan_optimizer, update_ops
from eulergen.runtime.model.plan import plan_model
from eulergen.runtime.engine.bf16 import from_bf16, to_bf16
from eulergen.runtime.engine.ops import OpLibrary
from eulergen.runtime.model.tape import Linear

GRAD_TOLERANCE = 2e-2
LOSS_TOLERANCE = 1e-2
# vocab 300 pads to 320 rows: the -inf of the padded logits is exercised
STRUCTURES = {
    "gpt2": ["model.preset=gpt2", "model.hidden_dim=64", "model.num_heads=2",
             "model.num_kv_heads=2"],
    "nanoeuler": ["model.preset=nanoeuler", "model.hidden_dim=64", "model.num_heads=4",
                  "model.num_kv_heads=2"],
}
COMMON = ["model.num_layers=2", "model.vocab_size=300", "model.max_seq_len=32",
          "model.mlp_hidden=96", "training.seq_len=32", "training.batch_size=2"]


@pytest.fixture(scope="module")
def lib():
    return OpLibrary(NUMPY)


class RoundingLibrary:
    """The numpy library, called as the bf16 kernels compute: bf16 (uint16) operands
    widened, float32 arithmetic, bf16 outputs rounded once; float32 outputs as they are."""

    def __init__(self, lib):
        self.lib, self.backend = lib, lib.backend

    def __getattr__(self, name):   # op, workspace_elements
        return getattr(self.lib, name)

    @staticmethod
    def _wide(a):
        return from_bf16(a) if a is not None and a.dtype == np.uint16 else a

    def _rounding(self, call: str, op, args, out, params):
        outs = out if isinstance(out, tuple) else (out,)
        wide = tuple(self._wide(o) for o in outs)   # float32 copies (accumulate= adds to them)
        getattr(self.lib, call)(op, *map(self._wide, args), out=wide, **params)
        for o, w in zip(outs, wide):
            if o is not None and o is not w:
                to_bf16(w, out=o)
        return out

    def forward(self, op, *args, out, **params):
        return self._rounding("forward", op, args, out, params)

    def backward(self, op, *args, out, copy=None, **params):
        got = self._rounding("backward", op, args, out, params)
        if copy is not None:   # an autocast backward's bf16 copy of dx, rounded from it
            to_bf16(out[0], out=copy)
        return got

    def fused(self, op, *args, out, **params):
        return self._rounding("fused", op, args, out, params)

    def step(self, op, *args, copy=None, **params):
        self.lib.step(op, *map(self._wide, args), **params)
        if copy is not None:   # the bf16 kernel's copy of the updated weight (adamw's p)
            to_bf16(args[0], out=copy)


def rounding_gemm(a, b, out, *, ta=False, tb=False, add=False):
    """What the bf16 cublasGemmEx computes: bf16 operands, a float32 sum, one rounding (a
    float32 out, autocast's gradients, takes the sum as it is)."""
    a, b = from_bf16(a), from_bf16(b)
    got = (a.T if ta else a) @ (b.T if tb else b)
    if out.dtype == np.float32:
        out[...] = got + out if add else got
    else:
        to_bf16(got + from_bf16(out) if add else got, out=out)


def _cfg(structure):
    return load_config(None, STRUCTURES[structure] + COMMON)


def _bf16_model(lib, cfg, precision: str = "bf16"):
    """A bf16 GPT on the CPU (build refuses bf16 on numpy: this is the test's own), in
    training.precision `precision`."""
    t = cfg.training
    arch = arch_of(cfg.model, lib)
    plan = plan_model(arch, t.batch_size, t.seq_len, dtype="bf16", precision=precision,
                      optimizer=plan_optimizer(arch, update_ops(lib, "adamw")))
    model = GPT(arch, RoundingLibrary(lib), Memory(plan, np), t.batch_size, t.seq_len)
    model.tape.gemm = rounding_gemm
    return model


def _weights(lib, cfg):
    t = cfg.training
    model = build(cfg.model, lib, t.batch_size, t.seq_len)
    model.init_weights(1)
    rng = np.random.default_rng(2)   # norm weights and biases off 1 and 0
    return {k: (v + rng.normal(0, 0.1, v.shape)).astype(np.float32) if v.ndim == 1 else v
            for k, v in model.state_dict().items()}


def _batch(cfg, seed=0):
    rng = np.random.default_rng(seed)
    t = cfg.training
    x = rng.integers(0, cfg.model.vocab_size, (t.batch_size, t.seq_len))
    x[0, :4] = 7     # repeated ids: the embedding scatter sums them
    return x, rng.integers(0, cfg.model.vocab_size, (t.batch_size, t.seq_len))


def test_the_bf16_plan_keeps_master_weights_and_moments_in_float32(lib):
    arch = arch_of(_cfg("gpt2").model, lib)
    adamw = plan_optimizer(arch, update_ops(lib, "adamw"))
    plan = plan_model(arch, 2, 32, dtype="bf16", optimizer=adamw)
    fp32 = plan_model(arch, 2, 32, optimizer=adamw)
    dtypes = {a.name: a.dtype for a in plan.arenas}
    assert dtypes == {"params": "float32", "params_bf16": "bf16", "grads": "bf16",
                      "optimizer": "float32", "activations": "bf16",
                      "stats": "float32", "workspace": "bf16", "tokens": "int32"}
    size = {a.name: a.size for a in plan.arenas}
    assert size["params"] == size["params_bf16"] == size["grads"] == \
        plan.buffer("adamw.m").size == plan.buffer("adamw.v").size
    assert plan.arena("params") == fp32.arena("params")      # the same master layout
    assert [b.name for b in plan.buffers if b.arena == "stats"] == \
        ["h.0.lse", "h.1.lse", "losses", "loss", "dloss", "grad_rows", "grad_norm"]
    assert plan.buffer("grad_rows").size * 4096 >= size["grads"] >= plan.buffer("grad_rows").size
    # bf16 halves the gradients, activations and workspace
    for name in ("grads", "activations", "workspace"):
        assert plan.arena(name).nbytes < 0.55 * fp32.arena(name).nbytes, name
    inference = plan_model(arch, 2, 32, training=False, dtype="bf16")
    assert {"grads", "optimizer"}.isdisjoint(a.name for a in inference.arenas)
    assert "params_bf16" in {a.name for a in inference.arenas}


def test_an_fp32_plan_has_no_bf16_arenas(lib):
    arch = arch_of(_cfg("gpt2").model, lib)
    plan = plan_model(arch, 2, 32, optimizer=plan_optimizer(arch, update_ops(lib, "adamw")))
    assert {a.name for a in plan.arenas} == {"params", "grads", "optimizer",
                                               "activations", "workspace", "tokens"}
    assert {a.dtype for a in plan.arenas} == {"float32", "int32"}


def test_the_gpu_plan_sizes_the_kernels_workspace_for_bf16(lib):
    from eulergen.runtime.engine.cuda_ops import workspace_elements
    arch = arch_of(_cfg("gpt2").model, lib)
    asked = []

    def workspace(op, stage, shape, *, dtype, table_rows=0, fusion=""):
        asked.append((dtype, op.name, fusion))
        return workspace_elements(op, stage, shape, dtype, table_rows=table_rows, fusion=fusion)

    plan = plan_model(arch, 2, 32, dtype="bf16", workspace=workspace)
    assert {dt for dt, _, _ in asked} == {"bf16"} and plan.buffer("kernel_ws").dtype == "float32"
    # the fused backwards' partial sums too: the norm's add and the activation's bias
    assert {("layernorm", "add"), ("gelu", "bias")} <= {(op, f) for _, op, f in asked}
    bias = workspace_elements(arch.ops.activation, "backward", (2, 32, arch.ffn), "bf16",
                              fusion="bias")
    assert 0 < bias <= plan.buffer("kernel_ws").size


def test_the_plan_command_shows_the_bf16_layout_a_gpu_run_allocates(lib):
    """`eulergen plan` on a machine without a GPU: every arena of the bf16 plan (the bf16
    weight copy and the float32 stats among them), each with its dtype and bytes, and the
    total, as the GPU run plans them (the kernels' and cuBLASLt's workspaces included)."""
    from click.testing import CliRunner

    from eulergen.cli import main
    from eulergen.runtime.engine.cublas import WORKSPACE_BYTES
    from eulergen.runtime.engine.cuda_ops import workspace_elements
    overrides = STRUCTURES["nanoeuler"] + COMMON + ["training.dtype=bf16", "training.precision=bf16"]
    result = CliRunner().invoke(main, ["plan", *(a for o in overrides for a in ("--set", o))])
    assert result.exit_code == 0, result.output
    cfg = load_config(None, overrides)
    arch = arch_of(cfg.model, lib)
    plan = plan_model(arch, 2, 32, dtype="bf16", workspace=workspace_elements,
                      gemm_workspace=WORKSPACE_BYTES,
                      optimizer=plan_optimizer(arch, update_ops(lib, "adamw")))
    assert {"params_bf16", "stats", "kernels", "gemm"} <= {a.name for a in plan.arenas}
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in result.output.splitlines()
            if line.startswith("│")]
    totals = {r[0].removesuffix(" total"): r for r in rows if r[0].endswith(" total")}
    for a in plan.arenas:
        assert totals[a.name][2] == a.dtype
        assert totals[a.name][3].startswith(f"{a.nbytes:,} ")
    shown = {r[0]: r for r in rows}
    assert shown["total"][3].startswith(f"{plan.total_bytes:,} ")
    for name in ("h.1.lse", "grad_rows", "losses"):
        assert shown[name][2] == "float32"
    assert shown["params_bf16"][2] == "bf16" and shown["adamw.v"][2] == "float32"
    assert shown["gemm_ws"][3].startswith(f"{WORKSPACE_BYTES:,}")
    assert "training, bf16" in result.output


def test_bf16_is_refused_where_it_cannot_run(lib, tmp_path):
    from eulergen.runtime.train.trainer import Trainer
    cfg = load_config(None, ["training.dtype=bf16", f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(EulerError, match="numpy backend trains in fp32 only") as err:
        Trainer(cfg, lib, progress=False, tensorboard=False)
    assert err.value.key == "training.dtype" and "\n" not in str(err.value)
    assert not (tmp_path / "run").exists()       # refused before anything was written
    with pytest.raises(EulerError, match="training.dtype"):
        build(cfg.model, lib, 2, 8, dtype="bf16")
    turing = Backend("cuda", np, True, "Tesla T4 (sm_75)", 75)
    with pytest.raises(EulerError, match=r"compute capability 8\.0 .*Tesla T4") as err:
        bf16.plan_dtype("bf16", turing)
    assert err.value.key == "training.dtype"
    assert bf16.plan_dtype("bf16", Backend("cuda", np, True, "H200 (sm_90)", 90)) == "bf16"
    assert bf16.plan_dtype("fp32", NUMPY) == "float32"


def test_auto_is_bf16_on_a_bf16_gpu_and_fp32_elsewhere_and_the_run_records_which(lib, tmp_path):
    from eulergen.runtime.train.trainer import CONFIG_FILE, Trainer
    h200 = Backend("cuda", np, True, "H200 (sm_90)", 90)
    turing = Backend("cuda", np, True, "Tesla T4 (sm_75)", 75)
    assert [bf16.plan_dtype("auto", b) for b in (h200, turing, NUMPY)] == \
        ["bf16", "float32", "float32"]
    cfg = load_config(None, STRUCTURES["gpt2"] + COMMON + [f"run_dir={tmp_path / 'run'}"])
    assert cfg.training.dtype == "auto"
    trainer = Trainer(cfg, lib, progress=False, tensorboard=False)
    assert trainer.cfg.training.dtype == "fp32"   # what a resume reads back
    trainer.run(stop_after=1)
    saved = json.loads((tmp_path / "run" / CONFIG_FILE).read_text())
    assert saved["training"]["dtype"] == "fp32"


def test_config_takes_bf16_and_names_the_choices():
    assert load_config(None, ["training.dtype=bf16"]).training.dtype == "bf16"
    assert load_config(None, []).training.dtype == "auto"
    with pytest.raises(EulerError, match="'fp16' is not one of auto, fp32, bf16") as err:
        load_config(None, ["training.dtype=fp16"])
    assert err.value.key == "training.dtype"


def test_a_bf16_model_reads_the_bf16_copy_and_checkpoints_the_master(lib):
    cfg = _cfg("gpt2")
    model = _bf16_model(lib, cfg)
    weights = _weights(lib, cfg)
    model.load_state_dict(weights)
    copy = model.mem.arenas["params_bf16"]
    np.testing.assert_array_equal(copy, to_bf16(model.mem.arenas["params"]))
    for name, view in model.params.items():
        assert view.dtype == np.uint16 and np.shares_memory(view, copy), name
        np.testing.assert_array_equal(from_bf16(view), from_bf16(to_bf16(weights[name])))
    state = model.state_dict()
    assert all(state[k].dtype == np.float32 and np.array_equal(state[k], weights[k])
               for k in weights)
    linears = [n for n in model.tape.nodes if isinstance(n, Linear)]
    assert linears and all(np.shares_memory(n.w, copy) and n.y.dtype == np.uint16
                           for n in linears)
    assert model.mem["h.0.lse"].dtype == np.float32 and model.mem["losses"].dtype == np.float32
    assert model.mem["ones"].tolist() == [[0x3F80] * cfg.training.batch_size * cfg.training.seq_len]


def fp32_reference(lib, cfg):
    """The fp32 model's step on _weights and _batch: (weights, batch, model, its loss)."""
    t = cfg.training
    weights, (x, y) = _weights(lib, cfg), _batch(cfg)
    ref = build(cfg.model, lib, t.batch_size, t.seq_len)
    ref.load_state_dict(weights)
    ref.load_tokens(x, y)
    return weights, (x, y), ref, float(ref.loss_and_grad()[0])


@pytest.mark.parametrize("structure", sorted(STRUCTURES))
def test_bf16_loss_and_every_gradient_match_fp32_with_the_same_weights(lib, structure):
    cfg = _cfg(structure)
    weights, (x, y), ref, ref_loss = fp32_reference(lib, cfg)
    model = _bf16_model(lib, cfg)
    model.load_state_dict(weights)
    model.load_tokens(x, y)
    loss = float(model.loss_and_grad()[0])
    assert model.mem["loss"].dtype == np.float32
    assert loss == pytest.approx(ref_loss, rel=LOSS_TOLERANCE)
    logits = from_bf16(model.mem["logits"])     # dlogits now; the padded columns get none
    assert not logits[:, cfg.model.vocab_size:].any()
    errors = {}
    for name, g in ref.grads.items():
        got = from_bf16(model.grads[name])
        errors[name] = np.linalg.norm(got - g) / max(np.linalg.norm(g), 1e-30)
    bad = {k: f"{v:.2e}" for k, v in errors.items() if v > GRAD_TOLERANCE}
    assert not bad, f"bf16 gradients off: {bad}"
    assert model.grad_norm() == pytest.approx(ref.grad_norm(), rel=GRAD_TOLERANCE)


def test_the_padded_logits_are_bf16_minus_infinity(lib):
    cfg = _cfg("gpt2")
    model = _bf16_model(lib, cfg)
    model.load_state_dict(_weights(lib, cfg))
    model.load_tokens(*_batch(cfg))
    model.loss()
    padded = model.mem["logits"][:, cfg.model.vocab_size:]
    assert padded.size and np.all(padded == 0xFF80)
    assert np.isfinite(float(model.mem["loss"][0]))


def test_clipping_accumulation_and_adamw_in_bf16(lib):
    """Two micro-steps accumulate into bf16 gradients; the norm is float32; the clip scale
    reaches AdamW as its control's grad_scale, which scales the bf16 gradients as the
    update reads them; AdamW updates the float32 master from them and the copy follows."""
    cfg = _cfg("nanoeuler")
    model = _bf16_model(lib, cfg)
    model.load_state_dict(_weights(lib, cfg))
    model.set_accumulation(2)
    one = _bf16_model(lib, cfg)
    one.load_state_dict(_weights(lib, cfg))
    for m in (model, one):
        m.load_tokens(*_batch(cfg))
        m.loss_and_grad()
    model.loss_and_grad(accumulate=True)          # the same batch again: twice the half
    acc, whole = (from_bf16(m.mem.arenas["grads"]) for m in (model, one))
    # the same sums rounded at other places: within bf16's error of the whole
    assert 0 < np.linalg.norm(acc - whole) / np.linalg.norm(whole) < 1e-2
    norm = model.grad_norm()
    assert isinstance(norm, float) and norm > 0
    wide = from_bf16(model.mem.arenas["grads"]).astype(np.float64)
    assert norm == pytest.approx(np.sqrt((wide ** 2).sum()), rel=1e-5)
    before = model.mem.arenas["params"].copy()
    optim = Optimizer(model, update_ops(lib, "adamw"), cfg.training)
    scale = 0.5 / norm   # clipping to 0.5
    optim.step(np.array([{"skip": 0.0, "grad_scale": scale, "lr": 1e-3, "step": 1.0}[s]
                         for s in optim.slots]))
    # the first moment is (1 - beta1) of the gradient as the update read it: clipped
    m = model.mem["adamw.m"]
    beta1 = lib.op("adamw").params["beta1"]   # the config leaves it to the op
    assert m.dtype == np.float32
    np.testing.assert_allclose(m, (1 - beta1) * wide * scale, rtol=1e-5, atol=1e-12)
    assert np.linalg.norm(m.astype(np.float64)) / (1 - beta1) == \
        pytest.approx(0.5, rel=1e-5)
    master = model.mem.arenas["params"]
    assert master.dtype == np.float32 and not np.array_equal(master, before)
    np.testing.assert_array_equal(model.mem.arenas["params_bf16"], to_bf16(master))


def test_storage_of_a_bf16_buffer_is_uint16():
    assert storage("bf16") == np.uint16 and storage("float32") == np.float32
