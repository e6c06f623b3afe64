"""A run's config resolved once, before anything is allocated: the architecture (the ops
it names checked against the library; its graph with it), the optimizer's update ops, the
storage dtype, data parallel's gradient buckets and the memory plan, in one frozen value. The trainer is built
from it and `eulergen plan` prints its plan: one function makes both, so the two agree.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from eulergen.runtime.distributed.buckets import BucketPlan, plan_buckets
from eulergen.runtime.engine.attention import PLAN_SMS
from eulergen.runtime.engine.bf16 import plan_dtype
from eulergen.runtime.generate.decoder import decode_sms, plan_decoder
from eulergen.runtime.model.arch import Arch, arch_of
from eulergen.runtime.model.memory import Plan, storage
from eulergen.runtime.model.optimizer_plan import UpdateOps, update_ops
from eulergen.runtime.model.plan import Precision, plan_on
from eulergen.runtime.train import budget
from eulergen.runtime.train.config import RunConfig, TrainingConfig


@dataclass(frozen=True)
class Resolved:
    cfg: RunConfig                 # training.dtype auto resolved: what the run trains in
    arch: Arch                     # the graph: arch.graph
    dtype: str                     # the plan's storage dtype, "float32" or "bf16"
    buckets: BucketPlan | None     # data parallel's; None: one process
    plan: Plan
    optimizer: UpdateOps | None    # training.optimizer's ops; None: an inference plan


def resolve(cfg: RunConfig, lib, *, ranks: int | None = None, for_gpu: bool = False,
            inference: bool = False) -> Resolved:
    """`cfg` checked against the fixed bounds and `lib`'s ops, then planned for `lib`'s
    backend, refused (naming the key to lower) where this machine's memory cannot hold
    it. `ranks`: data-parallel ranks (None: not data parallel). `for_gpu`: the plan of a
    GPU run on any machine, as `eulergen plan` prints it (bf16 unless training.dtype is
    fp32, the kernels' and cuBLAS's workspaces; this machine's memory not consulted).
    `inference`: the plan of the sampler's KV-cache model at the training batch and
    context instead (runtime/generate/decoder.py)."""
    budget.check_config(cfg)   # a million layers would be a million-layer plan
    arch = arch_of(cfg.model, lib)   # a config the ops cannot run fails here, before any work
    t = cfg.training
    optimizer = None if inference else update_ops(lib, t.optimizer)
    gpu_plan = for_gpu and not lib.backend.is_gpu
    dtype = ("float32" if t.dtype == "fp32" else "bf16") if gpu_plan \
        else plan_dtype(t.dtype, lib.backend)   # and bf16 where it cannot run
    if t.dtype == "auto":   # the run records what it trains in: a resume repeats it
        t = replace(t, dtype="bf16" if dtype == "bf16" else "fp32")
        cfg = replace(cfg, training=t)

    grads = Precision(dtype, t.precision).grads

    def buckets_of(a):
        return None if ranks is None or inference else plan_buckets(
            a, ranks, zero=bool(t.zero), bucket_mb=t.bucket_mb, itemsize=storage(grads).itemsize)

    def plan(a, buckets):
        if inference:
            return plan_decoder(a, t.batch_size, t.seq_len, dtype=dtype,
                                sms=PLAN_SMS if gpu_plan else decode_sms(lib.backend))
        return plan_on(lib, a, t.batch_size, t.seq_len, dtype=dtype, precision=t.precision,
                       buckets=buckets, for_gpu=for_gpu, recompute=t.recompute,
                       optimizer=optimizer)

    if not gpu_plan:   # from the plans of one and two layers: no million-layer plan made
        budget.check_fits(cfg, arch, lib.backend, lambda a: plan(a, buckets_of(a)),
                          what="sampling" if inference else "training",
                          batch=("training.batch_size", t.batch_size, TrainingConfig.batch_size))
    buckets = buckets_of(arch)
    return Resolved(cfg, arch, dtype, buckets, plan(arch, buckets), optimizer)
