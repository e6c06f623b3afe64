"""Step control (runtime/train/step_control.py): the loss sum, the spike guard, the clip scale,
the update count and the update's control slots, computed where the step runs. Its numpy
form gives the bits the trainer's host logic gave before the step moved onto the device
(kept below as the reference), and its kernels (generated/cuda/step_control.cu, from
templates/step_control.cu.j2), compiled by g++ against the CUDA emulator, give the numpy
form's bits."""
from __future__ import annotations

import ctypes
import math
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from eulergen import GENERATED_DIR
from eulergen.errors import EulerError
from eulergen.runtime.engine.manifest import load_manifest
from eulergen.runtime.train import step_control as sc
from eulergen.runtime.train.config import load_config
from eulergen.step_record import RECORD

SLOTS = ("skip", "grad_scale", "lr", "step")   # adamw's control slots


@dataclass
class HostGuard:
    """The trainer's SpikeGuard as it ran on the host (runtime/train/trainer.py before the step
    control moved onto the device): the reference."""
    factor: float
    loss_mean: float = 0.0
    norm_mean: float = 0.0
    seen: int = 0

    def check(self, loss: float, norm: float) -> str | None:
        why = None
        if self.factor > 0 and self.seen >= 10:
            if loss > self.factor * self.loss_mean:
                why = f"loss {loss:.4f} > {self.factor:g} x running mean {self.loss_mean:.4f}"
            elif norm > self.factor * self.norm_mean:
                why = f"grad norm {norm:.4f} > {self.factor:g} x running mean {self.norm_mean:.4f}"
        if self.seen == 0:
            self.loss_mean, self.norm_mean = loss, norm
        else:
            self.loss_mean = 0.95 * self.loss_mean + (1 - 0.95) * loss
            self.norm_mean = 0.95 * self.norm_mean + (1 - 0.95) * norm
        self.seen += 1
        return why


def _rule(**training) -> sc.StepRule:
    t = load_config(None, [f"training.{k}={v}" for k, v in training.items()]).training
    return sc.StepRule.of(t, SLOTS)


def _steps(n: int, seed: int = 0):
    """(micro-step float32 losses, float32 norm, lr) of n steps: noise, a few spikes of loss
    and of norm, norms above the clip of 1, and a lasting shift of the norm."""
    rng = np.random.default_rng(seed)
    out = []
    for s in range(1, n + 1):
        losses = (2.0 + 0.1 * rng.standard_normal(2)).astype(np.float32)
        norm = np.float32(0.8 + 0.5 * rng.random() + (3.0 if s > 45 else 0.0))
        if s in (15, 31):
            losses *= np.float32(20)
        if s in (22, 38):
            norm *= np.float32(40)
        out.append((losses, norm, 1e-3 * s / n))
    return out


def _arrays(control_dtype=np.float64):
    """A step record and an update control array (float64 as numpy runs, float32 as the
    GPU's kernels read it)."""
    return np.zeros(len(RECORD)), np.zeros(len(SLOTS), control_dtype)


def _numpy_step(record, control, rule, losses, norm, lr) -> None:
    record[sc.AT["lr"]] = lr
    for i, loss in enumerate(losses):
        sc.accumulate(record, np.float32([loss]), first=i == 0)
    sc.decide(record, control, np.float32([norm]), None, rule)


def test_decide_repeats_the_host_guard_clip_and_count_bit_for_bit():
    rule = _rule(gradient_accumulation=2, spike_factor=4.0, grad_clip=1.0)
    guard, updates = HostGuard(4.0), 0
    record, control = _arrays()
    kinds = set()
    for losses, norm, lr in _steps(60):
        _numpy_step(record, control, rule, losses, norm, lr)
        total = 0.0
        for loss in losses:
            total += float(loss)
        loss, host_norm = total / 2, float(norm)
        why = guard.check(loss, host_norm)
        updates += why is None
        scale = 1.0 / host_norm if host_norm > 1.0 else 1.0
        assert (record[sc.AT["loss"]], record[sc.AT["norm"]]) == (loss, host_norm)
        assert sc.why_skipped(record, 4.0) == why
        assert sc.guard_state(record) == {"loss_mean": guard.loss_mean,
                                          "norm_mean": guard.norm_mean, "seen": guard.seen}
        assert control.tolist() == [float(why is not None), scale, lr, float(updates)]
        kinds.add((why or "applied").split()[0] + (" clipped" if scale != 1.0 else ""))
    assert kinds >= {"loss", "grad clipped", "applied", "applied clipped"}, kinds


