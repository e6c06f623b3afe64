"""Collectives for data-parallel training: where a process stands (`Rendezvous`, from
torchrun's or SLURM's environment) and two implementations of one interface (rank,
world_size, all_reduce_sum, reduce_scatter, all_gather, broadcast, barrier, close).

`CpuCollective`: N numpy processes joined through a TCP hub on rank 0 (MASTER_ADDR:
MASTER_PORT). The hub sums ranks 0..N-1 in that fixed order, so a result is the same
bits on every rank and on every rerun. Every wait is bounded by `timeout`; a rank that
does not arrive, or dies, stops the others with one line naming it. It is the test
double for the logic, and the store through which NCCL's unique id travels.

The GPU path, cupy.cuda.nccl over CuPy arrays, is runtime/distributed/nccl.py's NcclCollective
(runtime/data_parallel.connect picks one for a backend).
"""
from __future__ import annotations

import errno
import json
import select
import socket
import struct
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from eulergen import env
from eulergen.errors import EulerError

TIMEOUT_ENV = "EULERGEN_COLLECTIVE_TIMEOUT"   # seconds a rank may lag the others (env.py)
_FRAME = struct.Struct("<cQ")   # kind (b"D" data, b"E" error text), payload bytes


@dataclass(frozen=True)
class Rendezvous:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    timeout: float = env.VARIABLES[TIMEOUT_ENV].default

    @staticmethod
    def from_env(environ=None) -> Rendezvous | None:
        """torchrun's RANK / WORLD_SIZE / LOCAL_RANK, else SLURM's SLURM_PROCID /
        SLURM_NTASKS / SLURM_LOCALID, with MASTER_ADDR / MASTER_PORT (eulergen/env.py
        parses each); None when neither names more than one process."""
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK") if env.is_set("WORLD_SIZE", environ) else \
            ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID") \
            if env.is_set("SLURM_NTASKS", environ) else None
        if names is None:
            return None
        rank, world, local = (env.get(n, environ) for n in names)
        if world <= 1:
            return None
        if not 0 <= rank < world:
            raise EulerError(f"{rank} is outside 0..{world - 1} ({names[1]} {world})",
                             key=names[0])
        port = env.get("MASTER_PORT", environ)
        if port is None:
            raise EulerError(f"{names[1]} is {world} but MASTER_PORT is not set: the ranks "
                             "meet at MASTER_ADDR:MASTER_PORT", key="MASTER_PORT")
        return Rendezvous(rank, world, local, env.get("MASTER_ADDR", environ), port,
                          env.get(TIMEOUT_ENV, environ))


