"""What `eulergen export-c --train` continues (runtime/interop/c_train.py's Run): a run's
checkpoint loaded into the numpy trainer's own model and optimizer, for the run's batch,
as a resume would load it, so that the C program is written from their tape, memory plan
and launches, and starts from their arenas."""
from __future__ import annotations

from pathlib import Path

from eulergen.errors import EulerError
from eulergen.runtime.data.loader import resolve_files
from eulergen.runtime.interop import c_train
from eulergen.runtime.model.gpt import allocate
from eulergen.runtime.train import checkpoint, step_control
from eulergen.runtime.train.config import config_from_dict
from eulergen.runtime.train.evaluate import is_hf_folder
from eulergen.runtime.train.optimizer import Optimizer
from eulergen.runtime.train.resolve import resolve
from eulergen.runtime.train.trainer import STATE_KEYS


def checkpoint_of(run: str | Path) -> checkpoint.Checkpoint:
    """The checkpoint `run` names (a run folder: its latest), with what a resume reads;
    refused, in one line, for a transformers folder or Hub id (no optimizer state)."""
    path = Path(run)
    if not path.exists() or is_hf_folder(path):
        raise EulerError("--train continues a run from its checkpoint: a transformers folder "
                         "or Hub id has no optimizer state", file=str(run), key="--train")
    return checkpoint.load(path, require=STATE_KEYS)


def continued(ck: checkpoint.Checkpoint, lib) -> c_train.Run:
    """A checkpoint (checkpoint_of) on `lib` (numpy's, with the run's ops), refused, in one
    line and before its weights are loaded, for what c_train does not cover."""
    state = ck.state
    cfg = config_from_dict(state["config"], source=str(ck.path / checkpoint.STATE_FILE))
    c_train.check_run(cfg, state["data"])
    resolved = resolve(cfg, lib)
    c_train.check_ops(resolved.arch, resolved.optimizer)
    t = resolved.cfg.training
    model = allocate(resolved.arch, lib, resolved.plan, t.batch_size, t.seq_len)
    model.set_accumulation(t.gradient_accumulation)
    model.load_state_dict(ck.params)
    optimizer = Optimizer(model, resolved.optimizer, t)
    optimizer.load_state_dict(ck.optim)
    return c_train.Run(
        cfg=resolved.cfg, config=state["config"], step=ck.step,
        updates=int(state["adam_updates"]), guard=state["spike_guard"], data=state["data"],
        tokenizer_digest=state.get("tokenizer_digest"),
        files=tuple(str(Path(f).resolve()) for f in resolve_files(cfg.data.dataset,
                                                                  split="train")),
        model=model, launches=tuple(optimizer.launches), states=tuple(optimizer.state_tensors()),
        slots=optimizer.slots, rule=step_control.StepRule.of(t, optimizer.slots),
        spike=(step_control.SPIKE_WARMUP, step_control.SPIKE_DECAY))
