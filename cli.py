"""The `eulergen` command line. Each command is a thin shell over a module function;
bad input arrives here as EulerError and is printed as one line (`--debug` shows the
traceback)."""
from __future__ import annotations

import sys
from pathlib import Path

import click

from eulergen.errors import EulerError

ops_option = click.option(
    "--ops", "ops_dirs", multiple=True, type=click.Path(path_type=Path),
    help="Extra directory of op specs (repeatable); also EULERGEN_OPS_PATH.")


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except EulerError as err:
            if ctx.params.get("debug"):
                raise
            click.echo(f"error: {err}", err=True)
            sys.exit(2)
        except OSError as err:
            # the machine's refusals (disk full, a read-only folder, no permission) wherever
            # a command writes or reads that no closer handler names: one line, the file first
            if ctx.params.get("debug") or err.strerror is None:
                raise
            where = f"{err.filename}: " if err.filename else ""
            click.echo(f"error: {where}{err.strerror}", err=True)
            sys.exit(2)


@click.group(cls=_Group)
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
@click.version_option(package_name="eulergen")
def main(debug: bool) -> None:
    """eulergen: CUDA kernels generated from declarative op specs."""


@main.command()
@click.argument("names", nargs=-1)
@ops_option
def check(names: tuple[str, ...], ops_dirs: tuple[Path, ...]) -> None:
    """Check derived backward passes against central differences, and extreme inputs."""
    from eulergen.generator.check import run_check
    sys.exit(run_check(names, ops_dirs))


@main.command()
@click.option("--check", "check_only", is_flag=True,
              help="Write nothing; exit non-zero when generated/ is stale.")
@click.option("--compile", "compile_", is_flag=True,
              help="Also compile every kernel into the runtime's NVRTC cache (needs a GPU).")
@ops_option
def build(check_only: bool, compile_: bool, ops_dirs: tuple[Path, ...]) -> None:
    """Regenerate CUDA kernels, numpy modules and the manifest from the op specs."""
    from eulergen.generator.build import build_sets, display_path, run_build
    status = run_build(ops_dirs, check=check_only, echo=click.echo)
    if compile_ and not check_only:
        # The generator never imports the runtime: the CLI builds, then has it compile.
        try:
            from eulergen.runtime.engine.compile import compile_manifest
            for root, _, _ in build_sets(ops_dirs):
                click.echo(f"compiling kernels of {display_path(root, 'manifest.json')}")
                compile_manifest(root / "manifest.json")
        except ImportError as err:   # CuPy (or the runtime's compile) is not importable
            raise EulerError(f"--compile needs CuPy and a GPU ({err}); install "
                             "'eulergen[cuda13]' (or [cuda12]), or build without --compile"
                             ) from None
    sys.exit(status)


@main.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
def plot(run_dir: Path) -> None:
    """Write RUN_DIR/loss.png: train and validation loss against step."""
    from eulergen.runtime.train.metrics import PLOT_FILE, plot_run
    from eulergen.runtime.train.run_dir import refuse_foreign
    refuse_foreign(run_dir, PLOT_FILE)
    click.echo(f"wrote {plot_run(run_dir)}")


# -- data: prepare, tokenizer (runtime/data/prepare.py, sources.py, tokenizer.py) ----------------

class _TokenCount(click.ParamType):
    """A count of tokens: 20000, 10M, 1.5G."""
    name = "count"
    _SCALE = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9}

    def convert(self, value, param, ctx):
        import re
        match = re.fullmatch(r"(\d+(?:\.\d+)?)([KMG]?)", str(value).strip().upper())
        number = float(match[1]) * self._SCALE[match[2]] if match else 0.0
        if number < 1 or not number.is_integer():
            self.fail(f"{value!r} is not a positive token count (e.g. 20000, 10M, 1.5G)", param, ctx)
        return int(number)


_on_bad_text = click.option(
    "--on-bad-text", type=click.Choice(["stop", "skip"]), default="stop", show_default=True,
    help="A document that is not UTF-8: stop, naming its file and byte offset, or leave it out.")