def free_port() -> int:
    """A TCP port free on this machine now (for `--nproc`, whose ranks all run here)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class CpuCollective:
    """The TCP hub: every rank > 0 holds one connection to rank 0, which gathers, reduces
    in rank order, and answers each rank."""

    def __init__(self, rv: Rendezvous):
        self.rank, self.world_size, self.timeout = rv.rank, rv.world_size, rv.timeout
        self._peers: dict[int, socket.socket] = {}   # rank 0: rank -> connection
        self._hub: socket.socket | None = None        # ranks > 0
        self._queue: list | None = None               # inside group(): the ops to exchange
        if rv.rank == 0:
            self._serve(rv)
        else:
            self._connect(rv)

    def _serve(self, rv: Rendezvous) -> None:
        server = socket.socket()
        # a rerun on the same port must not meet the last run's TIME_WAIT connections; a
        # port another process listens on is still refused
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            server.bind(("", rv.master_port))
        except OSError as err:
            server.close()
            why = "is busy" if err.errno == errno.EADDRINUSE else f"cannot be bound: {err.strerror}"
            raise EulerError(f"{rv.master_port} {why} on this host (rank 0 listens there for "
                             f"the other {rv.world_size - 1} ranks); pick another",
                             key="MASTER_PORT") from None
        try:
            server.listen(rv.world_size)
            deadline = time.monotonic() + self.timeout
            while len(self._peers) < rv.world_size - 1:
                server.settimeout(max(0.01, deadline - time.monotonic()))
                try:
                    conn, _ = server.accept()
                except socket.timeout:
                    missing = min(set(range(1, rv.world_size)) - set(self._peers))
                    self.fail(f"rank {missing} did not arrive at the rendezvous within "
                               f"{self.timeout:g}s")
                conn.settimeout(self.timeout)
                rank = int(np.frombuffer(self._recv_from(conn, "?"), dtype="<i8")[0])
                if rank in self._peers or not 0 < rank < rv.world_size:
                    conn.close()
                    self.fail(f"a second process arrived as rank {rank}")
                self._peers[rank] = conn
        finally:
            server.close()

    def _connect(self, rv: Rendezvous) -> None:
        deadline = time.monotonic() + self.timeout
        while True:   # rank 0 may start after us
            try:
                self._hub = socket.create_connection((rv.master_addr, rv.master_port), timeout=1.0)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise EulerError(f"rank 0 did not open {rv.master_addr}:{rv.master_port} "
                                     f"within {self.timeout:g}s (rank {self.rank} waited)",
                                     key="MASTER_ADDR") from None
                time.sleep(0.05)
        self._hub.settimeout(self.timeout)
        self._hub.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _send(self._hub, np.array([self.rank], dtype="<i8").tobytes())

    # -- framing and failure --------------------------------------------------------------

    def _recv_from(self, conn: socket.socket, who: int | str, what: str = "the rendezvous") -> bytes:
        try:
            kind, size = _FRAME.unpack(_recv_exact(conn, _FRAME.size))
            payload = _recv_exact(conn, size)
        except socket.timeout:
            self.fail(f"rank {who} did not arrive at {what} within {self.timeout:g}s")
        except (ConnectionError, EOFError, OSError):
            self.fail(f"rank {who} left (connection closed) during {what}")
        if kind == b"E":   # the hub names the rank at fault
            self.close()
            raise EulerError(payload.decode(), key="collective")
        return payload

    def fail(self, message: str):
        """Tell every other rank (best effort), close, raise the one line."""
        message = f"rank {self.rank}: {message}"
        for conn in self._peers.values():
            try:
                _send(conn, message.encode(), b"E")
            except OSError:
                pass
        self.close()
        raise EulerError(message, key="collective")

    def _exchange(self, payload: bytes, what: str, answer) -> bytes:
        """Rank > 0: send `payload` to the hub, return its answer. Rank 0: gather every
        rank's payload in rank order, send `answer(payloads)[r]` to rank r, return its own."""
        if self.rank:
            _send(self._hub, payload)
            return self._recv_from(self._hub, 0, what)
        payloads = [payload] + [self._recv_from(self._peers[r], r, what)
                                for r in range(1, self.world_size)]
        answers = answer(payloads)
        for r in range(1, self.world_size):
            _send(self._peers[r], answers[r])
        return answers[0]

    def _op(self, payload: bytes, what: str, answer, deliver) -> None:
        """One collective: exchanged now, or inside group() queued for the group's one
        exchange; `deliver(answer)` writes this rank's result."""
        if self._queue is not None:
            self._queue.append((payload, what, answer, deliver))
            return
        deliver(self._exchange(payload, what, answer))

    @contextmanager
    def group(self):
        """The collectives issued inside run as one exchange when it ends (NCCL: one
        grouped launch); their results are there from then on."""
        if self._queue is not None:   # nested: the outer group exchanges
            yield
            return
        self._queue = []
        try:
            yield
            ops = self._queue
        finally:
            self._queue = None
        if not ops:
            return

        def answer(payloads):
            parts = [_unpack(p) for p in payloads]
            per_op = [op[2]([p[k] for p in parts]) for k, op in enumerate(ops)]
            return [_pack([a[r] for a in per_op]) for r in range(self.world_size)]
        what = " + ".join(dict.fromkeys(op[1] for op in ops))
        got = _unpack(self._exchange(_pack([op[0] for op in ops]), what, answer))
        for op, data in zip(ops, got):
            op[3](data)

    # -- the interface --------------------------------------------------------------------

    def all_reduce_sum(self, a: np.ndarray) -> None:
        """Sum a flat float array over ranks, in place; rank order 0..N-1."""
        _check_float(a)
        self._op(a.tobytes(), "all_reduce_sum",
                 lambda ps: [_sum(ps, a.dtype).tobytes()] * self.world_size, _into(a))

    def reduce_scatter(self, a: np.ndarray, out: np.ndarray) -> None:
        """out = rank r's 1/N slice of the rank-order sum of `a` (a.size = N * out.size;
        out may be that slice of a)."""
        _check_float(a)
        self._op(a.tobytes(), "reduce_scatter", lambda ps: [
            s.tobytes() for s in np.split(_sum(ps, a.dtype), self.world_size)], _into(out))

    def all_gather(self, shard: np.ndarray, out: np.ndarray) -> None:
        """out = every rank's `shard`, concatenated in rank order (shard may be rank r's
        slice of out)."""
        self._op(shard.tobytes(), "all_gather",
                 lambda ps: [b"".join(ps)] * self.world_size, _into(out))

    def broadcast(self, a: np.ndarray) -> None:
        """a = rank 0's a, in place."""
        a[...] = np.frombuffer(self.broadcast_bytes(a.tobytes()), dtype=a.dtype)

    def broadcast_bytes(self, data: bytes) -> bytes:
        return self._exchange(data, "broadcast", lambda ps: [ps[0]] * self.world_size)

    def gather_bytes(self, data: bytes, what: str = "gather") -> list[bytes] | None:
        """Rank 0: every rank's `data`, in rank order; the other ranks: None."""
        got = self._exchange(data, what, lambda ps: [_pack(ps)] + [b""] * (self.world_size - 1))
        return _unpack(got) if self.rank == 0 else None

    def check_same(self, value: dict, what: str) -> None:
        """Every rank must hold the same JSON-ready `value` (its config): else one line
        naming a rank and the first key that differs."""
        def compare(ps):
            odd = next((r for r, p in enumerate(ps) if p != ps[0]), None)
            verdict = b"" if odd is None else (
                f"rank {odd}'s {what} differs from rank 0's at "
                f"{_difference(json.loads(ps[odd]), json.loads(ps[0]))}").encode()
            return [verdict] * self.world_size
        data = json.dumps(value, sort_keys=True).encode()
        verdict = self._exchange(data, f"the {what} check", compare)
        if verdict:
            self.close()
            raise EulerError(verdict.decode(), key="collective")

    def barrier(self) -> None:
        self._exchange(b"", "barrier", lambda ps: [b""] * self.world_size)

    def check_peers(self, what: str) -> None:
        """Raise the one line of a rank that left (its connection closed) or of the hub's
        verdict, without waiting: what a rank polls while the device runs collectives
        (NcclCollective.settle)."""
        conns = self._peers.items() if self.rank == 0 else [(0, self._hub)]
        for r, conn in conns:
            readable, _, _ = select.select([conn], [], [], 0)
            if not readable:
                continue
            try:
                head = conn.recv(_FRAME.size, socket.MSG_PEEK)
            except OSError:
                head = b""
            if not head:
                self.fail(f"rank {r} left (connection closed) during {what}")
            if head[:1] == b"E":
                self._recv_from(conn, r, what)   # raises the hub's line

    def close(self) -> None:
        for conn in [*self._peers.values(), self._hub]:
            if conn is not None:
                conn.close()
        self._peers, self._hub = {}, None


