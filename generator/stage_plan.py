"""What the kinds whose kernels are one device impl a stage share (pointwise, pair, update:
generator/kinds/): the plan of a stage and of an op (StagePlan, OpPlan), how a stage's entry
points get their signatures, and how a renderer hands a stage to its template."""
from __future__ import annotations

from dataclasses import dataclass

from eulergen.generator import ir
from eulergen.generator.plan import CTYPE, DTYPES
from eulergen.signature import KernelSig, variant_name


@dataclass(frozen=True)
class StagePlan:
    """One stage of an op: a device impl `name` over the pointer operands `loads` (read)
    and `stores` (written), and its entry point for each dtype. A pointwise op's bias
    variant's stage reads `biases` ([cols], among the loads) and writes the partial rows of
    the gradients `partials` (float32); its gemv variant's impl is the epilogue the gemv
    kernels' body applies, an entry point a dtype and row bound."""
    name: str                        # <op>_<label>; the entry points add _<dtype>
    label: str                       # the stage's name: forward, backward_bias, reduce_bias…
    loads: tuple[str, ...]
    stores: tuple[str, ...]
    sigs: tuple[KernelSig, ...]      # in DTYPES order, each with its geometry
    biases: tuple[str, ...] = ()
    partials: tuple[str, ...] = ()


@dataclass(frozen=True)
class OpPlan:
    """Every choice of an op's kernels; render only prints it. `bias`: a pointwise op's bias
    variant (generator/fuse.py): its forward and backward over rows, and the reduce of the
    backward's partial rows. `gemv`: a pointwise op's gemv variant (None: it has none), the
    decoder's few-row GEMM with the op's forward as its epilogue."""
    stages: tuple[StagePlan, ...]
    bias: tuple[StagePlan, ...] = ()
    gemv: StagePlan | None = None

    @property
    def sigs(self) -> tuple[KernelSig, ...]:
        gemv = (self.gemv,) if self.gemv else ()
        return tuple(sig for st in self.stages + self.bias + gemv for sig in st.sigs)


def pointers(dtype: str, loads, stores) -> tuple[tuple[str, str], ...]:
    t = CTYPE[dtype]
    return tuple((n, f"const {t}*") for n in loads) + tuple((n, f"{t}*") for n in stores)


def floats(op: ir.DerivedOp) -> tuple[tuple[str, str], ...]:
    return tuple((p.name, "float") for p in op.params)


def stage(op: ir.DerivedOp, call: str, loads, stores, args, geometry, *, part: str = "",
          fusion: str = "", control: tuple[str, ...] = ()) -> StagePlan:
    """The stage of the op's `call` (its kernels' signature stage) and `part`, of the
    `fusion` variant; `args(dtype)`: the entry point's parameters; `geometry(dtype)`: its
    launch. It is named after the part (or the call) of the variant: forward, reduce_bias."""
    label = variant_name(part or call, fusion)
    name = f"{op.name}_{label}"
    return StagePlan(name, label, tuple(loads), tuple(stores), tuple(
        KernelSig(f"{name}_{dt}", args(dt), dt, call, geometry(dt), part=part, fusion=fusion,
                  control=control)
        for dt in DTYPES))


@dataclass(frozen=True)
class Ptr:
    name: str
    const: str   # "const " or ""


def ptrs(loads, stores) -> list[Ptr]:
    return [Ptr(a, "const ") for a in loads] + [Ptr(a, "") for a in stores]


def title(label: str, loads, stores) -> str:
    return f"{label}: {', '.join(stores)} from {', '.join(loads)}"


def entries(st: StagePlan) -> list[dict]:
    """A stage's entry points, one a dtype: its signature and the C type it instantiates."""
    return [{"sig": sig, "ctype": CTYPE[sig.dtype]} for sig in st.sigs]