_text_key = click.option("--text-key", default="text", show_default=True,
                         help="The .jsonl field, .parquet column or dataset field holding the text.")


def _warn(message: str) -> None:
    click.echo(f"warning: {message}", err=True)


def _sources(sources, dataset, subset, split, text_key):
    from eulergen.runtime.data.sources import HubDataset, LocalFiles
    if dataset and sources:
        raise EulerError("give local SOURCES or --dataset, not both", key="--dataset")
    return HubDataset(dataset, subset, split, text_key) if dataset else LocalFiles(list(sources), text_key)


@main.command()
@click.argument("sources", nargs=-1)
@click.option("--out", required=True, type=click.Path(path_type=Path),
              help="Folder for the shards and prepare.json (a rerun continues it).")
@click.option("--dataset", help="Stream a Hugging Face dataset instead, e.g. HuggingFaceFW/fineweb-edu.")
@click.option("--subset", help="The dataset's configuration, e.g. sample-10BT.")
@click.option("--split", default="train", show_default=True)
@_text_key
@click.option("--tokenizer", "tokenizer_spec", default="gpt2", show_default=True,
              help="gpt2, byte, or a tokenizer.json (e.g. from `eulergen tokenizer train`).")
@click.option("--workers", type=click.IntRange(min=1), help="Tokenizing processes [default: cores].")
@click.option("--shard-tokens", type=_TokenCount(), default="100M", show_default=True)
@click.option("--val-tokens", type=_TokenCount(), default="10M", show_default=True,
              help="Tokens in the validation shard, shard 0.")
@_on_bad_text
@click.option("--name", help="Shard file prefix [default: the folder's name].")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def prepare(sources, out, dataset, subset, split, text_key, tokenizer_spec, workers, shard_tokens,
            val_tokens, on_bad_text, name, quiet) -> None:
    """Tokenize text into llm.c shards: SOURCES are .txt (a document a file), .jsonl (a
    document a line), .parquet (a document a row), folders or globs of them."""
    import shlex

    from eulergen.runtime.data.prepare import Settings, progress_bar, train_glob
    from eulergen.runtime.data.prepare import prepare as run_prepare
    from eulergen.runtime.data.tokenizer import tokenizer_named

    source = _sources(sources, dataset, subset, split, text_key)
    tok = tokenizer_named(tokenizer_spec, key="--tokenizer")
    settings = Settings(shard_tokens, val_tokens, on_bad_text, name)
    with progress_bar(source.total_bytes, enabled=not quiet) as progress:
        state = run_prepare(source, out, tok, settings, workers=workers, progress=progress,
                            warn=_warn)
    skipped = f", {state.skipped} left out as not UTF-8" if state.skipped else ""
    click.echo(f"{out}: {len(state.shards)} shards (1 val, {len(state.shards) - 1} train), "
               f"{state.tokens:,} tokens from {state.documents:,} documents{skipped}")
    click.echo("train on it: eulergen train"
               f" --set data.dataset={shlex.quote(train_glob(out, state.settings['name']))}"
               f" --set data.tokenizer={shlex.quote(tok.name)} --set model.vocab_size={tok.vocab_size}")


@main.group()
def tokenizer() -> None:
    """Tokenizers of one's own."""


@tokenizer.command("train")
@click.argument("sources", nargs=-1, required=True)
@click.option("--vocab-size", type=int, required=True, help="Ids, including 256 bytes and <|endoftext|>.")
@click.option("--out", default="tokenizer.json", show_default=True, type=click.Path(path_type=Path))
@_text_key
@_on_bad_text
def tokenizer_train(sources, vocab_size, out, text_key, on_bad_text) -> None:
    """Train a byte-level BPE (GPT-2's kind, Hugging Face tokenizers) on SOURCES, the
    files `eulergen prepare` reads; write it as a tokenizer.json."""
    from eulergen.runtime.data.sources import checked
    from eulergen.runtime.data.tokenizer import train_bpe

    docs = _sources(sources, None, None, "train", text_key).documents()
    tok = train_bpe((d.text for d in checked(docs, on_bad_text, _warn) if d.text), vocab_size, out)
    click.echo(f"wrote {out}: byte-level BPE, {tok.vocab_size} ids, <|endoftext|> = {tok.eot}")
    click.echo(f"use it: eulergen prepare --tokenizer {out} …, and --set data.tokenizer={out}")


