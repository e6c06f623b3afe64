"""cuBLASLt's algorithm for a GEMM chosen by timing it, not by the heuristic alone
(EULERGEN_GEMM_SEARCH, on by default; off runs the heuristic's first).

cuBLASLt's heuristic ranks the algorithms that can run a GEMM by its model of the GPU, and
its first is not always the fastest (tiles that leave a last wave mostly idle, say). So at a
GEMM's first call outside a CUDA graph capture, the heuristic's first CANDIDATES algorithms
are each timed on the call's own operands (runtime/engine/gemm.py's LtContext.plan), in
interleaved rounds (`measure`), and the fastest is kept where it beats the heuristic's first
by MARGIN (so that timing noise does not move the choice).

The choice is kept on disk, a file per GPU and cuBLASLt version under
$EULERGEN_CACHE/gemm/, naming the algorithm by its value (cuBLASLt's algorithm struct,
which its documentation lets a program store and use again with the same library). A
later process finds it among what the heuristic offers and runs it without timing: the
same algorithm, so the same bits (a resumed run's steps are its first run's). Where the
heuristic no longer offers it, or the file is gone, the GEMM is timed again.
"""
from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Callable, Sequence

from eulergen import cache_dir
from eulergen.files import write_atomic

CANDIDATES = 16     # the heuristic's first algorithms, of those that fit the workspace
MARGIN = 0.03       # how much faster than the heuristic's first a pick must be
REPEATS, LAUNCHES = 5, 5   # a candidate's time: the median of REPEATS runs of LAUNCHES calls
FORMAT = 1


def choose(seconds: Sequence[float | None], margin: float = MARGIN) -> int:
    """The index of the algorithm to run, given each candidate's time (None: it failed to
    launch): the fastest, where it beats the first (the heuristic's) by `margin`; the first
    otherwise, or the fastest that ran when the first did not."""
    ran = [(t, i) for i, t in enumerate(seconds) if t is not None]
    if not ran:
        return 0
    best, index = min(ran)
    first = seconds[0]
    if first is not None and best > first * (1 - margin):
        return 0
    return index


def record_path(device: str, version: int) -> Path:
    """The file of choices for a GPU described as `device` under cuBLASLt `version`."""
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-") or "gpu"
    return cache_dir() / "gemm" / f"{slug}-cublaslt{version}.json"


def key_text(key: tuple) -> str:
    """A plan key (ints, and a tuple of ints) as the record's key."""
    return json.dumps(key, separators=(",", ":"))


class Record:
    """The choices kept in one file: key text -> the algorithm's bytes, and what each
    candidate took. A file that cannot be read is an empty record (a cache: timing again
    remakes it), written over at the next choice."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.entries = self._read()

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
            entries = data["algorithms"] if data.get("format") == FORMAT else {}
            return {k: v for k, v in entries.items()
                    if isinstance(v, dict) and isinstance(v.get("algo"), str)}
        except (OSError, ValueError, AttributeError, KeyError, TypeError):
            return {}

    def get(self, key: str) -> bytes | None:
        entry = self.entries.get(key)
        if entry is None:
            return None
        try:
            return bytes.fromhex(entry["algo"])
        except ValueError:
            return None

    def put(self, key: str, algo: bytes, seconds: Sequence[float | None]) -> None:
        """Keep a choice: merged into what the file holds now (another process may have
        written since this one read it), then written atomically."""
        self.entries = {**self._read(), **self.entries}
        self.entries[key] = {"algo": algo.hex(),
                             "us": [None if t is None else round(t * 1e6, 2) for t in seconds]}
        text = json.dumps({"format": FORMAT, "algorithms": self.entries}, indent=1,
                          sort_keys=True)
        write_atomic(self.path, text.encode())


class Search:
    """The process's searched choices: `pick` for each new plan."""

    def __init__(self, record: Record):
        self.record = record

    def pick(self, key: tuple, algos: Sequence[bytes],
             timer: Callable[[int], float | None] | None) -> int:
        """The index among `algos` (the heuristic's candidates, as bytes) to run for `key`:
        the recorded one where the heuristic still offers it; else, with a `timer` (candidate
        index -> seconds, None while capturing), the fastest (`choose`), recorded; else (or
        where no candidate ran) the heuristic's first."""
        text = key_text(key)
        saved = self.record.get(text)
        if saved is not None and saved in algos:
            return algos.index(saved)
        if timer is None or len(algos) < 2:
            return 0
        seconds = measure(timer, len(algos))
        if all(t is None for t in seconds):   # nothing ran (no scratch memory): not a choice
            return 0
        index = choose(seconds)
        self.record.put(text, algos[index], seconds)
        return index


def for_device(version: int) -> Search:
    """The search of this process's GPU (its name and SMs: a MIG slice times otherwise)."""
    from eulergen.runtime.engine.backend import get_backend, sm_count
    device = f"{get_backend('cuda').device} {sm_count()} sms"
    return Search(Record(record_path(device, version)))


def measure(timer: Callable[[int], float | None], count: int) -> list[float | None]:
    """Each of `count` candidates' time (`timer(i)`: one run's, None where it fails): a first
    round warms every one and finds those that fail, then REPEATS rounds take each in turn,
    so that the clocks' ramp after a compile or a change of temperature meets them all
    alike; the median of each one's runs."""
    runs: list[list[float] | None] = [[] if timer(i) is not None else None for i in range(count)]
    for _ in range(REPEATS):
        for i, times in enumerate(runs):
            if times is not None:
                t = timer(i)
                runs[i] = None if t is None else times + [t]
    return [None if r is None else statistics.median(r) for r in runs]


def time_launches(launch: Callable[[], None], stream) -> float | None:
    """Seconds one `launch()` takes on the CuPy `stream`: LAUNCHES back-to-back calls between
    two events. None where it raises (an algorithm that will not run these operands)."""
    import cupy
    try:
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        for _ in range(LAUNCHES):
            launch()
        end.record(stream)
        end.synchronize()
    except Exception:   # cuBLASLtError and the like: this candidate cannot run
        return None
    return cupy.cuda.get_elapsed_time(start, end) / 1e3 / LAUNCHES


class Scratch:
    """Device memory outside CuPy's pool for the timed calls of a GEMM that adds to its
    output (they must not touch it), allocated at the first `address()` and freed on exit,
    so that the pool, and the peak memory read from it, never holds it. `address()` is 0
    where the GPU has not that much free."""

    def __init__(self, nbytes: int):
        self.nbytes, self.ptr, self.tried = nbytes, 0, False

    def __enter__(self) -> Scratch:
        return self

    def address(self) -> int:
        if not self.tried:
            import cupy
            self.tried = True
            try:
                self.ptr = cupy.cuda.runtime.malloc(self.nbytes)
            except cupy.cuda.runtime.CUDARuntimeError:
                self.ptr = 0
        return self.ptr

    def __exit__(self, *exc) -> None:
        if self.ptr:
            import cupy
            cupy.cuda.runtime.free(self.ptr)
            self.ptr = 0
