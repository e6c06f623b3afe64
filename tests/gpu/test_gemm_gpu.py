"""cuBLASLt on the GPU (`pytest -m gpu tests/gpu/test_gemm_gpu.py`): runtime/engine/gemm.py's
LtGemm, with and without its bias epilogues, against cublasGemmEx (the path without
nvmath-python) and float64 numpy, in bf16 and fp32 (TF32 off), accumulating or not; a
model's Lt GEMMs in the planned workspace, its gradients over two micro-steps against the
cublasGemmEx model's; the calls captured in a CUDA graph and replayed. Skipped, saying why,
where the process did not choose cuBLASLt (nvmath-python missing, say).

Tolerances (∞-norm errors relative to the largest reference value): fp32 sums of K ≤ 512
products in float32 differ from float64 by ~√K·2^-24 ≈ 1e-6 of the scale: < 1e-5. bf16
results are the float32 sum rounded once, half a bf16 step (2^-9 of the value) at most:
< 2^-8; the same GEMM through two libraries rounds two float32 sums that differ by
summation order, so they agree within one step: < 2^-7. A wrong operand, transpose or
epilogue is off by order 1.
"""
from __future__ import annotations

import ctypes
import json

import numpy as np
import pytest

from eulergen.runtime.engine import gemm
from eulergen.runtime.engine.bf16 import from_bf16, to_bf16

pytestmark = pytest.mark.gpu

FP32, BF16, TWO_LIBRARIES = 1e-5, 2.0 ** -8, 2.0 ** -7
# a bf16 output that is added to (beta = 1) or written after a bias GEMM: both libraries
# were seen up to 5.3e-3 of the largest value on the H200 (cublasGemmEx's two-GEMM bias
# as far as cuBLASLt's), past one rounding's 2^-8, within two
BF16_ADDED = 2.0 ** -7
M, K, N = 512, 384, 320      # tokens, features in, features out


@pytest.fixture(scope="module")
def lt(cp):
    choice = gemm._cuda_choice()
    if choice.lt is None:
        pytest.skip(f"cuBLASLt is not this process's GEMM: {choice.why}")
    return choice.lt


def _wide(cp, a):
    a = cp.asnumpy(a)
    return (from_bf16(a) if a.dtype == np.uint16 else a).astype(np.float64)


def _dev(cp, host, dtype):
    return cp.asarray(to_bf16(host) if dtype == "bf16" else host.astype(np.float32))


def _err(cp, got, want) -> float:
    return float(np.abs(_wide(cp, got) - want).max() / max(np.abs(want).max(), 1e-30))


def _cublas(cp):
    return gemm.CublasGemm.for_cupy(tf32=False)


def _host(rng, *shapes):
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


# y = x·wᵀ (w the first K columns of a wider array: a leading dimension past its width),
# dx = dy·w, dw = dyᵀ·x
CASES = {"forward": ((M, K), (N, K + 64), dict(tb=True)),
         "dgrad": ((M, N), (N, K), {}),
         "wgrad": ((M, N), (M, K), dict(ta=True))}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("add", [False, True])