# -- training: train, plan, sample (runtime/train/trainer.py, memory.py, sample.py) ----------------

def _run_config(config_path, overrides, run_dir=None, device=None, *, fresh_run_dir=False,
                per_device=True):
    """The run's config; without a file, the built-in default of the device the run resolves
    to (`per_device`; an --init-from run brings its own model)."""
    from eulergen.runtime.train.config import load_config
    extra = [f"run_dir={run_dir}"] if run_dir else []
    extra += [f"training.device={device}"] if device else []
    return load_config(config_path, [*overrides, *extra], fresh_run_dir=fresh_run_dir,
                       finds_gpu=_finds_gpu if per_device else None)


def _finds_gpu() -> bool:
    """Whether training.device auto runs on a GPU here. Quiet: the run's own get_backend
    says why not, once."""
    from eulergen.runtime.engine.backend import get_backend
    return get_backend("auto", notice=lambda line: None).is_gpu


def _default_named(cfg) -> str:
    """', the built-in GPU default' (or CPU): which one a run without a file took."""
    return f", the built-in {cfg.default.upper()} default" if cfg.default else ""


def _resume_config(resume, overrides, device):
    """A resumed run's saved config, with the --set overrides and --device."""
    from eulergen.runtime.train.trainer import resume_config
    return resume_config(resume, [*overrides, *([f"training.device={device}"] if device else [])])


def _library(cfg, ops_dirs, *, build: bool):
    """The OpLibrary for a run: its ops regenerated first where stale (`build`), then the
    built-in manifest and the user ops' manifests loaded over the chosen backend. On a GPU
    the kernels the disk cache lacks start compiling now, side by side, while the run
    starts (runtime/engine/compile.py prefetch): the first launches then find them compiled."""
    from eulergen.runtime.engine.backend import get_backend
    from eulergen.runtime.model.gpt import ops_used
    from eulergen.runtime.engine.ops import OpLibrary

    manifests = []
    if build:
        from eulergen.generator.build import ensure_built
        manifests = ensure_built(ops_used(cfg.model), ops_dirs) or []
    lib = OpLibrary(get_backend(cfg.training.device), manifests)
    if lib.backend.is_gpu:
        from eulergen.runtime.engine.compile import prefetch
        # a name that is no op is left to arch_of, which names the config key at fault
        prefetch(lib.ops[n] for n in (*ops_used(cfg.model), "embedding") if n in lib.ops)
    return lib


def _limit_blas_threads() -> None:
    """One BLAS thread on numpy: on a 2-core machine a second OpenBLAS thread makes the
    model's small GEMMs 10-50x slower whenever the other core is busy. Must run before
    numpy loads OpenBLAS; a user's own setting wins."""
    import os
    if "numpy" not in sys.modules:
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def _resume_import(run: Path):
    """(imported weights, their record) for a resume of an --init-from run that has no
    checkpoint yet (it restarts from those weights, not from its seed), else (None, None)."""
    from eulergen.runtime.train import checkpoint
    from eulergen.runtime.interop import hf
    from eulergen.runtime.train.trainer import recorded_init
    source = recorded_init(run)
    if source is None or checkpoint.latest(run) is not None:
        return None, None
    folder = Path(source["folder"])
    return hf.load_folder(folder if folder.is_dir() else hf.locate(source["init_from"])), source


@main.command()
@click.option("--config", "config_path", type=click.Path(path_type=Path),
              help="NanoEuler JSON or YAML config (default: the built-in small model).")
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE",
              help="Override one config value (repeatable).")
@click.option("--resume", type=click.Path(path_type=Path), metavar="RUN",
              help="Continue the run in folder RUN from its latest checkpoint.")
