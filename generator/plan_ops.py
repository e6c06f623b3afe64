"""The plans of pointwise, pair, update and embedding ops: every per-kernel choice (stages,
pointer operands, signatures, launch geometry) as frozen values, made before anything is
rendered (generator/render.py only prints them). The numbers come from generator/plan.py;
row and attention ops are planned by generator/plan_row.py and plan_attention.py."""
from __future__ import annotations

from dataclasses import dataclass

from eulergen.errors import EulerError
from eulergen.generator import fuse, ir
from eulergen.generator.plan import (CTYPE, DTYPES, EMBEDDING_FETCH, EMBEDDING_LONG_ROWS,
                                     EMBEDDING_MERGE_GROUP, EMBEDDING_MERGE_MIN_BLOCKS,
                                     EMBEDDING_WTE_WARP_ROWS, WGRAD_REDUCE_LAUNCH,
                                     arithmetic_light, bias_launch, embedding_launch,
                                     pair_launch, pointwise_launch, reduce_args, update_launch)
from eulergen.generator.plan_attention import AttentionPlan, plan_attention
from eulergen.generator.plan_row import RowPlan, plan_row
from eulergen.kinds import KINDS
from eulergen.signature import KernelSig, select, variant_name


@dataclass(frozen=True)
class StagePlan:
    """One stage of a pointwise, pair or update op: a device impl `name` over the pointer
    operands `loads` (read) and `stores` (written), and its entry point for each dtype. A
    bias variant's stage reads `biases` ([cols], among the loads) and writes the partial
    rows of the gradients `partials` (float32)."""
    name: str                        # <op>_<label>; the entry points add _<dtype>
    label: str                       # the stage's name: forward, backward_bias, reduce_bias…
    loads: tuple[str, ...]
    stores: tuple[str, ...]
    sigs: tuple[KernelSig, ...]      # in DTYPES order, each with its geometry
    biases: tuple[str, ...] = ()
    partials: tuple[str, ...] = ()


@dataclass(frozen=True)
class OpPlan:
    """Every choice of a pointwise, pair or update op's kernels; render only prints it.
    `bias`: a pointwise op's bias variant (generator/fuse.py): its forward and backward over
    rows, and the reduce of the backward's partial rows."""
    template: str
    stages: tuple[StagePlan, ...]
    bias: tuple[StagePlan, ...] = ()

    @property
    def sigs(self) -> tuple[KernelSig, ...]:
        return tuple(sig for st in self.stages + self.bias for sig in st.sigs)


def plan_op(op: ir.DerivedOp) -> RowPlan | OpPlan | AttentionPlan:
    """The plan of an op of kind pointwise, row, pair, update or attention."""
    planners = {"pointwise": plan_pointwise, "row": plan_row, "pair": plan_pair,
                "update": plan_update, "attention": plan_attention}
    if op.kind not in planners:
        raise EulerError(f"no CUDA template for kind {op.kind!r}", file=op.where.file,
                         line=op.where.line, key="kind")
    return planners[op.kind](op)


def _pointers(dtype: str, loads, stores) -> tuple[tuple[str, str], ...]:
    t = CTYPE[dtype]
    return tuple((n, f"const {t}*") for n in loads) + tuple((n, f"{t}*") for n in stores)


def _floats(op: ir.DerivedOp) -> tuple[tuple[str, str], ...]:
    return tuple((p.name, "float") for p in op.params)


def _stage(op: ir.DerivedOp, stage: str, loads, stores, args, geometry, *, part: str = "",
           fusion: str = "") -> StagePlan:
    """`args(dtype)`: the entry point's parameters; `geometry(dtype)`: its launch. Its name
    is the part's (or the stage's) of the fused variant: forward, reduce_bias."""
    label = variant_name(part or stage, fusion)
    name = f"{op.name}_{label}"
    return StagePlan(name, label, tuple(loads), tuple(stores), tuple(
        KernelSig(f"{name}_{dt}", args(dt), dt, stage, geometry(dt), part=part, fusion=fusion)
        for dt in DTYPES))


def plan_pointwise(op: ir.DerivedOp) -> OpPlan:
    body: ir.PointwiseDerived = op.body
    ins = [o.name for o in op.inputs]
    outs = [o.name for o in op.outputs]
    grads = [f"d{o.name}" for o in op.inputs if o.differentiable]
    # The backward reads the inputs, any forward output it chose to reuse, and d<out>.
    bwd_reads = ins + [o for o in outs if o in body.backward.uses] + [f"d{o}" for o in outs]
    stages = [("forward", ins, outs, body.forward)]
    if grads:
        stages.append(("backward", bwd_reads, grads, body.backward))
    planned = []
    for stage, loads, stores, code in stages:
        light = arithmetic_light(code)
        planned.append(_stage(
            op, stage, loads, stores,
            lambda dt: _pointers(dt, loads, stores) + _floats(op) + (("n", "long long"),),
            lambda dt: pointwise_launch(dt, len(loads), light)))
    return OpPlan(KINDS["pointwise"].template, tuple(planned), _bias_stages(fuse.bias_variant(op)))


