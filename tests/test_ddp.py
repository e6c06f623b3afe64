"""Data-parallel training on numpy (runtime/distributed/collective.py, the DataLoader's rank slices,
the Stepper's gradient buckets, `eulergen train --nproc`): the CPU collective's reductions in
rank order, its one-line errors, disjoint shards, and N ranks x B matching 1 x N·B."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from eulergen.errors import EulerError
from eulergen.runtime.engine.backend import NUMPY
from eulergen.runtime.distributed.collective import CpuCollective, Rendezvous, free_port, select_gpu
from eulergen.runtime.train.config import load_config
from eulergen.runtime.data.loader import DataLoader
from eulergen.runtime.distributed.nccl import NcclCollective
from eulergen.runtime.engine.ops import OpLibrary
from eulergen.runtime.train.trainer import Trainer
from runs import losses

ROOT = Path(__file__).resolve().parents[1]


def _on_ranks(n, body, timeout=10.0, port=None):
    """body(collective) on n ranks (threads, one TCP hub): each rank's result or error."""
    port = port or free_port()
    out = [None] * n

    def rank(r):
        try:
            c = CpuCollective(Rendezvous(r, n, r, "127.0.0.1", port, timeout))
            try:
                out[r] = body(c)
            finally:
                c.close()
        except Exception as err:   # noqa: BLE001 - the caller asserts on it
            out[r] = err
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


# -- the collective -----------------------------------------------------------------------

def test_all_reduce_sums_in_rank_order_the_same_bits_on_every_rank():
    data = [np.random.default_rng(r).standard_normal(1000).astype(np.float32) for r in range(3)]

    def body(c):
        a = data[c.rank].copy()
        c.all_reduce_sum(a)
        return a
    got = _on_ranks(3, body)
    expect = (data[0] + data[1]) + data[2]
    for a in got:
        assert a.tobytes() == expect.tobytes()


def test_reduce_scatter_all_gather_and_broadcast():
    def body(c):
        a = np.arange(6, dtype=np.float32) * (c.rank + 1)
        shard = np.empty(3, np.float32)
        c.reduce_scatter(a, shard)
        full = np.empty(6, np.float32)
        c.all_gather(shard, full)
        b = np.full(4, c.rank, np.float32)
        c.broadcast(b)
        c.barrier()
        return shard, full, b
    (s0, f0, b0), (s1, f1, b1) = _on_ranks(2, body)
    assert s0.tolist() == [0, 3, 6] and s1.tolist() == [9, 12, 15]
    assert f0.tolist() == f1.tolist() == [0, 3, 6, 9, 12, 15]
    assert b0.tolist() == b1.tolist() == [0] * 4


def test_a_group_is_one_exchange_whose_results_arrive_when_it_ends(monkeypatch):
    exchanges = []
    real = CpuCollective._exchange

    def counted(self, payload, what, answer):
        exchanges.append((self.rank, what))
        return real(self, payload, what, answer)
    monkeypatch.setattr(CpuCollective, "_exchange", counted)

    def body(c):
        g = np.arange(8, dtype=np.float32) + c.rank
        loss = np.array([c.rank + 1.0], np.float32)
        with c.group():
            c.reduce_scatter(g[:4], g[2 * c.rank:2 * c.rank + 2])   # in place, the rank's half
            c.all_reduce_sum(g[4:])
            c.all_reduce_sum(loss)
            inside = loss.copy()
        return g, loss, inside
    (g0, l0, in0), (g1, l1, in1) = _on_ranks(2, body)
    assert sorted(exchanges) == [(0, "reduce_scatter + all_reduce_sum"),
                                 (1, "reduce_scatter + all_reduce_sum")]
    assert in0.tolist() == [1.0] and l0.tolist() == l1.tolist() == [3.0]
    assert g0[:2].tolist() == [1, 3] and g1[2:4].tolist() == [5, 7]
    assert g0[4:].tolist() == g1[4:].tolist() == [9, 11, 13, 15]


def test_gather_bytes_brings_every_rank_s_bytes_to_rank_0():
    got = _on_ranks(3, lambda c: c.gather_bytes(bytes([c.rank]) * (c.rank + 1)))
    assert got == [[b"\x00", b"\x01\x01", b"\x02\x02\x02"], None, None]


