"""The benchmarks' plumbing on the CPU: a configuration's process and its one-line failure
(benchmarks/isolated.py), llm.c's log as train_gpt2.cu prints it (benchmarks/llmc.py),
the time converge.py reads off a side's evaluations."""
from __future__ import annotations

import importlib.util
import sys
import textwrap

import pytest

from eulergen import PACKAGE_DIR


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(name, PACKAGE_DIR / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module   # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


isolated, llmc, converge = _bench("isolated"), _bench("llmc"), _bench("converge")

# train_gpt2.cu's own format strings
STEP = "step %4d/%d | loss %7.6f (%+.2fz)| norm %6.4f (%+.2fz)| lr %.2e | %.2f ms | %.1f%% bf16 MFU | %.0f tok/s"
DEVICE = "| device                | %-50s |"
MEMORY = "device memory usage: %d MiB / %d MiB"


def _child(tmp_path, body: str) -> list[str]:
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(PACKAGE_DIR / "benchmarks")!r})
        from isolated import emit
        result = sys.argv[sys.argv.index("--result") + 1]
    """) + textwrap.dedent(body))
    return [sys.executable, str(script)]


def test_a_child_returns_its_records_and_a_failed_one_its_last_error_line(tmp_path):
    ok = isolated.run_child(_child(tmp_path, "emit(result, {'a': 1}); emit(result, {'b': 2})"), 60)
    assert ok.records == [{"a": 1}, {"b": 2}] and ok.error is None
    bad = isolated.run_child(_child(tmp_path, """
        emit(result, {'step': 1})
        raise MemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    """), 60)
    assert bad.records == [{"step": 1}]
    assert bad.error == "MemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (exit 1)"


def test_a_child_past_its_time_is_killed_and_says_so(tmp_path):
    out = isolated.run_child(_child(tmp_path, "import time; time.sleep(60)"), 1)
    assert out.error == "timed out after 1 s" and out.seconds < 30
    assert isolated.run_child(["false"], 0.5).error.startswith("not run")


def test_llmc_steps_are_read_from_its_own_format_and_timed_as_the_others(tmp_path):
    ms = [900.0, 50.0, 40.0] + [20.0 + i % 3 for i in range(6)]   # first, warmup 2, 2 x 3
    lines = [DEVICE % "NVIDIA H200", MEMORY % (9216, 143771)] + [
        STEP % (i + 1, len(ms), 10.5 - i / 10, 0.1, 1.2, -0.3, 6e-4, m, 40.0, 8192 / m * 1e3)
        for i, m in enumerate(ms)]
    log = llmc.parse("\n".join(lines))
    assert log["ms"] == ms and log["device_name"] == "NVIDIA H200"
    assert log["peak"] == 9216 * 2**20 and log["loss"] == pytest.approx(9.7)
    binary = tmp_path / "train_gpt2cu"
    binary.write_text("#!/bin/sh\ncat <<'EOF'\n" + "\n".join(lines) + "\nEOF\n")
    binary.chmod(0o755)
    r = llmc.measure(binary, ("t.bin", "v.bin"), 8, 1024, warmup=2, steps=3, repeats=2, timeout=30)
    assert r["first_s"] == 0.9 and r["medians"] == [0.021, 0.021]
    assert r["tokens_per_s"] == pytest.approx(8 * 1024 / 0.021)
    with pytest.raises(llmc.LlmcError, match="9 of 10 steps"):
        llmc.measure(binary, ("t.bin", "v.bin"), 8, 1024, warmup=3, steps=3, repeats=2, timeout=30)


def test_time_to_a_loss_is_the_first_evaluation_at_or_below_it():
    evals = [{"step": 100, "val_loss": 5.0, "train_s": 2.0},
             {"step": 200, "val_loss": 4.0, "train_s": 4.0},
             {"step": 300, "val_loss": 4.1, "train_s": 6.0}]
    assert converge.time_to(evals, 4.05) == 4.0
    assert converge.time_to(evals, 4.0) == 4.0
    assert converge.time_to(evals, 3.9) is None
