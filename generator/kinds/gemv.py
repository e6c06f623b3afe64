"""The decoder's GEMMs of a few rows (templates/gemv.cu.j2): y = x·wᵀ (+ b) (+ y) for x of
at most plan.GEMV_LAUNCHES' rows, where a tensor-core GEMM's tiles sit mostly idle and a
split-K library kernel adds a reduction launch. A dot product, so no formula and no spec:
one op, named after its kind, rendered from its template alone, with no numpy module
(runtime/engine/gemv.py launches these; their numpy form is gemm.py's numpy_gemm). A kernel
per storage dtype and row bound; bf16 also writes float32 (the sampler's logits)."""
from __future__ import annotations

from eulergen.generator.kinds.support import Support
from eulergen.generator.plan import CTYPE, DTYPES, GEMV_LAUNCHES
from eulergen.signature import KernelSig

WIDE = "gemv_f32_out"   # the stage of the bf16 kernels that write float32


def _args(c: str, out: str) -> tuple[tuple[str, str], ...]:
    """x [rows, k] (row stride ldx), w [n, k] (ldw), b [n] or null, y [rows, n] (ldy), read
    back where beta is not 0, `cols` output columns a block: storage C type `c`, y's
    `out`."""
    return (("x", f"const {c}*"), ("ldx", "long long"), ("w", f"const {c}*"),
            ("ldw", "long long"), ("b", f"const {c}*"), ("y", f"{out}*"), ("ldy", "long long"),
            ("rows", "int"), ("n", "int"), ("k", "int"), ("cols", "int"),
            ("beta", "float"))


class Gemv(Support):
    name = "gemv"
    template = templates = "gemv.cu.j2"

    def _kernels(self):
        """(signature, x's C type, y's C type) of every kernel."""
        forms = [*((dt, "gemv", CTYPE[dt], "") for dt in DTYPES),
                 ("bf16", WIDE, "float", "_f32_out")]   # (dtype, stage, y's C type, suffix)
        return [(KernelSig(f"gemv_r{g.rows}_{dt}{suffix}", _args(CTYPE[dt], o), dt, stage, g),
                 CTYPE[dt], o) for dt, stage, o, suffix in forms for g in GEMV_LAUNCHES]

    def sigs(self):
        return tuple(sig for sig, _, _ in self._kernels())

    def context(self):
        return {"kernels": [{"sig": s, "t": t, "o": o} for s, t, o in self._kernels()]}


KIND = Gemv()