def test_check_peers_names_a_rank_that_left_without_waiting():
    port, checked, left, out = free_port(), threading.Event(), threading.Event(), {}

    def rank0():
        c = CpuCollective(Rendezvous(0, 2, 0, "127.0.0.1", port, 5.0))
        c.check_peers("the gradients' reduction")   # rank 1 is there: nothing to say
        checked.set()
        left.wait()
        time.sleep(0.05)
        out[0] = pytest.raises(EulerError, c.check_peers, "the gradients' reduction").value

    def rank1():
        c = CpuCollective(Rendezvous(1, 2, 1, "127.0.0.1", port, 5.0))
        checked.wait()
        c.close()   # as a killed process's sockets close
        left.set()
    threads = [threading.Thread(target=f) for f in (rank0, rank1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert str(out[0]) == ("collective: rank 0: rank 1 left (connection closed) during the "
                           "gradients' reduction")


def test_settle_aborts_nccl_and_names_the_rank_that_left():
    """NCCL would wait forever for a dead rank: NcclCollective.settle watches the store's
    connections while the device's event is not done (CuPy and NCCL stand-ins here)."""
    port, aborted, out = free_port(), [], {}

    class Event:
        def __init__(self, **kwargs):
            pass

        def record(self, stream=None):
            pass
        done = False   # a collective waiting for the dead rank
    nccl = NcclCollective.__new__(NcclCollective)
    nccl._cupy = type("cupy", (), {"cuda": type("cuda", (), {"Event": Event})})
    nccl.comm = type("comm", (), {"abort": lambda self: aborted.append(True)})()
    nccl.timeout = 30.0

    def rank0():
        nccl.store = CpuCollective(Rendezvous(0, 2, 0, "127.0.0.1", port, 30.0))
        started = time.monotonic()
        out[0] = pytest.raises(EulerError, nccl.settle, "the gradients' reduction").value
        out["seconds"] = time.monotonic() - started
    t = threading.Thread(target=rank0)
    t.start()
    CpuCollective(Rendezvous(1, 2, 1, "127.0.0.1", port, 30.0)).close()
    t.join()
    assert "rank 0: rank 1 left (connection closed) during the gradients' reduction" in str(out[0])
    assert aborted == [True] and out["seconds"] < 2


def test_a_rank_that_does_not_arrive_is_named_within_the_timeout():
    def body(c):
        if c.rank == 2:
            return None   # leaves without reducing: the hub sees its connection close
        a = np.ones(4, np.float32)
        c.all_reduce_sum(a)
    started = time.monotonic()
    out = _on_ranks(3, body, timeout=2.0)
    assert time.monotonic() - started < 5
    for r in (0, 1):
        assert isinstance(out[r], EulerError) and "rank 2 left" in str(out[r]), out[r]


def test_a_rank_that_never_starts_times_out_naming_it():
    port = free_port()
    out = []
    t = threading.Thread(target=lambda: out.append(pytest.raises(
        EulerError, CpuCollective, Rendezvous(0, 2, 0, "127.0.0.1", port, 0.5))))
    t.start()
    t.join()
    assert "rank 1 did not arrive at the rendezvous within 0.5s" in str(out[0].value)


def test_more_ranks_on_a_node_than_gpus_is_one_line(monkeypatch):
    class Runtime:
        @staticmethod
        def getDeviceCount():
            return 2
    fake = type(sys)("cupy")
    fake.cuda = type("cuda", (), {"runtime": Runtime})
    monkeypatch.setitem(sys.modules, "cupy", fake)
    with pytest.raises(EulerError, match="WORLD_SIZE: LOCAL_RANK 2 needs GPU 2, but 2 are visible"):
        select_gpu(Rendezvous(2, 3, 2, "127.0.0.1", 1))


def test_nproc_larger_than_the_gpus_is_one_line_before_any_rank_starts(monkeypatch):
    from eulergen.runtime.engine import backend
    from eulergen.runtime.distributed import workers
    gpus = type("xp", (), {"cuda": type("cuda", (), {"runtime": type("rt", (), {
        "getDeviceCount": staticmethod(lambda: 1)})})})
    monkeypatch.setattr(backend, "get_backend", lambda device, notice=None: type(
        "Backend", (), {"is_gpu": True, "xp": gpus})())
    with pytest.raises(EulerError, match="--nproc: 2 ranks, one per GPU, but 1 GPUs are visible"):
        workers.check_ranks(2, "cuda")


def test_the_nccl_collective_offers_the_cpu_one_s_interface():
    public = {n for n in vars(CpuCollective) if not n.startswith("_")}
    assert public <= {n for n in vars(NcclCollective) if not n.startswith("_")}


def test_a_busy_master_port_is_one_line():
    with __import__("socket").socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(EulerError, match=f"MASTER_PORT: {port} is busy"):
            CpuCollective(Rendezvous(0, 2, 0, "127.0.0.1", port, 1.0))


def test_rendezvous_reads_torchrun_and_slurm_variables():
    torchrun = Rendezvous.from_env({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                                    "MASTER_ADDR": "node0", "MASTER_PORT": "29500"})
    assert (torchrun.rank, torchrun.world_size, torchrun.master_addr) == (1, 4, "node0")
    slurm = Rendezvous.from_env({"SLURM_PROCID": "3", "SLURM_NTASKS": "8",
                                 "SLURM_LOCALID": "3", "MASTER_PORT": "29500"})
    assert (slurm.rank, slurm.world_size, slurm.local_rank) == (3, 8, 3)
    assert Rendezvous.from_env({}) is None
    with pytest.raises(EulerError, match="MASTER_PORT is not set"):
        Rendezvous.from_env({"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(EulerError, match="RANK: 2 is outside 0..1"):
        Rendezvous.from_env({"RANK": "2", "WORLD_SIZE": "2", "MASTER_PORT": "1"})


# -- data ---------------------------------------------------------------------------------

def test_rank_slices_are_disjoint_and_together_the_global_batch(shard):
    whole = DataLoader(str(shard), 8, 16, seed=3)
    ranks = [DataLoader(str(shard), 4, 16, seed=3, rank=r, world_size=2) for r in range(2)]
    for _ in range(5):
        x, _ = whole.next_batch()
        parts = [loader.next_batch()[0] for loader in ranks]
        assert np.array_equal(np.concatenate(parts), x)
    assert ranks[0].state() == ranks[1].state() == {**whole.state(), "world_size": 2}
    # the global position: one process of 2 x B continues the two ranks' stream
    again = DataLoader(str(shard), 8, 16, seed=3, position=ranks[0].state())
    assert np.array_equal(again.next_batch()[0], whole.next_batch()[0])
    with pytest.raises(EulerError, match="global batches of 8 rows .* this run's are 1 x 4"):
        DataLoader(str(shard), 4, 16, seed=3).restore(ranks[0].state())


# -- training -----------------------------------------------------------------------------

def _cfg(shard, run_dir, batch, **training):
    t = dict(batch_size=batch, seq_len=32, total_steps=6, warmup_steps=2, learning_rate=3e-3,
             eval_every=0, checkpoint_every=3, log_every=1, sample_tokens=0)
    t.update(training)
    return [f"run_dir={run_dir}", f"data.dataset={shard}", f"data.val_dataset={shard}",
            "model.hidden_dim=32",
            "model.num_layers=2", "model.num_heads=2", "model.max_seq_len=32",
            "model.mlp_hidden=64", *(f"training.{k}={v}" for k, v in t.items())]


def _train(shard, run_dir, batch, collective=None, resume=False, **training):
    cfg = load_config(None, _cfg(shard, run_dir, batch, **training))
    trainer = Trainer(cfg, OpLibrary(NUMPY), progress=False, tensorboard=False,
                      collective=collective, resume=resume)
    return trainer.run().losses


def _two_ranks(shard, run_dir, **training):
    out = _on_ranks(2, lambda c: _train(shard, run_dir, 4, c, **training), timeout=60)
    assert not any(isinstance(o, Exception) for o in out), out
    assert out[0] == out[1]   # the averaged loss: the same bits on both ranks
    return out[0]


def max_rel(got: dict, want: dict) -> float:
    """The largest relative difference of two runs' losses, step for step."""
    assert got.keys() == want.keys()
    return max(abs(got[k] - want[k]) / abs(want[k]) for k in want)


def test_two_ranks_of_b_match_one_process_of_2b_and_repeat_bitwise(shard, tmp_path):
    one = _train(shard, tmp_path / "one", 8)
    two = _two_ranks(shard, tmp_path / "two")
    # the all-reduce sums two half-batch means where one process sums the whole batch:
    # the same terms in another order: ~1e-7 relative seen over six steps, not the same bits
    rel = max_rel(two, one)
    print(f"max relative loss difference, 2 x 4 against 1 x 8: {rel:.2e}")
    assert rel < 1e-6
    assert _two_ranks(shard, tmp_path / "again") == two
    files = {p.name for p in (tmp_path / "two").iterdir()}
    assert {"metrics.jsonl", "ckpt_00000003", "ckpt_00000006"} <= files, files
    state = json.loads((tmp_path / "two" / "ckpt_00000006" / "state.json").read_text())
    assert state["data"]["world_size"] == 2   # the global position, from which each rank's follows


def test_ranks_with_different_configs_stop_before_training(shard, tmp_path):
    out = _on_ranks(2, lambda c: _train(shard, tmp_path / "r", 4, c, seed=c.rank), timeout=20)
    assert all(isinstance(o, EulerError) for o in out), out
    for err in out:
        assert "rank 1's config differs from rank 0's at training.seed: 1 (rank 0: 0)" in str(err)
    assert not (tmp_path / "r").exists()


# -- processes: `train --nproc`, torchrun's variables, a killed rank ----------------------

CLI = [sys.executable, "-m", "eulergen", "train", "--device", "numpy"]


def _sets(shard, run_dir, batch, **training):
    return [a for s in _cfg(shard, run_dir, batch, **training) for a in ("--set", s)]


def _env(**extra):
    # the tree under test first, then what the caller put on the path (a worktree's link)
    path = os.pathsep.join(p for p in (str(ROOT.parent), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def _nproc_2(*args):
    run = subprocess.run([*CLI, "--nproc", "2", *args], env=_env(), capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return run


def test_train_nproc_2_matches_the_in_process_ranks(shard, tmp_path):
    run = _nproc_2(*_sets(shard, tmp_path / "cli", 4))
    assert "2 ranks x B=4" in run.stderr and run.stderr.count("eulergen train:") == 1
    assert "each wait at most 300 s (EULERGEN_COLLECTIVE_TIMEOUT)" in run.stderr.splitlines()[0]
    cli, threads = losses(tmp_path / "cli"), _two_ranks(shard, tmp_path / "threads")
    # not bits: the CLI's workers run OpenBLAS on one thread (cli/common.py), pytest may not
    assert cli.keys() == threads.keys()
    assert all(abs(cli[k] - threads[k]) <= 1e-6 * threads[k] for k in cli), (cli, threads)


def _ranks_until(run, ckpt: str, *args, env=()):
    """Two ranks under torchrun's variables, started; returns them once `ckpt` is saved."""
    port = str(free_port())
    procs = [subprocess.Popen([*CLI, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, env=_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2",
                                                  MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                                                  EULERGEN_COLLECTIVE_TIMEOUT="20", **dict(env)))
             for r in range(2)]
    deadline = time.time() + 60
    while not (run / ckpt).is_dir() and time.time() < deadline:
        time.sleep(0.02)
    assert (run / ckpt).is_dir() and all(p.poll() is None for p in procs)
    return procs


def test_killed_ranks_stop_the_other_naming_them_and_resume_continues_the_run(shard, tmp_path):
    """kill -9 of rank 1, resume; kill -9 of rank 0 (the hub, the writer), resume: the run's
    losses are the uninterrupted run's, bit for bit, with ZeRO's shares to gather."""
    steps = dict(total_steps=16, checkpoint_every=2, zero=1, bucket_mb=0.01)
    _nproc_2(*_sets(shard, tmp_path / "straight", 4, **steps))
    run = tmp_path / "killed"
    for victim, ckpt, args in ((1, "ckpt_00000002", _sets(shard, run, 4, **steps)),
                               (0, "ckpt_00000006", ["--resume", str(run)])):
        procs = _ranks_until(run, ckpt, *args)
        os.kill(procs[victim].pid, signal.SIGKILL)
        procs[victim].wait()
        other = procs[1 - victim]
        _, err = other.communicate(timeout=30)   # well inside the collective's timeout
        assert other.returncode == 2, err   # the CLI's status for an EulerError
        assert f"rank {1 - victim}: rank {victim} left (connection closed) during" \
            in err.splitlines()[-1], err
    _nproc_2("--resume", str(run))
    assert losses(run) == losses(tmp_path / "straight")


def test_nproc_under_a_launcher_is_one_line(shard, tmp_path):
    env = _env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_PORT=str(free_port()))
    run = subprocess.run([*CLI, "--nproc", "2", *_sets(shard, tmp_path / "a", 4)], env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "leave --nproc out" in run.stderr, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr
