"""Run logger: metrics.jsonl, TensorBoard events, resume without duplicate steps, plot."""
from __future__ import annotations

import itertools
import json

import pytest
from click.testing import CliRunner

from eulergen.cli import main
from eulergen.errors import EulerError
from eulergen.runtime.train import metrics
from eulergen.runtime.train.metrics import (RunLogger, flops_per_token, peak_flops, plot_run,
                                      read_metrics)


def _log_run(run_dir, steps, resume_step=None, tensorboard=False):
    with RunLogger(run_dir, total_steps=100, resume_step=resume_step, tensorboard=tensorboard,
                   progress=False) as log:
        for step in steps:
            log.log(step, train_loss=5.0 - step / 10, lr=1e-3, grad_norm=0.5, tokens_per_s=1000.0,
                    ms_per_step=12.5, mfu=0.1, val_loss=4.0 if step % 5 == 0 else None)


def test_records_are_json_lines_with_the_standard_keys(tmp_path):
    _log_run(tmp_path, range(1, 6))
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert set(records[4]) == {"step", "train_loss", "val_loss", "lr", "grad_norm", "tokens_per_s",
                               "ms_per_step", "mfu", "elapsed_s"}
    assert "val_loss" not in records[0]
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[1])["train_loss"] == pytest.approx(4.8)


def test_resume_drops_records_past_the_checkpoint(tmp_path):
    _log_run(tmp_path, range(1, 9))          # killed after step 8; last checkpoint at 5
    _log_run(tmp_path, range(6, 11), resume_step=5)
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 11))


def test_wall_time_carries_on_from_the_records_a_resume_keeps(tmp_path, monkeypatch):
    clock = itertools.count()   # a second a reading: the logger reads it once, then a record
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: float(next(clock)))
    _log_run(tmp_path, range(1, 9))             # records at 1 … 8 s
    _log_run(tmp_path, range(6, 11), resume_step=5)
    assert [r["elapsed_s"] for r in read_metrics(tmp_path)] == list(range(1, 11))


def test_fresh_run_replaces_old_metrics(tmp_path):
    _log_run(tmp_path, range(1, 9))
    _log_run(tmp_path, range(1, 3))
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_half_written_last_line_is_dropped_but_corruption_elsewhere_is_an_error(tmp_path):
    _log_run(tmp_path, range(1, 4))
    path = tmp_path / "metrics.jsonl"
    path.write_text(path.read_text() + '{"step": 4, "train_lo')
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(EulerError, match=r"metrics.jsonl:2: corrupt metrics record"):
        read_metrics(tmp_path)


def test_non_numeric_metric_is_refused(tmp_path):
    with RunLogger(tmp_path, 10, tensorboard=False, progress=False) as log:
        with pytest.raises(TypeError, match="metric train_loss is str"):
            log.log(1, train_loss="1.0")


def _tb_steps(run_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


def test_tensorboard_events_written_and_purged_on_resume(tmp_path):
    pytest.importorskip("tensorboardX")
    pytest.importorskip("tensorboard")
    _log_run(tmp_path, range(1, 9), tensorboard=True)
    assert _tb_steps(tmp_path, "loss/train_loss") == list(range(1, 9))
    _log_run(tmp_path, range(6, 11), resume_step=5, tensorboard=True)
    assert _tb_steps(tmp_path, "loss/train_loss") == list(range(1, 11))
    assert _tb_steps(tmp_path, "loss/val_loss") == [5, 10]


def test_plot_writes_loss_png(tmp_path):
    _log_run(tmp_path, range(1, 21))
    out = plot_run(tmp_path)
    assert out == tmp_path / "loss.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_command(tmp_path):
    _log_run(tmp_path, range(1, 11))
    result = CliRunner().invoke(main, ["plot", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "loss.png").is_file()


def test_plot_of_a_folder_without_metrics_is_one_line_error(tmp_path):
    result = CliRunner().invoke(main, ["plot", str(tmp_path)])
    assert result.exit_code == 2
    assert result.output.strip() == f"error: {tmp_path}: no metrics.jsonl here (not a run folder?)"


def test_flops_per_token_gpt2_124m():
    # GPT-2 124M without wpe: 124,439,808 - 786,432 = 123,653,376 matmul parameters.
    flops = flops_per_token(123_653_376, 12, 12, 64, 1024)
    assert flops == pytest.approx(6 * 123_653_376 + 12 * 12 * 768 * 1024)


def test_peak_flops_lookup():
    assert peak_flops("NVIDIA H200", "tf32") == pytest.approx(494.7e12)
    assert peak_flops("Some GPU", "fp32") is None