@click.option("--run-dir", type=click.Path(path_type=Path),
              help="Where the run writes (default: a new runs/<config>-<date>-<time>).")
@click.option("--device", type=click.Choice(["auto", "cuda", "numpy"]))
@click.option("--init-from", metavar="PATH",
              help="Start from a transformers save_pretrained folder (GPT2LMHeadModel or "
                   "LlamaForCausalLM) or a Hub id such as gpt2; the model config is its config.json.")
@click.option("--nproc", type=click.IntRange(min=1), default=1, show_default=True,
              help="Data-parallel ranks on this machine, one per GPU on CuPy (training.batch_size "
                   "is each rank's); under torchrun or srun leave it out.")
@ops_option
def train(config_path, overrides, resume, run_dir, device, init_from, ops_dirs, nproc) -> None:
    """Train a GPT on generated kernels (no arguments: a small byte-level model on the
    standard library's source, a few minutes on a CPU)."""
    _limit_blas_threads()
    from eulergen.runtime.distributed import collective as coll
    from eulergen.runtime.engine import gemm
    from eulergen.runtime.distributed.data_parallel import connect
    from eulergen.runtime.model.memory import format_bytes
    from eulergen.runtime.train.trainer import Trainer

    rv = coll.Rendezvous.from_env()
    if nproc > 1:
        _start_ranks(nproc, rv, config_path, overrides, resume, run_dir, device, init_from,
                     ops_dirs)
        return
    # under a launcher every rank must name the same folder: the config's, not a fresh one
    fresh = rv is None

    imported = source = None
    if resume is not None:
        if config_path is not None or run_dir is not None or init_from is not None:
            raise EulerError("--resume continues a run with its saved config and weights: give "
                             "--set overrides, not --config, --run-dir or --init-from",
                             key="--resume")
        cfg = _resume_config(resume, overrides, device)
        imported, source = _resume_import(resume)
    elif init_from is not None:
        # read and checked in full before the run folder is touched
        from eulergen.runtime.interop import hf
        imported = hf.load_folder(hf.locate(init_from))
        source = {"init_from": str(init_from), "folder": str(imported.folder.resolve())}
        given = _run_config(config_path, [*hf.model_sets(imported), *overrides], run_dir, device,
                            per_device=False)
        sets = hf.run_overrides(imported, given, overrides)
        cfg = _run_config(config_path, [*sets, *overrides], run_dir, device, fresh_run_dir=fresh,
                          per_device=False)
    else:
        # no run folder named: a new one per run, so running the same command twice works;
        # a named folder that holds checkpoints is refused by the Trainer (never overwritten)
        cfg = _run_config(config_path, overrides, run_dir, device, fresh_run_dir=fresh)
    if rv is not None and cfg.training.device != "numpy":
        coll.select_gpu(rv)   # GPU LOCAL_RANK, before any kernel touches a device
    lib = _library(cfg, ops_dirs, build=True)
    collective = connect(rv, lib.backend) if rv is not None else None
    try:
        trainer = Trainer(cfg, lib, resume=resume is not None,
                          initial=imported.params if imported else None, init_from=source,
                          collective=collective)
        if rv is not None and rv.rank:
            trainer.run()   # rank 0 reports
            return
        t = trainer.cfg.training   # training.dtype auto resolved
        ranks = "" if rv is None else \
            f"{rv.world_size} ranks{' (ZeRO-1)' if t.zero else ''} x "
        click.echo(f"eulergen train: {lib.backend.device}{_default_named(cfg)}, "
                   f"{trainer.model.param_total:,} "
                   f"parameters, {ranks}B={t.batch_size} T={t.seq_len} x{t.gradient_accumulation}, "
                   f"{t.dtype}, GEMMs {gemm.describe(lib.backend)}, memory plan "
                   f"{format_bytes(trainer.model.mem.plan.total_bytes)}, run {cfg.run_dir}"
                   + (f", resuming at step {trainer.step}" if resume is not None else ""), err=True)
        result = trainer.run()
    finally:
        if collective is not None:
            collective.close()
    if result.val_losses:
        steps = sorted(result.val_losses)
        click.echo(f"val loss {result.val_losses[steps[0]]:.4f} (step {steps[0]}) -> "
                   f"{result.val_losses[steps[-1]]:.4f} (step {steps[-1]})")
    if result.skipped:
        click.echo(f"updates skipped by the spike guard at steps {result.skipped}")
    click.echo(f"run folder {cfg.run_dir} (continue it: eulergen train --resume {cfg.run_dir} "
               "--set training.total_steps=N)")


