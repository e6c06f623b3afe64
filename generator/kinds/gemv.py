"""The decoder's GEMMs of a few rows (templates/gemv.cu.j2): y = x·wᵀ (+ b) (+ y) for x of
at most plan.GEMV_LAUNCHES' rows, where a tensor-core GEMM's tiles sit mostly idle and a
split-K library kernel adds a reduction launch. A dot product, so no formula and no spec:
one op, named after its kind, rendered from its template alone, with no numpy module
(runtime/engine/gemv.py launches these; their numpy form is gemm.py's numpy_gemm). A kernel
per storage dtype and row bound; bf16 also writes float32 (the sampler's logits). Their body
(plan.GEMV_BODY) and first arguments (plan.gemv_args) are each pointwise op's `gemv`
variant's too (generator/kinds/pointwise.py)."""
from __future__ import annotations

from eulergen.generator.kinds.support import Support
from eulergen.generator.plan import CTYPE, DTYPES, GEMV_BODY, GEMV_LAUNCHES, gemv_args
from eulergen.signature import KernelSig

WIDE = "gemv_f32_out"   # the stage of the bf16 kernels that write float32


class Gemv(Support):
    name = "gemv"
    template = "gemv.cu.j2"
    templates = "gemv*.j2"

    def _kernels(self):
        """(signature, x's C type, y's C type) of every kernel: gemv_args, then beta (y is
        read back where it is not 0)."""
        forms = [*((dt, "gemv", CTYPE[dt], "") for dt in DTYPES),
                 ("bf16", WIDE, "float", "_f32_out")]   # (dtype, stage, y's C type, suffix)
        return [(KernelSig(f"gemv_r{g.rows}_{dt}{suffix}",
                           gemv_args(dt, o) + (("beta", "float"),), dt, stage, g),
                 CTYPE[dt], o) for dt, stage, o, suffix in forms for g in GEMV_LAUNCHES]

    def sigs(self):
        return tuple(sig for sig, _, _ in self._kernels())

    def context(self):
        return {"body": GEMV_BODY,
                "kernels": [{"sig": s, "t": t, "o": o} for s, t, o in self._kernels()]}


KIND = Gemv()
