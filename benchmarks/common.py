"""Timing helpers the GPU benchmarks share: CUDA-event timing, the copy ceiling, a table.

Times are medians of CUDA-event-timed calls after warm-up, so one slow call (a clock
change, another process) does not move the figure. Each call sits between its own two
events, and all calls are queued before one synchronize: the GPU then runs them back to
back and each pair of events measures the GPU time of its call, not the Python time of
launching it (at the ≥ 256 MB sizes used here launching is far faster than running). A
call that waits for the host inside (a size read back from the GPU) still pays for it.
Events are recorded on CuPy's current stream, the legacy default stream that PyTorch's
eager ops also run on, so one clock times both."""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable


def say(*parts, end: str = "\n") -> None:
    """Progress on stderr, flushed, so a run cut off by a timeout still shows where it was."""
    print(*parts, file=sys.stderr, flush=True, end=end)


def time_ms(fn: Callable[[], object], *, warmup: int = 3, iters: int = 20,
            warm_s: float = 0.05) -> float:
    """Median milliseconds of `fn()` on the GPU, each call between two CUDA events.

    Warm-up is `warmup` calls and then more until `warm_s` seconds have passed with the
    GPU busy. A few calls were not enough: on the H200, relu fp32 forward (2^28 elements),
    timed first in its case after 2 warm-up calls, ran 0.561 ms, and PyTorch's, timed
    right after it, 0.508; after 50 ms of warm-up ours ran 0.505. (The idle GPU's clocks
    ramping up is the likely cause; they were not read.)"""
    import cupy
    for _ in range(warmup):
        fn()
    stream = cupy.cuda.get_current_stream()
    stream.synchronize()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < warm_s:
        fn()
        stream.synchronize()
    return statistics.median(event_ms(fn, iters))


def event_ms(fn: Callable[[], object], iters: int) -> list[float]:
    """Each of `iters` calls of `fn()` between two CUDA events, all queued before one
    synchronize, in milliseconds (no warm-up)."""
    import cupy
    events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(iters)]
    for start, stop in events:
        start.record()
        fn()
        stop.record()
    events[-1][1].synchronize()
    return [cupy.cuda.get_elapsed_time(a, b) for a, b in events]


def copy_gbps(nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written (as the
    kernel figures count theirs), on buffers much larger than the 60 MB L2."""
    import cupy
    n = nbytes // 2
    src = cupy.ones(n, dtype=cupy.uint8)
    dst = cupy.empty_like(src)
    ms = time_ms(lambda: dst.data.copy_from_device_async(src.data, n), iters=iters)
    return 2 * n / ms / 1e6


@dataclass(frozen=True)
class Row:
    op: str
    dtype: str
    ms: float
    gbytes: float                 # the fewest bytes the op must move, in GB
    copy_gbps: float
    torch_ms: float | None = None

    @property
    def gbps(self) -> float:
        return self.gbytes / self.ms * 1e3

    @property
    def of_copy(self) -> float:
        return self.gbps / self.copy_gbps

    @property
    def ratio(self) -> float | None:
        """Our time over PyTorch's: below 1.0 is faster than PyTorch."""
        return None if self.torch_ms is None else self.ms / self.torch_ms


def table(rows: list[Row]) -> str:
    head = f"{'op':<34} {'dtype':<5} {'ms':>8} {'GB/s':>8} {'of copy':>8} {'torch ms':>9} {'ratio':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        tms = f"{r.torch_ms:9.3f}" if r.torch_ms is not None else f"{'-':>9}"
        ratio = f"{r.ratio:6.2f}" if r.ratio is not None else f"{'-':>6}"
        gbps = f"{r.gbps:8.0f}" if r.gbytes else f"{'-':>8}"
        ofc = f"{r.of_copy:8.2f}" if r.gbytes else f"{'-':>8}"
        lines.append(f"{r.op:<34} {r.dtype:<5} {r.ms:8.3f} {gbps} {ofc} {tms} {ratio}")
    return "\n".join(lines)
