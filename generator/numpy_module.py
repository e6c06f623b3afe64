"""DerivedOp → the text of a readable numpy module (docs/internals.md, "Generated numpy
modules"): the CPU backend and the reference every kernel is tested against, printed by the
op's kind (generator/kinds/, most through generator/numpy_text.py) from the same derived
expressions as the CUDA."""
from __future__ import annotations

import types

from eulergen.generator import ir, registry


def render_numpy_module(derived: ir.DerivedOp) -> str:
    return registry.kind(derived.kind).numpy_source(derived)


def load_module_from_source(name: str, text: str) -> types.ModuleType:
    """Import generated module text under `name` (for check and tests; not sys.modules)."""
    module = types.ModuleType(name)
    exec(compile(text, f"<generated {name}>", "exec"), module.__dict__)
    return module
