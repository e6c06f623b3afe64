"""What a person sees while long work runs: one bar style for every command, on stderr.

`Bar(label, total, unit=)`: where stderr is a terminal, a rich progress bar in train's
style (the label in bold, the bar, done/total, a status, the time left) that runs from
`start()` to `stop()`, its last state kept on screen, and `print(text)` writes above it;
elsewhere (a log, CI) plain lines: one at most every `every` seconds while it runs (0: one
an update) and, where it said anything, one when it ends, so a log shows that long work
goes on while work of a moment (a command refused at once) says nothing but its result.
Nothing is drawn before `start()`: a line printed before the work begins stays above it,
and one printed after `stop()` comes after the bar's last frame. The command starts and
stops its bar; the work it calls only updates it (its total once known, its progress).

A leaf: it imports rich, when a bar starts, and nothing of eulergen.
"""
from __future__ import annotations

import sys
import time

PLAIN_EVERY = 10.0   # seconds between a plain bar's lines
BYTES = "bytes"      # a unit shown as a share and a size (1.2/3.4 GB), not as a count


class Bar:
    def __init__(self, label: str, total: float | None = None, *, unit: str = "",
                 every: float = PLAIN_EVERY, enabled: bool = True, completed: float = 0):
        self.label, self.total, self.unit, self.every = label, total, unit, every
        self.enabled = enabled
        self.completed, self.status = completed, ""
        self._live = None         # the rich Progress while a terminal bar runs
        self._began = self._said = None
        self._console = None

    # -- the run ----------------------------------------------------------------------

    def start(self) -> Bar:
        if not self.enabled or self._began is not None:
            return self
        self._began = time.perf_counter()
        console = self.console()
        if console.is_terminal:
            self._live = _rich_bar(self, console)
            self._task = self._live.add_task(self.label, total=self.total,
                                             completed=self.completed, status=self.status,
                                             count=self.count())
            self._live.start()
        self._said = self._began
        return self

    def update(self, completed: float | None = None, *, advance: float = 0,
               status: str | None = None, total: float | None = None) -> None:
        """Work done so far (`completed`, or `advance` more), what it is doing (`status`),
        and a total found on the way (a stream's size)."""
        self.completed = (self.completed if completed is None else completed) + advance
        self.status = self.status if status is None else status
        self.total = self.total if total is None else total
        if self._live is not None:
            self._live.update(self._task, completed=self.completed, status=self.status,
                              total=self.total, count=self.count())
        elif self._began is not None and time.perf_counter() - self._said >= self.every:
            self._line()

    def print(self, text: str) -> None:
        """A line above the bar (samples, notices): on its own line while the bar runs."""
        if self._live is not None:
            self._live.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=sys.stderr, flush=True)

    def stop(self) -> None:
        """The bar's last frame stays; a plain bar says it is done."""
        if self._began is None:
            return
        if self._live is not None:
            self._live.stop()
            self._live = None
        elif self._said != self._began:
            self._line(f"done in {time.perf_counter() - self._began:.1f} s")
        self._began = None

    def __enter__(self) -> Bar:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- what it shows ----------------------------------------------------------------

    def console(self):
        """rich's Console on stderr (made once: whether it is a terminal decides the form)."""
        if self._console is None:
            from rich.console import Console
            self._console = Console(stderr=True)
        return self._console

    def count(self) -> str:
        """done/total in the bar's unit: '3/10 batches', '12.5/40.0 MB (31%)'."""
        if self.unit == BYTES:
            done = _size(self.completed)
            if not self.total:
                return done
            return f"{done}/{_size(self.total)} ({100 * self.completed / self.total:.0f}%)"
        total = f"/{self.total:,.0f}" if self.total is not None else ""
        return f"{self.completed:,.0f}{total}{' ' + self.unit if self.unit else ''}"

    def _line(self, state: str = "") -> None:
        parts = [f"{self.label}: {self.count()}", state, self.status]
        print(" | ".join(p for p in parts if p), file=sys.stderr, flush=True)
        self._said = time.perf_counter()


def hidden() -> Bar:
    """A bar that shows nothing: for a caller that passes none."""
    return Bar("", enabled=False)


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000


def _rich_bar(bar: Bar, console):
    """train's columns: the label, the bar, done/total, the status, the time left."""
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeRemainingColumn)
    counted = bar.unit != BYTES and bar.total is not None
    columns = [TextColumn(f"[bold]{bar.label}"), BarColumn(),
               MofNCompleteColumn() if counted else TextColumn("{task.fields[count]}")]
    if counted and bar.unit:
        columns.append(TextColumn(bar.unit))
    columns += [TextColumn("{task.fields[status]}"), TimeRemainingColumn()]
    return Progress(*columns, console=console)
