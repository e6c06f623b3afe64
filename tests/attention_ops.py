"""Attention ops for the attention tests, derived by the real spec loader: the three shipped
specs, and two test-only specs that take the generic mask path."""
from __future__ import annotations

import tempfile
from pathlib import Path

from eulergen import OPS_DIR
from eulergen.generator import derive, ir, spec

SHIPPED = ("causal_attention", "softcap_attention", "alibi_attention")

# Strictly causal: row 0 sees no key at all, the case that must give zeros, never NaN.
# Bidirectional: no mask, so no tile is skipped.
TEST_SPECS = {
    "strict_attention": "name: strict_attention\nkind: attention\n"
                        "doc: strictly causal\nscore: s * scale\nmask: j < i\n",
    "full_attention": "name: full_attention\nkind: attention\ndoc: no mask\nscore: s * scale\n",
}


def load(name: str, folder: Path | None = None) -> ir.DerivedOp:
    """The derived op of a shipped spec, or of a test spec written into `folder`."""
    if name in TEST_SPECS:
        folder = Path(folder or tempfile.mkdtemp(prefix="eg-attn-"))
        path = folder / f"{name}.yaml"
        path.write_text(TEST_SPECS[name])
    else:
        path = OPS_DIR / f"{name}.yaml"
    return derive.derive(spec.load_spec(path))
