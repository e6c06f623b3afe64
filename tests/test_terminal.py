"""What a person sees in a real terminal: commands run in a tmux pane (its own server,
120 columns), the pane captured when they end. train's first line stands on its own above
the bar, the bar's last frame comes before the sample and the summary, eval shows its
bars and then its result, and chat says how to leave before its first prompt. Skipped
where tmux is not installed."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid

import pytest

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")]

BAR = "━"   # what rich draws a bar with
TINY = ("model.hidden_dim=64", "model.num_heads=1", "model.num_kv_heads=1",
        "model.num_layers=1", "model.mlp_hidden=128", "model.max_seq_len=32",
        "training.batch_size=4", "training.total_steps=12", "training.eval_every=6",
        "training.eval_steps=2", "training.checkpoint_every=0", "training.sample_tokens=24",
        "training.warmup_steps=2")


class Pane:
    """A tmux pane on a server of this test's own (so it runs with this environment)."""

    def __init__(self):
        self.socket = f"eulergen-test-{uuid.uuid4().hex[:8]}"
        self._tmux("new-session", "-d", "-s", "t", "-x", "120", "-y", "60")

    def _tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, *args], check=True,
                              capture_output=True, text=True).stdout

    def type(self, line: str) -> None:
        self._tmux("send-keys", "-t", "t", line, "Enter")

    def lines(self) -> list[str]:
        """The pane's lines, history included, wrapped lines joined."""
        return self._tmux("capture-pane", "-p", "-J", "-S", "-", "-t", "t").splitlines()

    def wait_for(self, line: str, timeout: float = 180) -> list[str]:
        """The pane's lines once one of them is `line` (the typed command holds it too, but
        not as a line of its own)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = self.lines()
            if any(s.rstrip() == line for s in lines):
                return lines
            time.sleep(0.2)
        raise AssertionError(f"no line {line!r} in the pane:\n" + "\n".join(self.lines()))

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True)


@pytest.fixture
def pane():
    p = Pane()
    yield p
    p.close()


def _eulergen(*args: str) -> str:
    env = " ".join(f"{k}={shlex.quote(os.environ[k])}" for k in ("PYTHONPATH",)
                   if k in os.environ)
    command = [sys.executable, "-m", "eulergen", *args]
    return f"env {env} " + " ".join(map(shlex.quote, command))


def _index(lines: list[str], test, what: str) -> int:
    found = [n for n, line in enumerate(lines) if test(line)]
    assert found, f"no {what} in the pane:\n" + "\n".join(lines)
    return found[-1]


def test_train_eval_and_chat_read_cleanly_in_a_terminal(pane, shard, tmp_path):
    run = tmp_path / "run"
    sets = [a for s in (*TINY, f"data.dataset={shard}", f"data.val_dataset={shard}",
                        "training.device=numpy")
            for a in ("--set", s)]
    pane.type(_eulergen("train", "--run-dir", str(run), *sets) + "; echo TRAIN-DONE")
    lines = pane.wait_for("TRAIN-DONE")
    first = _index(lines, lambda s: "eulergen train: cpu" in s, "first line")
    assert lines[first].startswith("eulergen train: cpu"), lines[first]
    bar = _index(lines, lambda s: BAR in s, "bar")
    assert lines[bar].startswith("train") and "12/12" in lines[bar], lines[bar]
    sample = _index(lines, lambda s: s.startswith("sample:"), "sample")
    summary = _index(lines, lambda s: s.startswith("val loss"), "summary")
    assert first < bar < sample < summary, "\n".join(lines)
    assert lines[sample] == "sample:" and not any(BAR in s for s in lines[sample:])

    pane.type("clear; " + _eulergen("eval", str(run), "--data", str(shard), "--seq-len", "32",
                                    "--max-batches", "3") + "; echo EVAL-DONE")
    lines = pane.wait_for("EVAL-DONE")
    bars = [s for s in lines if BAR in s]
    assert [s.split()[0] for s in bars] == ["load", "eval"], "\n".join(lines)
    assert "3/3" in bars[1] and "loss" in bars[1], bars[1]
    result = _index(lines, lambda s: s.startswith("loss "), "result")
    assert result > lines.index(bars[1]), "\n".join(lines)

    pane.type("clear; " + _eulergen("chat", str(run), "--max-new-tokens", "8"))
    lines = pane.wait_for(">")
    leave = _index(lines, lambda s: "Ctrl-D or /quit" in s, "how to leave")
    assert leave < _index(lines, lambda s: s.rstrip() == ">", "prompt")
    pane.type("/quit")
    pane.type("echo CHAT-DONE")
    pane.wait_for("CHAT-DONE", timeout=30)
