"""Rows moved by indices held on the device, for the KV-cache decoder (templates/moves.cu.j2):
a run's token ids and a prefill's keys and values written at their positions, one row of
each sequence taken out. Copies only, so no formula and no spec: one op, named after its
kind, rendered from its template alone, with no numpy module (runtime/generate/moves.py
holds the numpy forms and launches these)."""
from __future__ import annotations

from eulergen.generator.kinds.support import Support
from eulergen.generator.plan import CTYPE, DTYPES, ELEMENTWISE_LAUNCH
from eulergen.signature import KernelSig


def _args(call: str, c: str) -> tuple[tuple[str, str], ...]:
    """The parameters of `call` over storage C type `c`: src [B, rows, width] with (b, t)
    strides, positions [B, rows], dst [B, seq, width]; x [B, rows, width], y [B, width]."""
    return {
        "scatter": (("src", f"const {c}*"), ("src_sb", "long long"), ("src_st", "long long"),
                    ("positions", "const int*"), ("dst", f"{c}*"), ("rows", "long long"),
                    ("width", "long long"), ("seq", "long long"), ("n", "long long")),
        "take": (("x", f"const {c}*"), ("index", "const int*"), ("y", f"{c}*"),
                 ("rows", "long long"), ("width", "long long"), ("n", "long long")),
    }[call]


class Moves(Support):
    name = "moves"
    template = templates = "moves.cu.j2"

    def sigs(self):
        return tuple(KernelSig(f"moves_{call}_{dt}", _args(call, CTYPE[dt]), dt, call,
                               ELEMENTWISE_LAUNCH)
                     for dt in DTYPES for call in ("scatter", "take"))


KIND = Moves()