def _bias_stages(op: ir.DerivedOp) -> tuple[StagePlan, ...]:
    """The bias variant's stages: forward_bias and backward_bias over [rows, cols] operands
    and [cols] biases (plan.bias_launch), each an entry point for 16-byte access throughout
    and an `_unaligned` one for any; the backward's bias gradients as partial rows that
    reduce_bias sums in a fixed order."""
    body: ir.PointwiseDerived = op.body
    ins = [o.name for o in op.inputs]
    biases = tuple(o.name for o in op.inputs if o.role == "bias")
    outs = [o.name for o in op.outputs]
    grads = [f"d{o.name}" for o in op.inputs if f"d{o.name}" in body.backward.names]
    stages = [("forward", ins, outs, ())]
    if grads:
        partials = tuple(g for g in grads if g[1:] in biases)
        stages.append(("backward", ins + [f"d{o}" for o in outs],
                       [g for g in grads if g not in partials], partials))
    planned = []
    for stage, loads, stores, partials in stages:
        label = variant_name(stage, "bias")
        args = {dt: _pointers(dt, loads, stores)
                + tuple((f"{g}_partials", "float*") for g in partials)
                + _floats(op) + (("rows", "long long"), ("cols", "int")) for dt in DTYPES}
        sigs = tuple(KernelSig(f"{op.name}_{label}{'' if aligned else '_unaligned'}_{dt}",
                               args[dt], dt, stage, bias_launch(dt, stage, aligned),
                               fusion="bias")
                     for dt in DTYPES for aligned in (True, False))
        planned.append(StagePlan(f"{op.name}_{label}", label, tuple(loads), tuple(stores),
                                 sigs, biases, partials))
    if grads:
        planned.append(_stage(op, "backward", ["partials"], ["dw"], reduce_args,
                              lambda dt: WGRAD_REDUCE_LAUNCH, part="reduce", fusion="bias"))
    return tuple(planned)


# What each index role of a pair op is at a pair (b, t, h, k) of a [B, T, H, D] tensor
# (templates/pair.cu.j2 names them so).
PAIR_INDEX = {"position": "t_ + pos0_", "pair": "k_", "head_dim": "D_", "head": "h_"}


def plan_pair(op: ir.DerivedOp) -> OpPlan:
    body: ir.PairDerived = op.body
    for o in op.inputs + op.outputs:
        if o.role != "pair":
            raise EulerError(f"pair op operand {o.name!r} has role {o.role!r} (only 'pair' "
                             "operands are supported)", file=op.where.file, line=op.where.line,
                             key="inputs")
    for name, role in body.index:
        if role not in PAIR_INDEX:
            raise EulerError(f"index {name!r} has unknown role {role!r} (expected one of "
                             f"{', '.join(PAIR_INDEX)})", file=op.where.file,
                             line=op.where.line, key="index")
    ins = [o.name for o in op.inputs]
    outs = [o.name for o in op.outputs]
    uses = body.backward.uses
    reads = [n for n in ins + outs if {f"{n}0", f"{n}1"} & uses] + [f"d{o}" for o in outs]
    grads = [f"d{o.name}" for o in op.inputs if o.differentiable]

    def args(loads, stores):
        def of(dt):
            strided = ()
            for name, ctype in _pointers(dt, loads, stores):
                strided += ((name, ctype), (f"{name}_sb", "long long"),
                            (f"{name}_st", "long long"), (f"{name}_sh", "long long"))
            return strided + _floats(op) + tuple((n, "int") for n in ("B", "T", "H", "D", "pos0"))
        return of
    stages = [_stage(op, "forward", ins, outs, args(ins, outs), pair_launch)]
    if grads:
        stages.append(_stage(op, "backward", reads, grads, args(reads, grads), pair_launch))
    return OpPlan(KINDS["pair"].template, tuple(stages))


def update_control(op: ir.DerivedOp) -> tuple[str, ...]:
    """The slots of an update op's `control` array (float32 on the device), which its
    kernels and its numpy step read instead of scalar arguments (written on the device once
    a step, so that a captured step replays with new values): kinds.py's skip and
    grad_scale, then the op's runtime params in spec order."""
    return KINDS["update"].control + tuple(p.name for p in op.params if p.default is None)


def update_weight(op: ir.DerivedOp) -> str:
    """The state input that is the model's weight: the first one. A bf16 plan's step also
    writes its bf16 copy (`<weight>_bf16`), the array the model's kernels read."""
    return next(o.name for o in op.inputs if o.role == "state")


