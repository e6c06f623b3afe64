"""The GPU collective: NCCL through cupy.cuda.nccl (the nvidia-nccl wheel), over CuPy
arrays on the current stream, with the CPU collective (runtime/distributed/collective.py) as its store
and its watch over the other ranks."""
from __future__ import annotations

import os
import time
from contextlib import contextmanager

import numpy as np

from eulergen.errors import EulerError
from eulergen.runtime.distributed.collective import CpuCollective, Rendezvous, select_gpu

# What every process that may run NCCL has in its environment before NCCL initialises:
# NVLink multicast off. Launchers put it in their ranks' environments; a rank started by
# torchrun or srun sets it itself.
ENV = {"NCCL_NVLS_ENABLE": "0"}


class NcclCollective:
    """The GPU path: one NCCL communicator over CuPy arrays, on the current stream; the
    unique id travels through a CpuCollective (the same rendezvous), which also carries
    barrier, config checks, gathers to rank 0 (checkpoints) and the watch over the other
    ranks while the device runs collectives (`settle`). Device = LOCAL_RANK."""

    # ncclDataType_t: float32, float64, and bf16 for the uint16 arrays that hold its bits
    DTYPES = {np.dtype(np.float32): 7, np.dtype(np.float64): 8, np.dtype(np.uint16): 9}
    POLL_S = 1e-4          # between event queries while settling
    WATCH_S = 0.1          # between looks at the other ranks' connections

    def __init__(self, rv: Rendezvous):
        os.environ.update(ENV)
        import cupy
        from cupy.cuda import nccl
        select_gpu(rv)
        self.rank, self.world_size, self.timeout = rv.rank, rv.world_size, rv.timeout
        self.store = CpuCollective(rv)
        uid = _uid_wire(nccl.get_unique_id()) if rv.rank == 0 else b""
        uid = _uid_from_wire(self.store.broadcast_bytes(uid))
        self._nccl, self._cupy = nccl, cupy
        self.comm = nccl.NcclCommunicator(rv.world_size, uid, rv.rank)

    def _args(self, a):
        kind = self.DTYPES.get(a.dtype)
        if kind is None or not a.flags.c_contiguous:
            raise EulerError(f"NCCL collectives here take contiguous float32, float64 or bf16 "
                             f"(uint16) arrays, not {a.dtype}", key="collective")
        return kind, self._cupy.cuda.get_current_stream().ptr

    @contextmanager
    def group(self):
        """The collectives issued inside are one NCCL launch (ncclGroupStart/End)."""
        self._nccl.groupStart()
        try:
            yield
        finally:
            self._nccl.groupEnd()

    def all_reduce_sum(self, a) -> None:
        dtype, stream = self._args(a)
        self.comm.allReduce(a.data.ptr, a.data.ptr, a.size, dtype, self._nccl.NCCL_SUM, stream)

    def reduce_scatter(self, a, out) -> None:
        dtype, stream = self._args(a)
        self.comm.reduceScatter(a.data.ptr, out.data.ptr, out.size, dtype,
                                self._nccl.NCCL_SUM, stream)

    def all_gather(self, shard, out) -> None:
        dtype, stream = self._args(shard)
        self.comm.allGather(shard.data.ptr, out.data.ptr, shard.size, dtype, stream)

    def broadcast(self, a) -> None:
        dtype, stream = self._args(a)
        self.comm.bcast(a.data.ptr, a.size, dtype, 0, stream)

    def broadcast_bytes(self, data: bytes) -> bytes:
        return self.store.broadcast_bytes(data)

    def gather_bytes(self, data: bytes, what: str = "gather") -> list[bytes] | None:
        return self.store.gather_bytes(data, what)

    def check_same(self, value: dict, what: str) -> None:
        self.store.check_same(value, what)

    def barrier(self) -> None:
        self.settle("barrier")
        self.store.barrier()

    def settle(self, what: str, event=None) -> None:
        """Wait for `event` (default: one recorded now on the current stream, after its
        collectives), at most `timeout` seconds, watching the other ranks meanwhile: NCCL
        waits forever for a rank that died, so a closed connection (or the hub's word that
        one closed) aborts the communicator and raises the line naming the rank."""
        cupy = self._cupy
        done = event
        if done is None:
            done = cupy.cuda.Event(block=False, disable_timing=True)
            done.record()
        start = watched = time.monotonic()
        while not done.done:
            now = time.monotonic()
            if now - watched > self.WATCH_S:
                watched = now
                try:
                    self.store.check_peers(what)
                except EulerError:
                    self.comm.abort()
                    raise
            if now - start > self.timeout:
                self.fail(f"{what} did not finish within {self.timeout:g}s")
            time.sleep(self.POLL_S)

    def check_peers(self, what: str) -> None:
        self.store.check_peers(what)

    def fail(self, message: str):
        """Abort the communicator (NCCL calls in flight end), tell the other ranks, raise."""
        self.comm.abort()
        self.store.fail(message)

    def close(self) -> None:
        self.comm.destroy()
        self.store.close()


def _uid_wire(uid) -> bytes:
    """NCCL's unique id as bytes for the hub: CuPy hands it out as bytes (14) or a tuple of
    C chars (older); a leading tag says which, so every rank rebuilds what it was given."""
    if isinstance(uid, (bytes, bytearray)):
        return b"B" + bytes(uid)
    return b"T" + np.asarray(uid, dtype=np.int8).tobytes()


def _uid_from_wire(raw: bytes):
    return raw[1:] if raw[:1] == b"B" else tuple(np.frombuffer(raw[1:], np.int8).tolist())