def test_lt_gemms_match_cublas_and_numpy(cp, lt, dtype, case, add):
    rng = np.random.default_rng(0)
    a_shape, b_shape, flags = CASES[case]
    a, b = (_dev(cp, h, dtype) for h in _host(rng, a_shape, b_shape))
    if case == "forward":
        b = b[:, :K]
    wa, wb = _wide(cp, a), _wide(cp, b)
    want = (wa.T if flags.get("ta") else wa) @ (wb.T if flags.get("tb") else wb)
    start = _dev(cp, rng.standard_normal(want.shape), dtype)
    if add:
        want = want + _wide(cp, start)
    got, ref = start.copy(), start.copy()
    gemm.LtGemm(lt, tf32=False)(a, b, got, add=add, **flags)
    _cublas(cp)(a, b, ref, add=add, **flags)
    tol = (BF16_ADDED if add else BF16) if dtype == "bf16" else FP32
    assert _err(cp, got, want) < tol and _err(cp, ref, want) < tol
    assert _err(cp, got, _wide(cp, ref)) < (TWO_LIBRARIES if dtype == "bf16" else FP32)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_bias_epilogue_matches_the_two_gemm_bias(cp, lt, dtype):
    """y = x·wᵀ + b in one GEMM, against cublasGemmEx's 1·b then the product added by beta = 1."""
    rng = np.random.default_rng(1)
    x, w, b = (_dev(cp, h, dtype) for h in _host(rng, (M, K), (N, K), (N,)))
    want = _wide(cp, x) @ _wide(cp, w).T + _wide(cp, b)[None, :]
    got = _dev(cp, np.full((M, N), 7.0), dtype)
    gemm.LtGemm(lt, tf32=False)(x, w, got, tb=True, bias=b)
    ref, ones = cp.zeros_like(got), _dev(cp, np.ones((1, M)), dtype)
    _cublas(cp)(ones, b.reshape(1, -1), ref, ta=True)
    _cublas(cp)(x, w, ref, tb=True, add=True)
    tol = BF16_ADDED if dtype == "bf16" else FP32
    assert _err(cp, got, want) < tol and _err(cp, ref, want) < tol
    assert _err(cp, got, _wide(cp, ref)) < (TWO_LIBRARIES if dtype == "bf16" else FP32)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("add", [False, True])
def test_the_bias_gradient_epilogue_writes_1t_dy_beside_dw(cp, lt, dtype, add):
    """dw (+)= dyᵀ·x with db = 1ᵀ·dy written (never added to: the tape adds through the
    ones GEMM instead), against cublasGemmEx's dw GEMM and 1ᵀ·dy GEMM."""
    rng = np.random.default_rng(2)
    dy, x = (_dev(cp, h, dtype) for h in _host(rng, (M, N), (M, K)))
    start = _dev(cp, rng.standard_normal((N, K)), dtype)
    want_dw = _wide(cp, dy).T @ _wide(cp, x) + (_wide(cp, start) if add else 0)
    want_db = _wide(cp, dy).sum(axis=0)
    dw, db = start.copy(), _dev(cp, np.full(N, 7.0), dtype)
    gemm.LtGemm(lt, tf32=False)(dy, x, dw, ta=True, add=add, dbias=db)
    ref_dw, ref_db, ones = start.copy(), cp.zeros_like(db), _dev(cp, np.ones((1, M)), dtype)
    _cublas(cp)(dy, x, ref_dw, ta=True, add=add)
    _cublas(cp)(ones, dy, ref_db.reshape(1, -1))
    tol = (BF16_ADDED if add else BF16) if dtype == "bf16" else FP32
    for got, ref, want in ((dw, ref_dw, want_dw), (db, ref_db, want_db)):
        assert _err(cp, got, want) < tol and _err(cp, ref, want) < tol
        assert _err(cp, got, _wide(cp, ref)) < (TWO_LIBRARIES if dtype == "bf16" else FP32)


def test_lt_calls_captured_in_a_cuda_graph_replay_their_eager_results(cp, lt):
    """Once planned (the first call), a call only launches on the current stream: it can be
    captured, and allocates nothing."""
    rng = np.random.default_rng(3)
    x, w, b, dy = (_dev(cp, h, "bf16") for h in _host(rng, (M, K), (N, K), (N,), (M, N)))
    workspace = cp.zeros(gemm.WORKSPACE_BYTES, cp.uint8)
    lt_gemm = gemm.LtGemm(lt, tf32=False, workspace=workspace)
    outs = {k: (cp.zeros(s, cp.uint16), cp.zeros(s, cp.uint16))
            for k, s in (("y", (M, N)), ("dw", (N, K)), ("db", (N,)))}

    def step(i):
        lt_gemm(x, w, outs["y"][i], tb=True, bias=b)
        lt_gemm(dy, x, outs["dw"][i], ta=True, dbias=outs["db"][i])

    stream = cp.cuda.Stream(non_blocking=True)
    pool = cp.get_default_memory_pool()
    with stream:
        step(0)
        stream.synchronize()
        used = pool.used_bytes()
        stream.begin_capture()
        step(1)
        graph = stream.end_capture()
        graph.launch()
        stream.synchronize()
    assert pool.used_bytes() == used
    for name, (eager, replayed) in outs.items():
        np.testing.assert_array_equal(cp.asnumpy(replayed), cp.asnumpy(eager), err_msg=name)


