"""The training loop: the optimizer (runtime/train/optimizer.py: training.optimizer, any
update op, AdamW by default), learning-rate schedules, gradient accumulation, global-norm
clipping, a spike guard, validation, checkpoints and resume.

A step runs on the device without the host (runtime/train/step_graph.py: on the GPU a CUDA
graph by default, training.cuda_graph) and its record comes back a step later: the loss
and grad norm that are logged, the spike guard's verdict, and a loss or norm that is not
finite, which stops the run naming the step. Evaluation, checkpoints and the run's end
wait for their step.

Determinism: the weights come from the seed, batches from the seed and the data
position, and nothing else draws a random number, so a run resumed from a checkpoint
(weights, optimizer state, data position, spike-guard state, step) repeats the
uninterrupted run's losses bit for bit on numpy.

Data-parallel (a `collective` of N ranks, runtime/distributed/collective.py): each rank reads its
slice of the global batch; its gradients, divided by N, are summed over the ranks in
buckets as the backward finishes them, its loss joining the last (runtime/distributed/data_parallel.py);
with `training.zero: 1` each rank updates its share and the weights are gathered after.
Every rank takes part in a checkpoint (ZeRO: rank 0 gathers the moments), and rank 0 alone
writes the run folder.
"""
from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from eulergen.errors import EulerError
from eulergen.files import write_atomic
from eulergen.runtime.train import checkpoint, metrics, run_dir, step_control
from eulergen.runtime.train.optimizer import Optimizer
from eulergen.runtime.train.config import RunConfig, TrainingConfig, as_dict, load_config
from eulergen.runtime.data.loader import make_loaders
from eulergen.runtime.distributed.data_parallel import DataParallel
from eulergen.runtime.model.gpt import allocate
from eulergen.runtime.model.params import param_count
from eulergen.runtime.data.prepared import check_prepared_with
from eulergen.runtime.generate.sample import Sampler
from eulergen.runtime.train.step_graph import StepResult, Stepper
from eulergen.runtime.data.tokenizer import check_fits, load_tokenizer
from eulergen.runtime.train.resolve import resolve
from eulergen.userfiles import Fields, read_json

CONFIG_FILE = "config.json"
INIT_FILE = "init_from.json"   # an --init-from run's weights: a resume before its first checkpoint
STATE_KEYS = ("adam_updates", "spike_guard", "data", "config")   # what save() adds to state.json


def learning_rate(t: TrainingConfig, step: int) -> float:
    """The learning rate of step `step` (1-based): linear warmup to learning_rate, then
    cosine / linear decay to min_lr at total_steps, or constant."""
    if step <= t.warmup_steps:
        return t.learning_rate * step / t.warmup_steps
    if t.schedule == "constant":
        return t.learning_rate
    progress = min(1.0, (step - t.warmup_steps) / max(1, t.total_steps - t.warmup_steps))
    if t.schedule == "linear":
        return t.learning_rate - progress * (t.learning_rate - t.min_lr)
    return t.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (t.learning_rate - t.min_lr)


def flops_per_token(a, seq_len: int) -> float:
    """Training FLOPs per token of an Arch (runtime/train/metrics.py's count; the learned
    position table is a lookup, no matmul)."""
    matmul_params = param_count(a) - (0 if a.rope else a.max_seq * a.d)
    return metrics.flops_per_token(matmul_params, a.layers, a.heads, a.head_dim, seq_len)


@dataclass
class Result:
    run_dir: Path
    losses: dict = field(default_factory=dict)      # step -> train loss
    val_losses: dict = field(default_factory=dict)  # step -> val loss
    skipped: list = field(default_factory=list)     # steps whose update the spike guard skipped
    sample: str = ""