def _start_ranks(nproc, rv, config_path, overrides, resume, run_dir, device, init_from,
                 ops_dirs) -> None:
    """--nproc: one run folder named here (each rank would otherwise pick its own), the GPU
    count checked, then the ranks as `python -m eulergen train` (runtime/distributed/workers.py)."""
    from eulergen.runtime.distributed.workers import check_gpus, run_workers
    if rv is not None:
        raise EulerError(f"--nproc starts its own ranks, but this process is already rank "
                         f"{rv.rank} of {rv.world_size} (torchrun, srun): leave --nproc out",
                         key="--nproc")
    cfg = _resume_config(resume, overrides, device) if resume \
        else _run_config(config_path, overrides, run_dir, device, fresh_run_dir=True)
    run_dir = None if resume else cfg.run_dir
    check_gpus(nproc, cfg.training.device)
    args = [*(["--config", str(config_path)] if config_path else []),
            *(a for o in overrides for a in ("--set", o)),
            *(["--resume", str(resume)] if resume else []),
            *(["--run-dir", str(run_dir)] if run_dir else []),
            *(["--device", device] if device else []),
            *(["--init-from", init_from] if init_from else []),
            *(a for d in ops_dirs for a in ("--ops", str(d)))]
    status = run_workers(nproc, args)
    if status:
        raise SystemExit(status)


@main.command()
@click.option("--config", "config_path", type=click.Path(path_type=Path))
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE")
@click.option("--inference", is_flag=True,
              help="Plan the sampler's KV-cache model (no grads, no AdamW; k and v per layer; "
                   "bf16 with training.dtype=bf16, the default on a bf16 GPU).")
@click.option("--nproc", type=click.IntRange(min=1), default=1, show_default=True,
              help="Plan one rank of this many data-parallel ranks (with training.zero=1 each "
                   "holds a share of AdamW's moments).")
@ops_option
def plan(config_path, overrides, inference, nproc, ops_dirs) -> None:
    """Print the memory plan of a run: every buffer, its shape, dtype and bytes, and totals."""
    from rich.console import Console

    from eulergen.runtime.model.arch import arch_of
    from eulergen.runtime.engine.attention import PLAN_SMS
    from eulergen.runtime.engine.backend import NUMPY
    from eulergen.runtime.distributed.buckets import plan_buckets
    from eulergen.runtime.engine.cublas import WORKSPACE_BYTES
    from eulergen.runtime.engine.cuda_ops import workspace_elements
    from eulergen.runtime.generate.decoder import plan_decoder
    from eulergen.runtime.model.memory import plan_table, storage
    from eulergen.runtime.model.gpt import plan_model
    from eulergen.runtime.engine.ops import OpLibrary
    from eulergen.runtime.model.params import param_count

    from eulergen.runtime.train.budget import check_config

    cfg = _run_config(config_path, overrides)
    check_config(cfg)   # a million layers would be a million-layer table
    manifests = []
    if ops_dirs:
        from eulergen.generator.build import ensure_built
        manifests = ensure_built((), ops_dirs) or []
    arch = arch_of(cfg.model, OpLibrary(NUMPY, manifests))   # the manifest alone: no GPU needed
    t = cfg.training
    # a GPU run's plan (a GPU with bf16 tensor cores: training.dtype auto is bf16), the
    # kernels' and cuBLASLt's workspaces included, whatever this machine runs on
    dtype = "float32" if t.dtype == "fp32" else "bf16"
    buckets = None if inference or nproc == 1 else plan_buckets(
        arch, nproc, zero=bool(t.zero), bucket_mb=t.bucket_mb, itemsize=storage(dtype).itemsize)
    p = (plan_decoder(arch, t.batch_size, t.seq_len, dtype=dtype, sms=PLAN_SMS) if inference
         else plan_model(arch, t.batch_size, t.seq_len, workspace=workspace_elements,
                         dtype=dtype, gemm_workspace=WORKSPACE_BYTES, buckets=buckets))
    ranks = "" if buckets is None else \
        f", one rank of {nproc}{' with ZeRO-1' if buckets.zero else ''}"
    title = (f"memory plan{_default_named(cfg)}: {param_count(arch):,} parameters, "
             f"B={t.batch_size}, T={t.seq_len}, "
             f"{'inference (KV cache)' if inference else f'training, {t.dtype}'}{ranks}")
    console = Console()
    if not console.is_terminal:   # piped or captured: never cut a buffer name short
        console = Console(width=120)
    console.print(plan_table(p, title))