def plan_update(op: ir.DerivedOp) -> OpPlan:
    """State is float32 in every variant; grads are the storage dtype, scaled by the
    control's grad_scale as they are read. The bf16 variant also writes the weight's bf16
    copy (a null pointer: none)."""
    for o in op.inputs:
        if o.role not in ("state", "grad"):
            raise EulerError(f"update op input {o.name!r} has role {o.role!r} (expected "
                             "'state' or 'grad')", file=op.where.file, line=op.where.line,
                             key="inputs")
    state = [o.name for o in op.inputs if o.role == "state"]
    for r in op.body.step.names:
        if r not in state:
            raise EulerError(f"update result {r!r} is not a state input", file=op.where.file,
                             line=op.where.line, key=f"update.{r}")
    if not state:
        raise EulerError("an update op needs a state input (the weight it updates)",
                         file=op.where.file, line=op.where.line, key="inputs")
    control, copy = update_control(op), f"{update_weight(op)}_bf16"
    taken = {o.name for o in op.inputs} | {p.name for p in op.params}
    for name in (*KINDS["update"].control, "control", copy):
        if name in taken:
            raise EulerError(f"{name!r} names the update kernels' own argument; rename the "
                             "input or param", file=op.where.file, line=op.where.line,
                             key="inputs" if name in {o.name for o in op.inputs} else "params")
    fixed = tuple((p.name, "float") for p in op.params if p.default is not None)

    def args(dt):
        pointers = tuple((o.name, f"const {CTYPE[dt]}*" if o.role == "grad" else "float*")
                         for o in op.inputs)
        if dt == "bf16":
            pointers += ((copy, f"{CTYPE[dt]}*"),)
        return pointers + (("control", "const float*"),) + fixed + (("n", "long long"),)
    name = f"{op.name}_step"
    return OpPlan(KINDS["update"].template, (StagePlan(
        name, "step", tuple(o.name for o in op.inputs), tuple(state), tuple(
            KernelSig(f"{name}_{dt}", args(dt), dt, "step", update_launch(dt), control=control)
            for dt in DTYPES)),))


@dataclass(frozen=True)
class EmbeddingPlan:
    """The embedding's kernels (templates/embedding.cu.j2): the forward's and each of the
    backward's parts' entry point for each dtype, and the constants of the template its
    geometry does not hold."""
    sigs: tuple[KernelSig, ...]
    fetch: int = EMBEDDING_FETCH
    merge_group: int = EMBEDDING_MERGE_GROUP
    merge_min_blocks: int = EMBEDDING_MERGE_MIN_BLOCKS
    warp_rows: int = EMBEDDING_WTE_WARP_ROWS
    long_rows: int = EMBEDDING_LONG_ROWS

    def sig(self, part: str, dtype: str = DTYPES[0]) -> KernelSig:
        """The backward's `part` kernel (the forward's: part '')."""
        (sig,) = select(self.sigs, "backward" if part else "forward", dtype, part=part)
        return sig


def _embedding_args(part: str, c: str) -> tuple[tuple[str, str], ...]:
    """The parameters of the forward (part '') or one part of the backward over storage C
    type `c`."""
    return {
        "": (("ids", "const int*"), ("wte", f"const {c}*"), ("wpe", f"const {c}*"),
             ("out", f"{c}*"), ("BT", "long long"), ("T", "int"), ("C", "int"), ("V", "int")),
        "sort": (("ids", "const int*"), ("tiled", "long long*"), ("first", "int*"),
                 ("runs", "int*"), ("n", "int"), ("V", "int")),
        "merge": (("tiled", "const long long*"), ("keys", "long long*"), ("first", "int*"),
                  ("n", "int")),
        "wte": (("dout", f"const {c}*"), ("keys", "const long long*"), ("first", "const int*"),
                ("runs", "int*"), ("dwte", f"{c}*"), ("n", "int"), ("V", "int"), ("C", "int"),
                ("vec", "int"), ("accumulate", "int")),
        "wte_long": (("dout", f"const {c}*"), ("keys", "const long long*"),
                     ("first", "const int*"), ("runs", "const int*"), ("dwte", f"{c}*"),
                     ("n", "int"), ("C", "int"), ("vec", "int"), ("accumulate", "int")),
        "wpe": (("dout", f"const {c}*"), ("dwpe", f"{c}*"), ("B", "int"), ("T", "int"),
                ("C", "int"), ("accumulate", "int")),
    }[part]


# The forward (''), then the backward's kernels in launch order.
EMBEDDING_PARTS = ("", "sort", "merge", "wte", "wte_long", "wpe")


def embedding_label(stage: str, part: str) -> str:
    """An embedding kernel's name without the op and the dtype, as the template names its
    signatures: forward, backward_sort, …"""
    return f"{stage}_{part}" if part else stage


def plan_embedding() -> EmbeddingPlan:
    stages = [("backward" if part else "forward", part) for part in EMBEDDING_PARTS]
    return EmbeddingPlan(tuple(
        KernelSig(f"embedding_{embedding_label(stage, part)}_{dt}",
                  _embedding_args(part, CTYPE[dt]), dt, stage, embedding_launch(part, dt),
                  part=part)
        for dt in DTYPES for stage, part in stages))