class Trainer:
    """One run: the model, its optimizer, the data, the logger. `run()` trains to
    total_steps (or `stop_after`, for tests that stop a run part way)."""

    def __init__(self, cfg: RunConfig, lib, *, resume: bool = False, progress: bool = True,
                 tensorboard: bool = True, cache_dir=None, initial: dict | None = None,
                 init_from: dict | None = None, collective=None):
        self.lib = lib
        self.collective = collective
        self.writer = collective is None or collective.rank == 0   # owns the run folder
        ranks = collective.world_size if collective is not None else 1
        if collective is not None:   # before any work: every rank must train the same run
            collective.check_same(as_dict(cfg), "config")
        resolved = resolve(cfg, lib, ranks=ranks if collective is not None else None)
        cfg = self.cfg = resolved.cfg
        t = cfg.training
        self.run_dir = Path(cfg.run_dir)
        if self.writer:   # the other ranks only read it (rank 0 may hold its lock already)
            run_dir.check(self.run_dir)   # a file, foreign files, another trainer
        ckpt = checkpoint.latest(self.run_dir) if resume else None
        if resume and ckpt is None and not (self.run_dir / CONFIG_FILE).is_file():
            raise EulerError("nothing to resume: no config.json or checkpoint here",
                             file=str(self.run_dir))
        if not resume and checkpoint.latest(self.run_dir) is not None:
            raise EulerError("this run folder holds checkpoints: continue it with "
                             "`eulergen train --resume` or pick another --run-dir",
                             file=str(self.run_dir))
        self.tokenizer = load_tokenizer(cfg.data)
        check_fits(self.tokenizer, cfg.model.vocab_size)
        if self.tokenizer.eot is None:   # as prepare refuses it: documents and samples end in it
            raise EulerError(f"tokenizer {self.tokenizer.name} has no end-of-text token; the data "
                             "and the sampler end each document with one", key="data.tokenizer")
        self.train_data, self.val_data = make_loaders(
            cfg, cache_dir, rank=collective.rank if collective else 0, world_size=ranks)
        # one pass over the folders of both splits: they are mostly one prepared folder
        check_prepared_with([*self.train_data.files, *(self.val_data.files if self.val_data
                                                       else ())], self.tokenizer.name,
                            self.tokenizer.digest)
        if self.val_data is not None and t.eval_every and t.eval_steps > self.val_data.batches:
            # more would only repeat the set, each evaluation taking that much longer
            raise EulerError(f"{t.eval_steps:,} batches, but the validation set holds "
                             f"{self.val_data.batches:,} of B={t.batch_size}, T={t.seq_len}",
                             key="training.eval_steps")
        self.model = allocate(resolved.arch, lib, resolved.plan, t.batch_size, t.seq_len,
                              tf32=t.tf32)
        self.model.set_accumulation(t.gradient_accumulation, ranks)
        self.tokens_per_step = ranks * t.batch_size * t.seq_len * t.gradient_accumulation
        buckets = resolved.buckets
        self.dp = DataParallel(self.model, collective, buckets) if buckets is not None else None
        zero = buckets is not None and buckets.zero
        self.optim = Optimizer(self.model, resolved.optimizer, t, self.dp if zero else None)
        rule = step_control.StepRule.of(t, self.optim.slots, ranks, zero=zero)
        self.stepper = Stepper(self.model, self.optim, rule, cuda_graph=t.cuda_graph, dp=self.dp)
        self.step = 0   # the last step whose result is back; `launched` may be one ahead
        self.result = Result(self.run_dir)
        if ckpt is not None:
            self._restore(checkpoint.load(ckpt, require=STATE_KEYS))
        elif initial is not None:   # `--init-from`: an imported model's weights
            self.model.load_state_dict(initial)
        else:
            self.model.init_weights(t.seed)
        if not self.writer:
            self.lock, self.logger = None, _Quiet()
        else:
            self._open_run_folder(resume, tensorboard, progress, init_from)
        self.launched = self.step
        self.flops_per_token = flops_per_token(self.model.arch, t.seq_len)
        precision = "bf16" if resolved.dtype == "bf16" else "tf32" if t.tf32 else "fp32"
        self.peak = metrics.peak_flops(lib.backend.device, precision) \
            if lib.backend.is_gpu else None

    def _open_run_folder(self, resume, tensorboard, progress, init_from) -> None:
        cfg, t = self.cfg, self.cfg.training
        # held from the first write to the end of run(); the kernel drops it if we die
        self.lock = run_dir.RunLock(self.run_dir).acquire()
        try:
            if init_from is not None:   # where `initial` came from (recorded_init reads it)
                write_atomic(self.run_dir / INIT_FILE, json.dumps(init_from).encode())
            write_atomic(self.run_dir / CONFIG_FILE, json.dumps(as_dict(cfg), indent=1).encode())
            self.logger = metrics.RunLogger(self.run_dir, t.total_steps,
                                            resume_step=self.step if resume else None,
                                            tensorboard=tensorboard, progress=progress)
        except BaseException:
            self.lock.release()
            raise

    # -- checkpoints -------------------------------------------------------------------

    def _restore(self, ck: checkpoint.Checkpoint) -> None:
        try:
            self.model.load_state_dict(ck.params)
        except EulerError as err:   # another width, layers, vocab: name the file
            raise EulerError(err.message, file=str(ck.path / checkpoint.MODEL_FILE),
                             key=err.key) from None
        self.optim.load_state_dict(ck.optim)
        s = ck.state
        self.step = ck.step
        try:
            self.stepper.load_state(int(s["adam_updates"]), s["spike_guard"])
            self.train_data.restore(s["data"])
        except (KeyError, TypeError, ValueError) as err:
            raise EulerError(f"corrupt state: {type(err).__name__} {err} reading adam_updates, "
                             "spike_guard and data", file=str(ck.path / checkpoint.STATE_FILE)) \
                from None

    def save(self) -> Path | None:
        """Checkpoint this step; refused when a weight or moment is NaN or Inf (an update
        that overflowed), so that every checkpoint is one a resume or `sample` can use.
        Data-parallel: every rank calls it (their data positions must agree; ZeRO: their
        shares are gathered to rank 0), rank 0 writes."""
        data = self.train_data.state()
        if self.collective is not None:
            self.collective.check_same(data, "data position")
        if self.dp is not None:
            self.dp.complete_master()
        updates, guard = self.stepper.state()
        optim = self.optim.state_dict()
        if not self.writer:
            return None
        state = {"adam_updates": updates, "spike_guard": guard, "data": data,
                 "config": as_dict(self.cfg), "tokenizer_digest": self.tokenizer.digest}
        params = self.model.state_dict()
        for name, value in (*params.items(), *optim.items()):
            if not np.isfinite(value).all():
                kept = checkpoint.latest(self.run_dir)
                raise EulerError(f"{name} is not finite after step {self.step}: stopped without "
                                 f"saving it, last good checkpoint: {kept or 'none yet'}",
                                 key="training")
        return checkpoint.save(self.run_dir, self.step, params, optim, state,
                               self.cfg.training.keep_checkpoints)

    # -- the loop ----------------------------------------------------------------------

    def train_step(self) -> None:
        """Launch the next optimizer step over gradient_accumulation micro-batches, without
        waiting for it (its result comes back through `_finish`)."""
        t = self.cfg.training
        step = self.launched + 1
        batches = [self.train_data.next_batch() for _ in range(t.gradient_accumulation)]
        self.stepper.launch(step, batches, learning_rate(t, step))
        self.launched = step

    def evaluate(self) -> float | None:
        if self.val_data is None or not self.writer:   # only rank 0 logs it
            return None
        self.val_data.reset()
        losses = []
        for _ in range(self.cfg.training.eval_steps):
            x, y = self.val_data.next_batch()
            self.model.load_tokens(x, y)
            losses.append(float(self.model.loss()[0]))
        return float(np.mean(losses))

    def run(self, stop_after: int | None = None) -> Result:
        t = self.cfg.training
        last = min(stop_after if stop_after is not None else t.total_steps, t.total_steps)
        try:
            self.logger.start()
            while self.step < last:
                self.train_step()
                while len(self.stepper.pending) > 1:   # the step before: done, or nearly
                    self._finish(self.stepper.result())
                if self._waits(self.launched, last):   # evaluation, a checkpoint, the end
                    self._finish(self.stepper.result())
            self.logger.done()   # the bar's last frame, then what the run says after it
            if self.step == t.total_steps and t.sample_tokens and self.writer:
                self.result.sample = self.sample(t.sample_tokens)
                self.logger.print(f"sample:\n{self.result.sample}")
            if self.writer and self.result.losses and importlib.util.find_spec("matplotlib"):
                metrics.plot_run(self.run_dir)   # a convenience: no matplotlib, no PNG
        finally:
            self.logger.close()
            if self.lock is not None:
                self.lock.release()
        return self.result

    def _waits(self, step: int, last: int) -> bool:
        """Whether step `step` is waited for before the next is launched: it is evaluated,
        checkpointed or the run's last."""
        return step == last or self._evaluates(step) or self._checkpoints(step)

    def _evaluates(self, step: int) -> bool:
        t = self.cfg.training
        return bool(t.eval_every) and (step % t.eval_every == 0 or step == t.total_steps)

    def _checkpoints(self, step: int) -> bool:
        t = self.cfg.training
        return bool(t.checkpoint_every and step % t.checkpoint_every == 0) \
            or step == t.total_steps

    def _finish(self, r: StepResult) -> None:
        """A step's result, back from the device: a loss or norm that is not finite stops
        the run; else its loss, the spike guard's message, its log line and, at its step,
        evaluation and the checkpoint."""
        t = self.cfg.training
        if r.not_finite:
            kept = checkpoint.latest(self.run_dir)
            raise EulerError(f"{r.skipped} at step {r.step}; stopped, last good checkpoint: "
                             f"{kept or 'none yet'}", key="training")
        self.step = r.step
        self.result.losses[self.step] = r.loss
        if r.skipped is not None:
            self.result.skipped.append(self.step)
            self.logger.print(f"step {self.step}: update skipped, {r.skipped}")
        record = {}
        # the last step too, so that a run's records end with its tokens and wall time
        if self.step % t.log_every == 0 or self.step in (1, t.total_steps) \
                or r.skipped is not None:
            tps = t.batch_size * t.seq_len * t.gradient_accumulation / r.seconds
            record = dict(train_loss=r.loss, lr=learning_rate(t, self.step), grad_norm=r.norm,
                          tokens_per_s=tps, ms_per_step=1e3 * r.seconds,
                          mfu=tps * self.flops_per_token / self.peak if self.peak else None,
                          skipped=int(r.skipped is not None))
        if self._evaluates(self.step):
            val = self.evaluate()
            if val is not None:
                self.result.val_losses[self.step] = val
                record["val_loss"] = val
        if record:
            self.logger.log(self.step, tokens=self.step * self.tokens_per_step, **record)
        # every rank (save() writes on rank 0); bf16 ZeRO: it makes rank 0's master whole
        # for sample() too
        if self._checkpoints(self.step):
            self.save()

    def sample(self, n: int) -> str:
        """A top-k continuation of the first tokens of the validation text."""
        data = self.val_data or self.train_data
        prompt = np.asarray(data.shards[0][:min(16, self.cfg.training.seq_len // 4)],
                            dtype=np.int64)
        # the weights the training tape reads, in their dtype: nothing is copied
        in_bf16 = self.model.bf16
        sampler = Sampler(self.model.arch, self.lib, seq_len=self.cfg.training.seq_len,
                          params=self.model.mem.arenas["params_bf16" if in_bf16 else "params"],
                          dtype="bf16" if in_bf16 else "float32")
        ids = sampler.generate(prompt, n, top_k=40, temperature=0.8, seed=self.cfg.training.seed)
        if self.tokenizer.vocab_size < self.cfg.model.vocab_size:
            return " ".join(map(str, ids))
        return self.tokenizer.decode(list(prompt) + list(ids))


class _Quiet:
    """The logger of a rank other than 0: rank 0 alone writes metrics and progress."""

    def log(self, step: int, **values) -> dict:
        return values

    def start(self) -> None:
        pass

    def done(self) -> None:
        pass

    def print(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def resume_config(run_dir: str | Path, overrides=()) -> RunConfig:
    """A run's saved config, with `section.key=value` overrides (e.g. more total_steps);
    the run stays in `run_dir` wherever it was first written."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.exists():   # there but no file: the reader says what it is
        raise EulerError(f"no {CONFIG_FILE}: not a run folder", file=str(run_dir))
    return load_config(path, [*overrides, f"run_dir={run_dir}"])


def recorded_init(run_dir: str | Path) -> dict | None:
    """What an --init-from run recorded of its weights' source (`init_from=` above), or None
    for a run that started from its seed."""
    path = Path(run_dir) / INIT_FILE
    if not path.exists():
        return None
    record = Fields(read_json(path, "run record"), str(path))
    return {key: record.text(key) for key in ("init_from", "folder")}