def _checkpoint_sampler(run, device, ops_dirs, num_samples: int, dtype: str):
    """The tokenizer and a KV-cache Sampler over a run folder's latest checkpoint (or one
    checkpoint folder, or a transformers folder or Hub id), with the config it was trained
    with. Weights that do not fit the config's model (another architecture, an unpadded
    vocab) are one error naming the weights file and the tensor."""
    _limit_blas_threads()
    from eulergen.runtime.train.evaluate import load_into, open_model
    from eulergen.runtime.generate.sample import Sampler, sampling_dtype
    from eulergen.runtime.data.tokenizer import check_fits, load_tokenizer

    weights = open_model(run, device)
    import numpy as np
    for name, value in weights.params.items():
        if not np.isfinite(value).all():   # every logit would be NaN: nothing to sample
            raise EulerError(f"{name} holds NaN or Inf: these weights cannot be sampled",
                             file=weights.file)
    cfg = weights.cfg
    tok = load_tokenizer(cfg.data)
    check_fits(tok, cfg.model.vocab_size)
    lib = _library(cfg, ops_dirs, build=True)
    dtype = sampling_dtype(dtype, lib.backend)
    _check_sampler_fits(cfg, lib, num_samples, dtype)
    # the context it was trained on: learned positions past training.seq_len never moved
    sampler = Sampler(cfg.model, lib, batch=num_samples, seq_len=cfg.training.seq_len,
                      dtype=dtype, notify=lambda m: click.echo(m, err=True))
    load_into(sampler.decoder, weights)
    return tok, sampler


def _check_sampler_fits(cfg, lib, num_samples: int, dtype: str) -> None:
    """--num-samples is the KV cache's batch: refused before the cache is planned in full
    or allocated when it cannot fit."""
    from eulergen.runtime.train import budget
    from eulergen.runtime.model.arch import arch_of
    from eulergen.runtime.engine.attention import PLAN_SMS
    from eulergen.runtime.generate.decoder import plan_decoder

    seq = cfg.training.seq_len
    if num_samples * seq > budget.MAX_INDEX:
        raise EulerError(f"{num_samples:,} samples of {seq} tokens: at most "
                         f"{budget.MAX_INDEX:,} tokens in one batch", key="--num-samples")
    budget.check_fits(cfg, arch_of(cfg.model, lib), lib.backend,
                      lambda a: plan_decoder(a, num_samples, seq, dtype=dtype,
                                             sms=PLAN_SMS if lib.backend.is_gpu else 0),
                      what="sampling",
                      batch=("--num-samples", num_samples, 1))