def test_a_model_runs_lt_in_its_planned_workspace_and_accumulates_as_cublas(libs, cp, lt):
    """A bf16 GPT (biases: gpt2) over two micro-steps: the Lt tape's gradients (epilogues
    on the first micro-step, 1ᵀ·dy added on the second) against the same model's with
    cublasGemmEx. Both round the same float32 sums once per GEMM, so they differ only by
    summation order: per parameter ‖Δg‖ / ‖g‖ < 1e-2, where a dropped or doubled bias
    gradient is off by order 1."""
    from test_model_gpu import _batch, _cfg   # noqa: E402  (tests/gpu is on the path)

    from eulergen.runtime.model.gpt import build
    cuda, _ = libs
    cfg = _cfg("gpt2")
    t = cfg.training
    x, y = _batch(cfg)
    grads = []
    for library in ("lt", "cublas"):
        model = build(cfg.model, cuda, 1, t.seq_len, dtype="bf16")
        model.init_weights(1)
        if library == "lt":
            ws = model.mem["gemm_ws"]
            assert model.tape.epilogues and ws.nbytes == gemm.WORKSPACE_BYTES
            assert model.tape.gemm.workspace == ws.data.ptr
        else:
            model.tape.gemm, model.tape.epilogues = _cublas(cp), False
        model.set_accumulation(2)
        for row in range(2):
            model.load_tokens(x[row:row + 1], y[row:row + 1])
            model.loss_and_grad(accumulate=row > 0)
        grads.append({k: _wide(cp, g) for k, g in model.grads.items()})
    errors = {k: np.linalg.norm(grads[0][k] - g) / max(np.linalg.norm(g), 1e-30)
              for k, g in grads[1].items()}
    bad = {k: f"{v:.2e}" for k, v in errors.items() if v > 1e-2}
    assert not bad, f"Lt gradients off the cublasGemmEx ones: {bad}"


@pytest.mark.parametrize("add", [False, True])
def test_a_searched_gemm_is_right_recorded_and_run_again_by_a_later_process(cp, lt, tmp_path,
                                                                            add):
    """EULERGEN_GEMM_SEARCH: the first call times the heuristic's candidates (into the output,
    or outside it when the call adds to it: the sum must still be start + product), records
    the pick, and a context that reads the record (a later process) runs the same algorithm
    without timing, to the same bits, as does the pick called again."""
    from eulergen.runtime.engine import gemm_search
    rng = np.random.default_rng(4)
    dy, x = (_dev(cp, h, "bf16") for h in _host(rng, (2048, 768), (2048, 2304)))
    start = _dev(cp, rng.standard_normal((768, 2304)), "bf16")
    want = _wide(cp, dy).T @ _wide(cp, x) + (_wide(cp, start) if add else 0)
    path = tmp_path / "gemm.json"
    outs, algos = [], []
    for process in range(2):
        ctx = gemm.open_lt(cp)
        ctx.search = gemm_search.Search(gemm_search.Record(path))
        if process:
            ctx.search.pick = _no_timing(ctx.search.pick)
        workspace = cp.zeros(gemm.WORKSPACE_BYTES, cp.uint8)
        run = gemm.LtGemm(ctx, tf32=False, workspace=workspace)
        for _ in range(2):
            out = start.copy()
            run(dy, x, out, ta=True, add=add)
            outs.append(cp.asnumpy(out))
        (plan,) = ctx.plans.values()
        algos.append(ctypes.string_at(plan.algo, ctx.lt.matmul_algo_dtype.itemsize))
    assert _err(cp, cp.asarray(outs[0]), want) < (BF16_ADDED if add else BF16)
    for other in outs[1:]:
        np.testing.assert_array_equal(other, outs[0])
    assert algos[0] == algos[1]
    (entry,) = json.loads(path.read_text())["algorithms"].values()
    assert bytes.fromhex(entry["algo"]) == algos[0]
    assert len(entry["us"]) > 1 and entry["us"][0] is not None


def _no_timing(pick):
    def untimed(key, algos, timer):
        return pick(key, algos, lambda i: pytest.fail("a recorded GEMM was timed again"))
    return untimed
