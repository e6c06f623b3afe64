"""The embedding op on the GPU as the model calls it: forward, and the backward that sorts
the ids on the device, sums each id's rows in token order and adds (or writes) the table's
gradient. What is checked: the bits equal numpy's np.add.at (float32) and repeat run to
run with many repeated ids; no host synchronisation and no allocation inside a call; an
id outside the table fails the launch. Run on the H200: `pytest -m gpu
tests/gpu/test_embedding.py`.
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from eulergen.runtime.engine.bf16 import from_bf16, to_bf16

pytestmark = pytest.mark.gpu

B, T, V, C = 8, 1024, 50304, 768


def _ids(rng, kind: str) -> np.ndarray:
    """int32 [B, T]: uniform over the vocab, Zipf-like (a few ids own most tokens), or one
    run of a single id over three quarters of the batch."""
    if kind == "uniform":
        return rng.integers(0, V, (B, T)).astype(np.int32)
    if kind == "zipf":
        return np.minimum(rng.zipf(1.2, (B, T)) - 1, V - 1).astype(np.int32)
    ids = rng.integers(0, V, (B, T)).astype(np.int32)
    ids.reshape(-1)[: 3 * B * T // 4] = 11
    return ids


def _store(cp, x: np.ndarray, dtype: str):
    x = x.astype(np.float32)
    return cp.asarray(to_bf16(x) if dtype == "bf16" else x)


def _host(cp, a, dtype: str) -> np.ndarray:
    h = cp.asnumpy(a)
    return from_bf16(h) if dtype == "bf16" else h


def _case(cp, gpu, rng, kind: str):
    """ids, wte, wpe, dout (float32 host arrays) and a workspace for the backward's keys."""
    ids = _ids(rng, kind)
    wte = rng.standard_normal((V, C)).astype(np.float32)
    wpe = rng.standard_normal((T, C)).astype(np.float32)
    dout = rng.standard_normal((B, T, C)).astype(np.float32)
    ws = cp.empty(_workspace(gpu, ids.shape), cp.float32)
    return ids, wte, wpe, dout, ws


def _workspace(gpu, shape) -> int:
    from eulergen.runtime.engine.cuda_ops import workspace_elements
    return workspace_elements(gpu.op("embedding"), "backward", shape, table_rows=V)


@pytest.mark.parametrize("kind", ["uniform", "zipf", "one_long_run"])
def test_f32_backward_is_np_add_at_bit_for_bit(cp, libs, kind):
    """Accumulating onto a non-zero table gradient (the tied LM head's), each id's rows are
    added in token order: the float32 result is exactly numpy's np.add.at, which the CPU
    backend runs, so the two backends agree to the bit."""
    gpu, ref = libs
    rng = np.random.default_rng(1)
    ids, wte, wpe, dout, ws = _case(cp, gpu, rng, kind)
    head = rng.standard_normal((V, C)).astype(np.float32)
    dwte, dwpe = cp.asarray(head), cp.asarray(wpe)          # added to: both non-zero
    gpu.backward("embedding", cp.asarray(ids), cp.asarray(wte), cp.asarray(wpe),
                 cp.asarray(dout), out=(dwte, dwpe), accumulate=(True, False), workspace=ws)
    want_wte, want_wpe = head.copy(), wpe.copy()
    ref.backward("embedding", ids, wte, wpe, dout, out=(want_wte, want_wpe),
                 accumulate=(True, False))
    got = cp.asnumpy(dwte)
    assert (got.view(np.uint32) == want_wte.view(np.uint32)).all(), (
        f"dwte differs from np.add.at in {int((got != want_wte).sum())} elements")
    np.testing.assert_allclose(cp.asnumpy(dwpe), want_wpe, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("kind", ["zipf", "one_long_run"])
def test_backward_gives_the_same_bits_twice_with_many_repeated_ids(cp, libs, kind, dtype):
    gpu, ref = libs
    rng = np.random.default_rng(2)
    ids, wte, wpe, dout, ws = _case(cp, gpu, rng, kind)
    args = [cp.asarray(ids), _store(cp, wte, dtype), _store(cp, wpe, dtype),
            _store(cp, dout, dtype)]
    runs = []
    for _ in range(2):
        out = (cp.full_like(args[1], 7), cp.full_like(args[2], 7))   # overwritten
        gpu.backward("embedding", *args, out=out, workspace=ws)
        runs.append([cp.asnumpy(g) for g in out])
    for a, b in zip(*runs):
        assert a.tobytes() == b.tobytes(), "two runs of the embedding backward differ"
    host = [_host(cp, a, dtype).astype(np.float64) for a in args[1:]]
    want = ref.backward("embedding", ids, *host)
    # float32 sums of up to 6144 rows in order; bf16 adds one rounding of the result
    tol = 1e-4 if dtype == "f32" else 2.0 ** -7
    for got, w in zip(runs[0], want):
        got = from_bf16(got) if dtype == "bf16" else got
        scale = np.abs(w).max()
        assert np.abs(got - w).max() <= tol * scale, f"{kind} {dtype}: off numpy"


def test_a_call_neither_waits_for_the_gpu_nor_allocates(cp, libs):
    """While a kernel that spins for ~0.2 s holds the stream, forward and backward return
    to the host with the stream still busy (no device-to-host read of the ids or of a
    segment count), and with out= and workspace= nothing is taken from the pool."""
    from cupy.cuda.memory_hook import MemoryHook
    gpu, _ = libs
    rng = np.random.default_rng(3)
    ids, wte, wpe, dout, ws = _case(cp, gpu, rng, "zipf")
    args = [cp.asarray(a) for a in (ids, wte, wpe, dout)]
    out, grads = cp.empty((B, T, C), cp.float32), (cp.empty_like(args[1]), cp.empty_like(args[2]))

    def step():
        gpu.forward("embedding", *args[:3], out=out)
        gpu.backward("embedding", *args, out=grads, accumulate=(True, False), workspace=ws)

    step()                                   # compiles and loads the kernels
    spin = cp.RawKernel(r'''extern "C" __global__ void spin(long long cycles) {
      const long long t0 = clock64(); while (clock64() - t0 < cycles) {} }''', "spin")
    stream = cp.cuda.get_current_stream()
    stream.synchronize()

    class Mallocs(MemoryHook):
        name = "embedding_mallocs"

        def __init__(self):
            self.count = 0

        def malloc_postprocess(self, **kw):
            self.count += 1

    hook = Mallocs()
    spin((1,), (1,), (np.int64(400_000_000),))
    with hook:
        step()
    busy = not stream.done
    stream.synchronize()
    assert busy, "the host waited for the GPU inside an embedding call"
    assert hook.count == 0, f"an embedding call took {hook.count} allocations from the pool"


def test_an_id_outside_the_table_fails_the_launch(cp, tmp_path):
    """The range check is the kernels' (a host check would sync every call): the process
    that launched with id = V gets a CUDA error, after the kernel printed where it was."""
    script = tmp_path / "bad_id.py"
    script.write_text(
        "import cupy as cp, numpy as np\n"
        "from eulergen.runtime.engine.backend import get_backend\n"
        "from eulergen.runtime.engine.ops import OpLibrary\n"
        "lib = OpLibrary(get_backend('cuda'))\n"
        "wte = cp.zeros((10, 8), cp.float32)\n"
        "lib.forward('embedding', cp.asarray(np.int32([[1, 10, 2]])), wte, None)\n"
        "cp.cuda.get_current_stream().synchronize()\n"
        "print('no error')\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode != 0 and "no error" not in done.stdout, done.stdout + done.stderr
    print(done.stdout[-500:], done.stderr[-500:])
