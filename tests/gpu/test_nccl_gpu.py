"""The NCCL path with one rank (`pytest -m gpu tests/gpu`; one GPU, NCCL_NVLS_ENABLE=0):
the communicator's all-reduce, reduce-scatter and all-gather over device buffers in one
group, collectives on a second stream that finish while the compute stream is busy,
ZeRO-1's sum of squares of a share on the device, and the trainer's data-parallel step
through NCCL (buckets overlapped with the backward, ZeRO-1, fp32 and bf16; captured in
the step's CUDA graphs and eager) against the single-process trainer."""
from __future__ import annotations


import pytest

from eulergen.runtime.distributed.collective import Rendezvous, free_port
from eulergen.runtime.train.config import load_config
from eulergen.runtime.train.trainer import Trainer
from test_ddp import max_rel   # tests/ is on the path

pytestmark = pytest.mark.gpu


@pytest.fixture
def nccl(cp):
    from eulergen.runtime.distributed.nccl import NcclCollective
    c = NcclCollective(Rendezvous(0, 1, 0, "127.0.0.1", free_port(), 60.0))
    yield c
    c.close()


def test_nccl_one_rank_reduces_scatters_and_gathers_device_buffers_in_a_group(cp, nccl):
    a = cp.arange(1024, dtype=cp.float32)
    bits = cp.arange(256, dtype=cp.uint16) + 0x3F80       # bf16 bit patterns
    loss = cp.full(1, 2.5, dtype=cp.float32)
    out = cp.zeros(512, cp.float32)
    with nccl.group():
        nccl.all_reduce_sum(a[512:])
        nccl.reduce_scatter(a[:512], out)                  # one rank: its slice is all of it
        nccl.all_reduce_sum(bits)
        nccl.all_reduce_sum(loss)
    gathered = cp.zeros(512, cp.float32)
    nccl.all_gather(out, gathered)
    nccl.settle("the test's collectives")
    assert cp.asnumpy(a).tolist() == list(range(1024))
    assert cp.asnumpy(out).tolist() == cp.asnumpy(gathered).tolist() == list(range(512))
    assert cp.asnumpy(bits).tolist() == list(range(0x3F80, 0x3F80 + 256))
    assert float(loss[0]) == 2.5
    with pytest.raises(Exception, match="contiguous float32, float64 or bf16"):
        nccl.all_reduce_sum(cp.zeros(4, cp.int32))


def test_collectives_on_a_second_stream_finish_while_the_compute_stream_is_busy(cp, nccl):
    """The overlap the buckets rely on: a collective queued behind an event on its own
    stream does not wait for compute queued after that event."""
    g = cp.ones(1 << 20, cp.float32)
    x = cp.ones((4096, 4096), cp.float32)
    comm = cp.cuda.Stream(non_blocking=True)
    ready, comm_done, compute_done = (cp.cuda.Event(disable_timing=True) for _ in range(3))
    ready.record()
    for _ in range(40):                      # ~0.1 s of GEMMs behind the event
        cp.matmul(x, x, out=x)
        x *= 1e-4
    compute_done.record()
    comm.wait_event(ready)
    with comm:
        nccl.all_reduce_sum(g)
        comm_done.record(comm)
    comm_done.synchronize()
    assert not compute_done.done, "the collective waited for the compute stream"
    compute_done.synchronize()
    assert float(g.sum()) == g.size


def _cfg(shard, run_dir, dtype, **training):
    t = dict(batch_size=4, seq_len=128, total_steps=6, warmup_steps=2, eval_every=0,
             checkpoint_every=3, log_every=1, sample_tokens=0, device="cuda", dtype=dtype)
    t.update(training)
    return load_config(None, [f"run_dir={run_dir}", f"data.dataset={shard}",
                              f"data.val_dataset={shard}", "model.vocab_size=256", "model.hidden_dim=128",
                              "model.num_layers=2", "model.num_heads=2",
                              "model.max_seq_len=128", "model.mlp_hidden=256",
                              *(f"training.{k}={v}" for k, v in t.items())])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_zero_s_sum_of_squares_of_a_share_is_the_gradients_on_the_device(libs, cp, nccl,
                                                                       dtype):
    """One rank owns every bucket's share: the norms of its spans (fp32, cuBLAS) or rows
    (bf16) and their dot (cuBLAS, into device memory) give the arena's sum of squares."""
    import numpy as np

    from eulergen.runtime.model.arch import arch_of
    from eulergen.runtime.engine.bf16 import from_bf16, to_bf16
    from eulergen.runtime.distributed.buckets import plan_buckets
    from eulergen.runtime.distributed.data_parallel import DataParallel
    from eulergen.runtime.model.gpt import build
    cfg = _cfg("unused.bin", "unused", dtype)
    t = cfg.training
    plan = plan_buckets(arch_of(cfg.model, libs[0]), 1, zero=True, bucket_mb=0.1,
                        itemsize=2 if dtype == "bf16" else 4)
    model = build(cfg.model, libs[0], t.batch_size, t.seq_len, buckets=plan,
                  dtype="bf16" if dtype == "bf16" else "float32")
    g = np.random.default_rng(0).standard_normal(plan.total).astype(np.float32)
    grads = model.mem.arenas["grads"]
    grads[...] = cp.asarray(to_bf16(g) if dtype == "bf16" else g)
    wide = (from_bf16(to_bf16(g)) if dtype == "bf16" else g).astype(np.float64)
    got = float(DataParallel(model, nccl, plan).sumsq()[0])
    assert got == pytest.approx(float(wide @ wide), rel=1e-5)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_trainer_through_nccl_matches_the_single_process_trainer(libs, shard, tmp_path,
                                                                     dtype):
    """One rank through NCCL, buckets of ~0.1 MiB issued from the backward's hook on a
    second stream: without ZeRO the same bits as no collective (a one-rank sum is the
    gradient itself); with ZeRO, whose norm sums the shares' squares, the same losses to
    float rounding (fp32: 1e-6; bf16: 1e-3, the bf16 copy rounded from the same weights).
    The step's CUDA graphs, which hold the NCCL calls, give the eager step's bits."""
    lib = libs[0]

    def run(name, collective=None, **training):
        cfg = _cfg(shard, tmp_path / name, dtype, bucket_mb=0.1, **training)
        return Trainer(cfg, lib, progress=False, tensorboard=False,
                       collective=collective).run().losses
    alone = run("alone")
    from eulergen.runtime.distributed.nccl import NcclCollective
    for zero in (0, 1):
        runs = {}
        for graph in (True, False):
            c = NcclCollective(Rendezvous(0, 1, 0, "127.0.0.1", free_port(), 60.0))
            try:
                runs[graph] = run(f"nccl-zero{zero}-graph{graph}", c, zero=zero,
                                  cuda_graph=graph)
            finally:
                c.close()
        got = runs[True]
        assert runs[False] == got
        if zero == 0:
            assert got == alone
        rel = max_rel(got, alone)
        print(f"{dtype} zero={zero}: max relative loss difference {rel:.2e}")
        assert rel < (1e-6 if dtype == "fp32" else 1e-3)
