"""Independent GPU work on a few CUDA streams at once: forked from the current stream by an
event, joined back to it by one event per lane, so that a stream capturing a CUDA graph
captures the lanes' work too (the capture follows the events into the other streams) and
the graph holds them as parallel branches. On numpy (or with one lane) everything runs in
order, as it would without lanes.

    lanes = Lanes(backend, 4)
    with lanes.forked() as on:
        for work, lane in jobs:
            with on(lane):
                work()

Lane 0 is the current stream itself; the others are streams of their own, created once.
Work on different lanes must touch disjoint memory (or only read the same)."""
from __future__ import annotations

import contextlib


class Lanes:
    def __init__(self, backend, n: int):
        self.n = n
        self.streams, self._fork, self._joins = [], None, []
        if backend.is_gpu and n > 1:
            import cupy
            self.streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(n - 1)]
            self._fork = cupy.cuda.Event(disable_timing=True)
            self._joins = [cupy.cuda.Event(disable_timing=True) for _ in self.streams]

    @contextlib.contextmanager
    def forked(self):
        """`on(lane)`, a context making lane's stream current, for the work inside."""
        if not self.streams:
            yield lambda lane: contextlib.nullcontext()
            return
        import cupy
        main = cupy.cuda.get_current_stream()
        self._fork.record(main)
        for s in self.streams:
            s.wait_event(self._fork)
        try:
            yield lambda lane: self.streams[lane - 1] if lane else contextlib.nullcontext()
        finally:
            for s, done in zip(self.streams, self._joins):
                done.record(s)
                main.wait_event(done)
