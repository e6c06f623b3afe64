"""The memory planner: every byte a run touches, laid out before the first step.

A plan is a list of named buffers placed in a few big arenas (one allocation each):

    params       every weight, flat; matrices (weight-decayed) first, so an update op
                 runs over two contiguous ranges (in bf16 runs: the float32 master weights)
    params_bf16  bf16 runs: the same layout in bf16, the copy the kernels read
    grads        the same layout as params (in the storage dtype; autocast: float32)
    optimizer    the update ops' state (adamw's m and v: `adamw.m`, `adamw.v`), each buffer
                 the parameters its op steps in params order (training only; float32 in
                 bf16 runs; runtime/model/optimizer_plan.py)
    activations  what the forward pass keeps for the backward pass
    stats        bf16 runs: the float32 per-row values (attention's lse, the losses and
                 their seed, the gradient norm's row sums); fp32 runs keep them with the rest
    stream       bf16 runs in autocast precision: the float32 residual stream (the
                 embedding's output and the norms' sums a block keeps), its gradient, and
                 the float32 scratch of parameter gradients that are added to
    workspace    temporaries the backward pass reuses from layer to layer
    kernels      float32 workspace of the generated backward kernels (row ops' weight-
                 gradient partials, attention's row dots, the embedding's sort keys and
                 first-key ranks), shared by every call
    gemm         bytes: the GEMM libraries' workspace (cuBLAS's and cuBLASLt's, gemm.py), its
                 own allocation, so it starts on the pool's alignment
    tokens       int32 token ids and targets

`Memory` turns a plan into arrays once; every tensor the model touches afterwards
is a view into them, and host data arrives through `upload` (no device temporary), so
a training step allocates nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

import numpy as np

from eulergen.errors import EulerError

ALIGN = 64  # elements: every buffer starts on a 256-byte (bf16: 128-byte) boundary, so
            # 128-bit loads line up

ARENA_ORDER = ("params", "params_bf16", "grads", "optimizer", "activations", "stats",
               "stream", "workspace", "kernels", "gemm", "tokens")

# CuPy has no bfloat16: a "bf16" buffer holds the bits in uint16 (runtime/engine/bf16.py)
_STORAGE = {"bf16": "uint16"}


def storage(dtype: str) -> np.dtype:
    """The array dtype that holds a plan dtype ("float32", "bf16", "int32", …)."""
    return np.dtype(_STORAGE.get(dtype, dtype))


@dataclass(frozen=True)
class Buffer:
    name: str
    arena: str
    shape: tuple[int, ...]
    dtype: str
    offset: int           # elements from the start of the arena

    @property
    def size(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * storage(self.dtype).itemsize


@dataclass(frozen=True)
class Arena:
    name: str
    dtype: str
    size: int             # elements

    @property
    def nbytes(self) -> int:
        return self.size * storage(self.dtype).itemsize


@dataclass(frozen=True)
class Plan:
    arenas: tuple[Arena, ...]
    buffers: tuple[Buffer, ...]
    index: dict = field(hash=False, compare=False, repr=False)

    @property
    def total_bytes(self) -> int:
        return sum(a.nbytes for a in self.arenas)

    def buffer(self, name: str) -> Buffer:
        return self.buffers[self.index[name]]

    def arena(self, name: str) -> Arena:
        return next(a for a in self.arenas if a.name == name)

    def span(self, names) -> tuple[int, int]:
        """The element range [start, stop) that a run of consecutive buffers covers."""
        bufs = [self.buffer(n) for n in names]
        return min(b.offset for b in bufs), max(b.offset + b.size for b in bufs)


class Planner:
    """Appends buffers to arenas in the order they are requested."""

    def __init__(self):
        self._arenas: dict[str, tuple[str, int]] = {}
        self._buffers: list[Buffer] = []

    def add(self, arena: str, name: str, shape, dtype: str = "float32") -> Buffer:
        shape = tuple(int(s) for s in shape)
        if any(s <= 0 for s in shape):
            raise EulerError(f"buffer {name!r} has an empty shape {shape}", key="plan")
        a_dtype, used = self._arenas.get(arena, (dtype, 0))
        if a_dtype != dtype:
            raise EulerError(f"buffer {name!r} is {dtype} but arena {arena!r} holds {a_dtype}",
                             key="plan")
        buf = Buffer(name, arena, shape, dtype, used)
        self._arenas[arena] = (dtype, used + -(-buf.size // ALIGN) * ALIGN)
        self._buffers.append(buf)
        return buf

    def plan(self) -> Plan:
        names = [b.name for b in self._buffers]
        dupes = {n for n in names if names.count(n) > 1}
        if dupes:
            raise EulerError(f"buffer planned twice: {sorted(dupes)[0]!r}", key="plan")
        order = {n: i for i, n in enumerate(ARENA_ORDER)}
        arenas = tuple(Arena(n, d, s) for n, (d, s) in
                       sorted(self._arenas.items(), key=lambda kv: order.get(kv[0], 99)))
        return Plan(arenas, tuple(self._buffers), {b.name: i for i, b in enumerate(self._buffers)})


class Memory:
    """A plan made real: one array per arena, and a view per buffer."""

    def __init__(self, plan: Plan, xp, *, shared: dict | None = None):
        """`shared` maps arena names to existing arrays to use instead of new ones (a
        sampling model reads the weights of the training model it sits beside)."""
        self.plan = plan
        self.xp = xp
        self.arenas = {}
        for a in plan.arenas:
            given = (shared or {}).get(a.name)
            if given is not None:
                if given.size != a.size or given.dtype != storage(a.dtype):
                    raise EulerError(f"shared arena {a.name!r} has {given.size} {given.dtype}, "
                                     f"the plan wants {a.size} {a.dtype}", key="plan")
                self.arenas[a.name] = given
            else:
                # zeros, not empty: padding and rows a run never writes (wpe beyond T)
                # must read as zero in norms and checkpoints
                self.arenas[a.name] = xp.zeros(a.size, dtype=storage(a.dtype))
        self._views = {b.name: self.arenas[b.arena][b.offset:b.offset + b.size].reshape(b.shape)
                       for b in plan.buffers}

    def __getitem__(self, name: str):
        return self._views[name]

    def __contains__(self, name: str) -> bool:
        return name in self._views


def upload(dst, host) -> None:
    """Copy host data into a contiguous view of an arena, converted to its dtype on the
    host. On CuPy this is one host-to-device copy: `view[...] = cupy.asarray(host)` would
    first allocate a device temporary of the same size from the pool, outside the plan."""
    host = np.ascontiguousarray(np.asarray(host).reshape(dst.shape), dtype=dst.dtype)
    if isinstance(dst, np.ndarray):
        dst[...] = host
    else:
        dst.set(host)


def check_fits(plan: Plan, backend, shared: dict | None = None) -> None:
    """Refuse, before allocating, a plan larger than the GPU's free memory (arenas that
    `shared` provides are already allocated and not counted)."""
    if not backend.is_gpu:
        return
    free, total = backend.xp.cuda.runtime.memGetInfo()
    # the pool keeps freed blocks: they are free to this process though not to the driver
    free += backend.xp.get_default_memory_pool().free_bytes()
    need = sum(a.nbytes for a in plan.arenas if a.name not in (shared or {}))
    if need > free:
        raise EulerError(f"the memory plan needs {format_bytes(need)} but the GPU has "
                         f"{format_bytes(free)} free of {format_bytes(total)}; lower "
                         "training.batch_size or training.seq_len (see `eulergen plan`)",
                         key="plan")


def format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} PiB"


def plan_table(plan: Plan, title: str):
    """The plan as a rich Table: each arena's buffers, the arena's total, and the total."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("buffer", no_wrap=True)
    table.add_column("shape", no_wrap=True)
    table.add_column("dtype")
    table.add_column("bytes", justify="right", no_wrap=True)
    for a in plan.arenas:
        table.add_row(f"[bold]{a.name}[/bold]", "", "", "")
        for b in plan.buffers:
            if b.arena == a.name:
                table.add_row(f"  {b.name}", "×".join(map(str, b.shape)), b.dtype, f"{b.nbytes:,}")
        table.add_row(f"[bold]{a.name} total[/bold]", f"{a.size:,} elements", a.dtype,
                      f"[bold]{a.nbytes:,}[/bold] ({format_bytes(a.nbytes)})", end_section=True)
    table.add_row("[bold]total[/bold]", "", "",
                  f"[bold]{plan.total_bytes:,}[/bold] ({format_bytes(plan.total_bytes)})")
    return table
