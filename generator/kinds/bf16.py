"""The bf16 steps outside the generated ops (templates/bf16.cu.j2, hand-written): rounding
float32 into bf16 bits and widening them back, adding two bf16 arrays, the float32 norms of a
bf16 matrix's rows.
No formula, so no spec: one op, named after its kind, rendered from its template alone, with
no numpy module (runtime/engine/bf16.py holds the numpy forms and launches these)."""
from __future__ import annotations

from eulergen.generator.kinds.support import Support
from eulergen.generator.plan import ELEMENTWISE_LAUNCH, ROW_NORMS_LAUNCH
from eulergen.signature import KernelSig

# Each kernel's parameters, by its call (the signature's stage): bf16 as its bits (uint16).
ARGS = {
    "round": (("x", "const float*"), ("y", "unsigned short*"), ("n", "long long")),
    "widen": (("x", "const unsigned short*"), ("y", "float*"), ("n", "long long")),
    "add": (("a", "const unsigned short*"), ("b", "const unsigned short*"),
            ("y", "unsigned short*"), ("n", "long long")),
    "row_norms": (("g", "const unsigned short*"), ("norms", "float*"), ("rows", "long long"),
                  ("cols", "int")),
}


class Bf16(Support):
    name = "bf16"
    template = templates = "bf16.cu.j2"

    def sigs(self):
        return tuple(KernelSig(f"bf16_{call}", args, "bf16", call,
                               ROW_NORMS_LAUNCH if call == "row_norms" else ELEMENTWISE_LAUNCH)
                     for call, args in ARGS.items())


KIND = Bf16()