def _sampling_options(f):
    for option in reversed([
            click.option("--max-new-tokens", default=200, show_default=True),
            click.option("--temperature", default=0.8, show_default=True,
                         help="0: greedy (always the most likely token)."),
            click.option("--top-k", default=40, show_default=True,
                         help="Draw from the k most likely tokens (0: all)."),
            click.option("--top-p", default=1.0, show_default=True,
                         help="Nucleus: the fewest tokens whose probability reaches p (1: all)."),
            click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True),
            click.option("--device", type=click.Choice(["auto", "cuda", "numpy"])),
            click.option("--dtype", type=click.Choice(["auto", "bf16", "fp32"]), default="auto",
                         show_default=True,
                         help="Weights and KV cache: auto is bf16 on a GPU with bf16 (sm_80+)."),
            ops_option]):
        f = option(f)
    return f


def _settings(temperature, top_k, top_p, seed, max_new_tokens) -> dict:
    """Sampler.samples' settings from the options, checked before a model is loaded."""
    from eulergen.runtime.generate.sample import check_settings
    settings = dict(temperature=temperature, top_k=top_k or None,
                    top_p=None if top_p == 1 else top_p, seed=seed)
    check_settings(settings["temperature"], settings["top_k"], settings["top_p"], max_new_tokens)
    return settings


def _prompt_ids(tok, text: str, key: str) -> list[int]:
    """`text` as ids, refusing text the tokenizer can only encode as its unknown token."""
    at = tok.unknown(text)
    if at is not None:
        raise EulerError(f"character {at} ({text[at]!r}) is not in the tokenizer's vocabulary "
                         f"({tok.name} would encode it as its unknown token)", key=key)
    return tok.encode(text)


def _utf8(text: str, key: str) -> str:
    """Text from the command line or a terminal that must be UTF-8: bytes that are not
    arrive as lone surrogates (Python's surrogateescape), which no tokenizer encodes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        bad = ord(text[err.start]) - 0xDC00 if 0xDC80 <= ord(text[err.start]) <= 0xDCFF else None
        raise EulerError("not UTF-8 text" + (f" (byte 0x{bad:02x} at character {err.start})"
                                             if bad is not None else ""), key=key) from None
    return text


def _printer(tok):
    """(stream, on_step): a TextStream over `tok` and the on_step that prints the first
    row's tokens through it as they come (its end of text not shown); flush at the end."""
    from eulergen.runtime.generate.sample import TextStream
    stream = TextStream(tok.decode)

    def show(tokens):
        if tokens[0] != tok.eot:
            click.echo(stream.push(tokens[0]), nl=False)

    return stream, show


@main.command()
@click.argument("run", type=click.Path(path_type=Path))
@click.option("--prompt", default="\n", show_default=True)
@click.option("--num-samples", type=click.IntRange(min=1), default=1, show_default=True,
              help="Samples of the prompt, generated as one batch.")
@_sampling_options
def sample(run, prompt, num_samples, max_new_tokens, temperature, top_k, top_p, seed, device,
           dtype, ops_dirs) -> None:
    """Continue a prompt with a run folder's latest checkpoint (or one checkpoint folder),
    printing the text as it comes (one sample), or each sample in turn (several); a sample
    ends at the tokenizer's end of text or after --max-new-tokens."""
    settings = _settings(temperature, top_k, top_p, seed, max_new_tokens)
    _utf8(prompt, "--prompt")
    tok, sampler = _checkpoint_sampler(run, device, ops_dirs, num_samples, dtype)
    ids = _prompt_ids(tok, prompt, "--prompt")
    stream, show = _printer(tok)
    live = num_samples == 1
    if live:
        click.echo(prompt, nl=False)
    rows = sampler.samples(ids, max_new_tokens, stop=tok.eot, on_step=show if live else None,
                           **settings)
    if live:
        click.echo(stream.flush())
    else:
        for n, row in enumerate(rows, 1):
            click.echo(f"--- sample {n} of {num_samples}")
            click.echo(prompt + tok.decode(row))
    empty = sum(not row for row in rows)
    if empty:
        _warn(f"{'the sample is' if live else f'{empty} of the samples are'} empty: the model "
              "drew its end of text first")