def test_the_guard_flags_a_spike_and_absorbs_a_lasting_shift():
    rule = _rule(spike_factor=4.0)
    record, control = _arrays()

    def step(loss, norm):
        _numpy_step(record, control, rule, [loss], norm, 1e-3)
        return sc.why_skipped(record, 4.0)
    for _ in range(20):
        assert step(2.0, 1.0) is None
    assert "loss" in step(50.0, 1.0)
    for _ in range(20):
        step(2.0, 1.0)
    skipped = sum(step(2.0, 10.0) is not None for _ in range(100))
    assert 0 < skipped < 100, "a lasting 10x grad norm must be skipped for a while, not forever"


def test_the_guard_is_off_at_factor_zero_and_a_skip_does_not_count_as_an_update():
    record, control = _arrays()
    off = _rule(spike_factor=0.0)
    for _ in range(20):
        _numpy_step(record, control, off, [2.0], 1.0, 1e-3)
    _numpy_step(record, control, off, [1e6], 1e6, 1e-3)
    assert sc.why_skipped(record, 0.0) is None and record[sc.AT["updates"]] == 21
    on = _rule(spike_factor=4.0)
    _numpy_step(record, control, on, [1e6], 1.0, 1e-3)
    assert control[0] == 1.0 and record[sc.AT["updates"]] == 21
    assert control[3] == 21, "the step slot keeps the count of applied updates"


@pytest.mark.parametrize("loss, norm, says", [(np.nan, 1.0, "loss is nan"),
                                              (2.0, np.inf, "gradient norm is inf")])
def test_a_loss_or_norm_that_is_not_finite_skips_and_leaves_the_guard(loss, norm, says):
    rule = _rule(spike_factor=4.0)
    record, control = _arrays()
    _numpy_step(record, control, rule, [2.0], 1.0, 1e-3)
    before = sc.guard_state(record)
    _numpy_step(record, control, rule, [loss], norm, 1e-3)
    assert sc.not_finite(record) and sc.why_skipped(record, 4.0) == says
    assert sc.guard_state(record) == before and control[0] == 1.0


def test_an_optimizer_runtime_param_the_trainer_does_not_set_is_refused():
    t = load_config(None, []).training
    with pytest.raises(EulerError, match="'momentum' is none the trainer sets"):
        sc.StepRule.of(t, ("skip", "grad_scale", "lr", "momentum"))
    assert sc.StepRule.of(t, ("skip", "grad_scale", "lr")).step_at == -1


# -- the generated kernels, compiled by g++ against the CUDA emulator -------------------------

STEP_CONTROL = load_manifest(GENERATED_DIR / "manifest.json").ops["step_control"]
SHIMS = r"""
#include "cuda_bf16.h"
using std::isfinite;
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __dsqrt_rn(double a) { return std::sqrt(a); }
#include "step_control.cu"
"""
RUNNERS = {   # call -> (the runner's parameters, the launch's arguments)
    "loss_mean": ("const float* x, float* out, long long n", "x, out, n"),
    "accumulate": ("double* rec, const float* loss, int first", "rec, loss, first"),
    "rank_loss": ("const double* rec, float* out, int micro", "rec, out, micro"),
    "decide": ("double* rec, float* control, const float* norm, const float* reduced, "
               "double factor, double decay, double warmup, double clip, int micro, int ranks, "
               "int zero, int skip_at, int scale_at, int lr_at, int step_at",
               "rec, control, norm, reduced, factor, decay, warmup, clip, micro, ranks, zero, "
               "skip_at, scale_at, lr_at, step_at"),
}


def _runner(call: str) -> str:
    """`run_<call>`: the call's kernel launched as its geometry says (one block)."""
    kernel = STEP_CONTROL.kernel(call, "f32")
    at = kernel.geometry.launch(1)
    params, args = RUNNERS[call]
    return (f'extern "C" void run_{call}({params}) {{\n'
            f"  emu_launch(dim3({at.grid[0]}), dim3({at.block[0]}), [&] "
            f"{{ {kernel.name}({args}); }});\n}}\n")


