"""progress.Bar where stderr is no terminal (a log, CI): plain lines, none for work of a
moment; tests/test_terminal.py has the terminal's bar."""
from __future__ import annotations

from eulergen.progress import BYTES, Bar


def test_a_bar_of_a_line_an_update_ends_saying_it_is_done(capsys):
    with Bar("eval", 3, unit="batches", every=0) as bar:
        for n in range(1, 4):
            bar.update(n, status=f"loss {1 / n:.2f}")
    lines = capsys.readouterr().err.splitlines()
    assert lines[:3] == ["eval: 1/3 batches | loss 1.00", "eval: 2/3 batches | loss 0.50",
                         "eval: 3/3 batches | loss 0.33"]
    assert lines[3].startswith("eval: 3/3 batches | done in ") and len(lines) == 4


def test_work_of_a_moment_prints_nothing(capsys):
    with Bar("load", unit="tensors") as bar:   # every PLAIN_EVERY seconds: none pass
        bar.update(total=4)
        bar.update(advance=4)
    assert capsys.readouterr().err == ""


def test_lines_above_the_bar_and_counts_of_bytes(capsys):
    bar = Bar("prepare", 4e9, unit=BYTES)
    bar.update(1.5e9)
    assert bar.count() == "1.5 GB/4.0 GB (38%)"
    with bar:
        bar.print("warning: skipped")
    assert capsys.readouterr().err == "warning: skipped\n"
