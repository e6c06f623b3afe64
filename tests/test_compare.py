"""`eulergen compare` and `eulergen plot` of several runs: the table's numbers come from the
runs' records and checkpoints, only the config keys that differ are shown, and the plot
overlays every run; a plot file eulergen did not write is never overwritten."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console

from eulergen.cli import main
from eulergen.errors import EulerError
from eulergen.runtime.engine.backend import NUMPY
from eulergen.runtime.engine.ops import OpLibrary
from eulergen.runtime.train.compare import differing_keys, plot_runs, read_runs, runs_table
from eulergen.runtime.train.config import load_config
from eulergen.runtime.train.trainer import Trainer

PNG = b"\x89PNG\r\n\x1a\n"


def _sets(shard: Path, run: Path, **changes) -> list[str]:
    sets = dict(batch_size=2, seq_len=16, total_steps=6, warmup_steps=1, eval_every=3,
                eval_steps=2, checkpoint_every=6, log_every=2, sample_tokens=0)
    return [f"run_dir={run}", f"data.dataset={shard}", f"data.val_dataset={shard}",
            "model.hidden_dim=32", "model.num_layers=1", "model.num_heads=1",
            "model.num_kv_heads=1", "model.max_seq_len=16", "model.mlp_hidden=32",
            *(f"training.{k}={v}" for k, v in sets.items()),
            *(f"{k}={v}" for k, v in changes.items())]


@pytest.fixture(scope="module")
def runs(shard, tmp_path_factory) -> dict[str, Trainer]:
    """Two finished runs that differ in their activation and learning rate."""
    root = tmp_path_factory.mktemp("runs")
    lib = OpLibrary(NUMPY)
    out = {}
    for name, changes in (("a", {}), ("b", {"model.activation": "relu2",
                                            "training.learning_rate": 1e-3})):
        trainer = Trainer(load_config(None, _sets(shard, root / name, **changes)), lib,
                          progress=False, tensorboard=False)
        trainer.run()
        out[name] = trainer
    return out


def _text(table) -> str:
    console = Console(width=250, record=True, file=io.StringIO())
    console.print(table)
    return console.export_text()


def test_the_table_holds_each_runs_numbers_and_only_the_keys_that_differ(runs):
    found = read_runs([t.run_dir for t in runs.values()])
    # min_lr follows learning_rate (a tenth of it) where no one gives it
    assert differing_keys(found) == ["model.activation", "training.learning_rate",
                                     "training.min_lr"]
    for run, trainer in zip(found, runs.values()):
        vals = trainer.result.val_losses
        assert (run.final_val, run.best_val) == (vals[6], min(vals.values()))
        assert run.params == trainer.model.param_total
        assert run.tokens == 6 * 2 * 16    # every step's batch, the last one logged too
        assert run.wall_s > 0 and run.tokens_per_s > 0
    text = _text(runs_table(found))
    header = next(line for line in text.splitlines() if "final val" in line)
    assert "model.activation" in header and "training.learning_rate" in header
    assert "model.hidden_dim" not in text and "run_dir" not in text
    row = next(line for line in text.splitlines() if line.lstrip("│ ").startswith("b "))
    assert "relu2" in row and "0.001" in row and f"{found[1].final_val:.4f}" in row


def test_compare_prints_the_table_and_writes_one_plot(runs, tmp_path):
    out = tmp_path / "both.png"
    args = ["compare", *(str(t.run_dir) for t in runs.values()), "--out", str(out)]
    got = CliRunner().invoke(main, args)
    assert got.exit_code == 0, got.output
    assert "final val" in got.output and "relu2" in got.output
    assert out.read_bytes()[:8] == PNG
    again = CliRunner().invoke(main, [*args, "--x", "tokens"])   # its own plot: replaced
    assert again.exit_code == 0, again.output


@pytest.mark.parametrize("x", ["step", "tokens", "time"])
def test_plot_of_several_runs_overlays_them_in_one_png(runs, tmp_path, x):
    got = CliRunner().invoke(main, ["plot", *(str(t.run_dir) for t in runs.values()),
                                    "--out", str(tmp_path / "p.png"), "--x", x])
    assert got.exit_code == 0, got.output
    assert (tmp_path / "p.png").read_bytes()[:8] == PNG


def test_a_plot_file_eulergen_did_not_write_is_never_overwritten(runs, tmp_path):
    mine = tmp_path / "mine.png"
    mine.write_bytes(PNG + b"the user's own picture")
    with pytest.raises(EulerError, match="not overwritten"):
        plot_runs(read_runs([t.run_dir for t in runs.values()]), mine)
    assert mine.read_bytes() == PNG + b"the user's own picture"


def test_runs_that_score_different_text_have_nothing_in_common(runs, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((runs["a"].run_dir / "config.json").read_text())
    config["data"]["val_dataset"] = "elsewhere_val.bin"
    (other / "config.json").write_text(json.dumps(config))
    (other / "metrics.jsonl").write_text('{"step": 1, "train_loss": 3.0}\n')
    with pytest.raises(EulerError, match="data.val_dataset: nothing in common"):
        read_runs([runs["a"].run_dir, other])
