"""The embedding: token (and position) lookup, out[b, t] = wte[ids[b, t]] (+ wpe[t]), and a
deterministic backward that sorts the ids on the device. No formula, so no spec: one op,
named after its kind, planned and printed from templates/embedding.cu.j2 alone; it has no
numpy module (the runtime's embedding kind holds its numpy reference)."""
from __future__ import annotations

from dataclasses import dataclass

from eulergen.generator import c_text, ir
from eulergen.generator.emit import dtype_values
from eulergen.generator.kinds.base import OpKind
from eulergen.generator.plan import (CTYPE, DTYPES, EMBEDDING_FETCH, EMBEDDING_LONG_ROWS,
                                     EMBEDDING_MERGE_GROUP, EMBEDDING_MERGE_MIN_BLOCKS,
                                     EMBEDDING_WTE_WARP_ROWS, embedding_launch)
from eulergen.signature import CFunction, KernelSig, select

# The forward (''), then the backward's kernels in launch order.
PARTS = ("", "sort", "merge", "wte", "wte_long", "wpe")


@dataclass(frozen=True)
class EmbeddingPlan:
    """The embedding's kernels: the forward's and each of the backward's parts' entry point
    for each dtype, and the constants of the template its geometry does not hold."""
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


class Embedding(OpKind):
    name = "embedding"
    template = templates = "embedding.cu.j2"
    spec = False
    inputs = (ir.Operand("ids", "index", False), ir.Operand("wte", "weight"),
              ir.Operand("wpe", "weight"))
    outputs = (ir.Operand("out", "row"),)

    def render_alone(self, header):
        """Token/position embedding kernels, printed from plan_embedding()."""
        plan = plan_embedding()
        # a dtype's kernels as the template names them: forward, backward_sort, …
        dtypes = [dict(d, sigs={_label(k.stage, k.part): k for k in plan.sigs
                                if k.dtype == d["name"]}) for d in dtype_values(DTYPES)]
        tile = plan.sig("sort").geometry.tile   # the geometry is alike in each dtype
        source = self.render_template(
            header=header, dtypes=dtypes, fetch=plan.fetch, tile=tile,
            tile_steps=tile.bit_length(), merge_group=plan.merge_group,
            merge_min_blocks=plan.merge_min_blocks, warp_rows=plan.warp_rows,
            long_run=plan.sig("wte_long").geometry.long_run,
            long_threads=plan.sig("wte_long").geometry.threads, long_rows=plan.long_rows)
        return ir.RenderedCuda(source, plan.sigs)

    def c_alone(self, header):
        """The forward, with the arguments of its kernels."""
        fn = CFunction("embedding_forward", plan_embedding().sig("").args, "forward")
        text = [c_text.opening(fn),
                "  for (long long r_ = 0; r_ < BT; ++r_) {",
                "    const float* row_ = wte + (long long)ids[r_] * C;",
                "    const float* at_ = wpe ? wpe + (r_ % T) * C : 0;",
                "    for (int c_ = 0; c_ < C; ++c_)",
                "      out[r_ * C + c_] = at_ ? row_[c_] + at_[c_] : row_[c_];",
                "  }", "}", ""]
        about = ("embedding: out[r] = wte[ids[r]] (+ wpe[r % T] where wpe is not null) for BT "
                 "rows of C columns; ids are in [0, V), which the caller checks.")
        return ir.RenderedC(c_text.source(header, about, text), (fn,))

    def c_train_alone(self, header):
        """The backward, as the numpy reference sums it (runtime/engine/kinds/embedding.py)."""
        fn = CFunction("embedding_backward", (
            ("ids", "const int*"), ("dout", "const float*"), ("dwte", "float*"),
            ("dwpe", "float*"), ("BT", "long long"), ("T", "int"), ("C", "int"), ("V", "int"),
            ("P", "int"), ("add_wte", "int"), ("add_wpe", "int")), "backward")
        text = [c_text.opening(fn),
                "  if (!add_wte)",
                "    for (long long e_ = 0; e_ < (long long)V * C; ++e_) dwte[e_] = 0.0f;",
                "  for (long long r_ = 0; r_ < BT; ++r_) {   /* in token order */",
                "    float* row_ = dwte + (long long)ids[r_] * C;",
                "    for (int c_ = 0; c_ < C; ++c_) row_[c_] += dout[r_ * C + c_];",
                "  }",
                "  if (!dwpe) return;",
                "  if (!add_wpe)",
                "    for (long long e_ = (long long)T * C; e_ < (long long)P * C; ++e_) "
                "dwpe[e_] = 0.0f;",
                "  for (int t_ = 0; t_ < T; ++t_)",
                "    for (int c_ = 0; c_ < C; ++c_) {",
                "      float sum_ = dout[(long long)t_ * C + c_];   /* over the batch, in order */",
                "      for (long long b_ = 1; b_ < BT / T; ++b_) sum_ += dout[(b_ * T + t_) * C + c_];",
                "      dwpe[(long long)t_ * C + c_] = add_wpe ? dwpe[(long long)t_ * C + c_] + sum_ "
                ": sum_;",
                "    }",
                "}", ""]
        about = ("embedding: the backward of out[r] = wte[ids[r]] (+ wpe[r % T]) over BT rows of "
                 "C columns: dwte[ids[r]] += dout[r] in token order, and dwpe[t] the sum over "
                 "the batch of dout at t (dwpe null: no positions), each added to the gradient "
                 "where add_wte, add_wpe say so, else written (dwte's V rows, dwpe's P, zero "
                 "where no token adds).")
        return ir.RenderedC(c_text.source(header, about, text), (fn,))


KIND = Embedding()


def _label(stage: str, part: str) -> str:
    """A kernel's name without the op and the dtype, as the template names its signatures:
    forward, backward_sort, …"""
    return f"{stage}_{part}" if part else stage


def _args(part: str, c: str) -> tuple[tuple[str, str], ...]:
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


def plan_embedding() -> EmbeddingPlan:
    stages = [("backward" if part else "forward", part) for part in PARTS]
    return EmbeddingPlan(tuple(
        KernelSig(f"embedding_{_label(stage, part)}_{dt}", _args(part, CTYPE[dt]), dt, stage,
                  embedding_launch(part, dt), part=part)
        for dt in DTYPES for stage, part in stages))