@main.command()
@click.argument("run", type=click.Path(path_type=Path))
@_sampling_options
def chat(run, max_new_tokens, temperature, top_k, top_p, seed, device, dtype, ops_dirs) -> None:
    """Talk with a checkpoint: each line you type joins the conversation and the model
    continues it until its end of text or --max-new-tokens. Ctrl-D or /quit ends."""
    import itertools

    settings = _settings(temperature, top_k, top_p, seed, max_new_tokens)
    tok, sampler = _checkpoint_sampler(run, device, ops_dirs, 1, dtype)
    for turn in itertools.count():
        click.echo("> ", nl=False)
        raw = sys.stdin.buffer.readline() if hasattr(sys.stdin, "buffer") else sys.stdin.readline()
        try:
            line = raw.decode("utf-8") if isinstance(raw, bytes) else _utf8(raw, "stdin")
        except (UnicodeDecodeError, EulerError):
            _warn("that line is not UTF-8 text: left out")
            continue
        if not line or line.strip() == "/quit":
            click.echo()
            return
        try:
            ids = _prompt_ids(tok, line if line.endswith("\n") else line + "\n", "stdin")
        except EulerError as err:
            _warn(f"{err.message}: that line is left out")
            continue
        stream, show = _printer(tok)
        # the conversation so far stays in the KV cache: each turn appends to it
        sampler.samples(ids, max_new_tokens, stop=tok.eot, on_step=show, append=turn > 0,
                        **{**settings, "seed": seed + turn})
        click.echo(stream.flush())


# -- Hugging Face out, and evaluation (runtime/interop/hf.py, evaluate.py) ---------------------------

@main.command()
@click.argument("run", metavar="RUN_OR_CKPT")
@click.option("--out", required=True, type=click.Path(path_type=Path),
              help="The folder to write (new, empty, or an earlier export).")
def export(run, out) -> None:
    """Write a checkpoint as a transformers folder (GPT2LMHeadModel or LlamaForCausalLM,
    tied embeddings, the vocab unpadded) with the run's tokenizer as tokenizer.json."""
    import json

    from eulergen.runtime.interop import hf
    from eulergen.runtime.train.evaluate import open_model
    from eulergen.runtime.data.tokenizer import hf_tokenizer_json, load_tokenizer

    weights = open_model(run)
    files, eot = {}, None
    try:
        tok = load_tokenizer(weights.cfg.data)
        eot = tok.eot
        text = hf_tokenizer_json(tok)
        files = {hf.TOKENIZER: text,
                 "tokenizer_config.json": json.dumps(hf.tokenizer_config(text, eot)).encode()}
    except EulerError as err:
        _warn(f"no tokenizer written: {err}")
    arch = hf.export_folder(weights.cfg.model, weights.params, out, tokenizer_files=files, eot=eot)
    click.echo(f"wrote {out}: {arch}{' with its tokenizer' if files else ''} "
               f"(transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}))")


@main.command("eval")
@click.argument("run", metavar="RUN_OR_CKPT")
@click.option("--data", "dataset", required=True,
              help="A data.dataset value: a glob of token shards, a .bin file, builtin:stdlib.")
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--seq-len", type=click.IntRange(min=1), help="[default: the run's training.seq_len]")
@click.option("--max-batches", type=click.IntRange(min=1), help="Stop after N batches [default: all].")
@click.option("--device", type=click.Choice(["auto", "cuda", "numpy"]))
@ops_option
def eval_(run, dataset, batch_size, seq_len, max_batches, device, ops_dirs) -> None:
    """Mean cross-entropy and perplexity of a checkpoint (or a transformers folder) over
    every whole window of a dataset (builtin:stdlib: its held-out split)."""
    _limit_blas_threads()
    from eulergen.runtime.train.evaluate import evaluate, open_model

    weights = open_model(run, device)
    seq = seq_len or weights.cfg.training.seq_len
    result = evaluate(weights, _library(weights.cfg, ops_dirs, build=True), dataset,
                      batch=batch_size, seq=seq, max_batches=max_batches)
    click.echo(f"loss {result.loss:.4f}  perplexity {result.perplexity:.3f}  "
               f"({result.tokens:,} tokens, {result.windows:,} windows of {seq})")
