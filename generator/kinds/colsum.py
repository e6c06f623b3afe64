"""Column sums of a [rows, cols] matrix (templates/colsum.cu.j2): a Linear layer's bias
gradient db (+)= 1ᵀ·dy on the GPU, where cuBLASLt's bias-gradient epilogue does not write it
(added to on a later micro-step, or float32 from a bf16 dy: autocast) and a GEMM against a
row of ones reads dy far below copy bandwidth. A sum, so no formula and no spec: one op,
named after its kind, rendered from its template alone, with no numpy module (its numpy form
is the tape's 1ᵀ·dy GEMM; runtime/engine/colsum.py launches these). Deterministic, without
float atomics: row groups write float32 partial rows that the reduce sums in a fixed order,
as the bias variants of the pointwise ops do. `partials` per input dtype, aligned or not;
`reduce` per output dtype (autocast: float32 from bf16)."""
from __future__ import annotations

from eulergen.generator.kinds.support import Support
from eulergen.generator.plan import CTYPE, DTYPES, WGRAD_REDUCE_LAUNCH, colsum_launch, reduce_args
from eulergen.signature import KernelSig


def _partials_args(c: str) -> tuple[tuple[str, str], ...]:
    """x [rows, cols] with row stride ld (storage C type `c`), partials [G, cols] float32."""
    return (("x", f"const {c}*"), ("ld", "long long"), ("partials", "float*"),
            ("rows", "long long"), ("cols", "int"))


class Colsum(Support):
    name = "colsum"
    template = templates = "colsum.cu.j2"

    def sigs(self):
        partials = [KernelSig(f"colsum_partials{'' if a else '_unaligned'}_{dt}",
                              _partials_args(CTYPE[dt]), dt, "partials", colsum_launch(dt, a))
                    for dt in DTYPES for a in (True, False)]
        reduces = [KernelSig(f"colsum_reduce_{dt}", reduce_args(dt), dt, "reduce",
                             WGRAD_REDUCE_LAUNCH) for dt in DTYPES]
        return (*partials, *reduces)

    def context(self):
        sigs = self.sigs()
        return {stage: [{"sig": s, "t": CTYPE[s.dtype]} for s in sigs if s.stage == stage]
                for stage in ("partials", "reduce")}


KIND = Colsum()