def _check_float(a) -> None:
    if a.dtype not in (np.float32, np.float64):
        raise EulerError(f"the CPU collective sums float32 and float64 arrays, not {a.dtype}",
                         key="collective")


def _into(a):
    """Write an answer's bytes into array `a`."""
    def deliver(data: bytes) -> None:
        a[...] = np.frombuffer(data, dtype=a.dtype).reshape(a.shape)
    return deliver


def _pack(parts: list[bytes]) -> bytes:
    return struct.pack(f"<Q{len(parts)}Q", len(parts), *map(len, parts)) + b"".join(parts)


def _unpack(data: bytes) -> list[bytes]:
    (n,) = struct.unpack_from("<Q", data)
    sizes = struct.unpack_from(f"<{n}Q", data, 8)
    out, at = [], 8 * (n + 1)
    for size in sizes:
        out.append(data[at:at + size])
        at += size
    return out


def _difference(theirs, ours, path: str = "") -> str:
    """'key.path: theirs (rank 0: ours)' for the first key, in sorted order, that differs."""
    if isinstance(theirs, dict) and isinstance(ours, dict):
        for key in sorted(set(theirs) | set(ours)):
            if theirs.get(key) != ours.get(key):
                return _difference(theirs.get(key), ours.get(key), f"{path}{key}.")
    return f"{path.rstrip('.')}: {theirs!r} (rank 0: {ours!r})"


def _sum(payloads: list[bytes], dtype) -> np.ndarray:
    acc = np.frombuffer(payloads[0], dtype=dtype).copy()
    for p in payloads[1:]:
        acc += np.frombuffer(p, dtype=dtype)
    return acc


def _send(conn: socket.socket, payload: bytes, kind: bytes = b"D") -> None:
    conn.sendall(_FRAME.pack(kind, len(payload)) + payload)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = conn.recv_into(view[got:])
        if k == 0:
            raise EOFError
        got += k
    return bytes(buf)


def select_gpu(rv: Rendezvous) -> None:
    """Make GPU LOCAL_RANK current, before the backend or any kernel touches a device
    (else every rank would open a context on GPU 0). No CuPy or no GPU: nothing to select
    (get_backend then says so, or falls back to numpy)."""
    try:
        import cupy
        visible = cupy.cuda.runtime.getDeviceCount()
    except Exception:   # ImportError, or CUDARuntimeError without a driver
        return
    if 0 < visible <= rv.local_rank:
        raise EulerError(f"LOCAL_RANK {rv.local_rank} needs GPU {rv.local_rank}, but {visible} "
                         f"are visible: more ranks on this node than GPUs", key="WORLD_SIZE")
    cupy.cuda.Device(rv.local_rank).use()
