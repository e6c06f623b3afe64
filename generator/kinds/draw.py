"""The sampler's draw of the next token from a row of logits (templates/draw.cu.j2: the
sampling math, hand-written: temperature, top-k, top-p, the draw by a counter-based hash).
No formula, so no spec: one op, named after its kind, rendered from its template alone, with
no numpy module (runtime/generate/draw.py holds the numpy reference and launches it)."""
from __future__ import annotations

from eulergen.generator.kinds.support import Support
from eulergen.generator.plan import DRAW_LAUNCH
from eulergen.signature import KernelSig

# The names of the settings and the step are the decoder's live values
# (runtime/engine/cuda_graph.py writes them into a captured draw before each replay).
ARGS = (("logits", "const float*"), ("row_stride", "long long"), ("vocab", "int"),
        ("temperature", "float"), ("top_k", "int"), ("top_p", "float"),
        ("seed", "unsigned long long"), ("step", "int"), ("next_ids", "int*"),
        ("drawn", "int*"), ("drawn_stride", "int"), ("column", "int"))


class Draw(Support):
    name = "draw"
    template = templates = "draw.cu.j2"

    def sigs(self):
        return (KernelSig("draw_pick", ARGS, "f32", "pick", DRAW_LAUNCH),)


KIND = Draw()