@pytest.fixture(scope="module")
def cuda(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("g++ not installed")
    folder = tmp_path_factory.mktemp("step_control")
    for name in ("eulergen_common.cuh", "step_control.cu"):
        shutil.copy(GENERATED_DIR / "cuda" / name, folder / name)
    (folder / "step.cpp").write_text(SHIMS + "".join(_runner(call) for call in RUNNERS))
    emulator = Path(__file__).resolve().parent / "cudagen_emulator"
    # no contraction into fused multiply-adds, as the kernels' __dmul_rn / __dadd_rn
    subprocess.run(["g++", "-std=c++17", "-O1", "-ffp-contract=off", "-shared", "-fPIC", "-I",
                    str(emulator), "-o", str(folder / "step.so"), str(folder / "step.cpp")],
                   check=True)
    lib = ctypes.CDLL(str(folder / "step.so"))
    D, I, P = ctypes.c_double, ctypes.c_int, ctypes.c_void_p
    lib.run_loss_mean.argtypes = (P, P, ctypes.c_longlong)
    lib.run_accumulate.argtypes = (P, P, I)
    lib.run_rank_loss.argtypes = (P, P, I)
    lib.run_decide.argtypes = (P, P, P, P, D, D, D, D, I, I, I, I, I, I, I)
    return lib


def _p(a):
    return a.ctypes.data


def _cuda_step(lib, record, control, rule, losses, norm, lr, reduced=None) -> None:
    record[sc.AT["lr"]] = lr
    for i, loss in enumerate(losses):
        lib.run_accumulate(_p(record), _p(np.float32([loss])), int(i == 0))
    norm = np.float32([norm])
    lib.run_decide(_p(record), _p(control), _p(norm), _p(norm if reduced is None else reduced),
                   rule.spike_factor, sc.SPIKE_DECAY, sc.SPIKE_WARMUP, rule.grad_clip,
                   rule.micro_steps, rule.ranks, int(rule.zero), rule.skip_at, rule.scale_at,
                   rule.lr_at, rule.step_at)


def test_the_cuda_step_kernels_give_the_numpy_forms_bits(cuda):
    rule = _rule(gradient_accumulation=2, spike_factor=4.0, grad_clip=1.0)
    (want, want_c), (got, got_c) = _arrays(np.float32), _arrays(np.float32)
    steps = _steps(60) + [(np.float32([np.nan, 2.0]), np.float32(1.0), 1e-3),
                          (np.float32([2.0, 2.0]), np.float32(np.inf), 1e-3)]
    for n, (losses, norm, lr) in enumerate(steps, start=1):
        _numpy_step(want, want_c, rule, losses, norm, lr)
        _cuda_step(cuda, got, got_c, rule, losses, norm, lr)
        np.testing.assert_array_equal(got.view(np.uint64), want.view(np.uint64),
                                      err_msg=f"step {n}")
        np.testing.assert_array_equal(got_c.view(np.uint32), want_c.view(np.uint32),
                                      err_msg=f"step {n}: control")
    # data parallel: the rank's float32 loss, and the ranks' sum divided by their count
    ranks = sc.StepRule(**{**rule.__dict__, "ranks": 3})
    mine, theirs = np.zeros(1, np.float32), np.zeros(1, np.float32)
    sc.rank_loss(want, ranks, mine)
    cuda.run_rank_loss(_p(want), _p(theirs), ranks.micro_steps)
    assert mine.tobytes() == theirs.tobytes()
    reduced = np.float32([3 * mine[0] + 0.25])
    sc.decide(want, want_c, np.float32([0.5]), reduced, ranks)
    _cuda_step(cuda, got, got_c, ranks, [], 0.5, got[sc.AT["lr"]], reduced)
    np.testing.assert_array_equal(got.view(np.uint64), want.view(np.uint64))
    np.testing.assert_array_equal(got_c.view(np.uint32), want_c.view(np.uint32))
    assert want[sc.AT["loss"]] == float(reduced[0]) / 3
    # ZeRO-1: the norm arrives as the ranks' summed squares, its root taken in float64
    zero = sc.StepRule(**{**ranks.__dict__, "zero": True})
    sumsq = np.float32([6.3])
    sc.decide(want, want_c, sumsq, reduced, zero)
    _cuda_step(cuda, got, got_c, zero, [], sumsq[0], got[sc.AT["lr"]], reduced)
    np.testing.assert_array_equal(got.view(np.uint64), want.view(np.uint64))
    np.testing.assert_array_equal(got_c.view(np.uint32), want_c.view(np.uint32))
    assert want[sc.AT["norm"]] == math.sqrt(float(sumsq[0]))
    assert want_c[zero.scale_at] == np.float32(1.0 / math.sqrt(float(sumsq[0])))   # clip 1.0


def test_the_cuda_loss_mean_sums_in_a_fixed_order(cuda):
    x = np.random.default_rng(1).standard_normal(1000).astype(np.float32) + 3
    out = np.zeros(1, np.float32)
    cuda.run_loss_mean(_p(x), _p(out), x.size)
    threads = STEP_CONTROL.kernel("loss_mean", "f32").geometry.threads
    part = [0.0] * threads
    for t in range(threads):
        for v in x[t::threads]:
            part[t] = part[t] + float(v)
    half = threads // 2
    while half:
        part[:half] = [part[t] + part[t + half] for t in range(half)]
        half //= 2
    assert out[0] == np.float32(part[0] / x.size)
    assert out[0] == pytest.approx(float(np.mean(x)), rel=1e-6)
