"""The op kinds, written once: the spec loader, the planner, the build and the manifest
reader all take them from here. A leaf: it imports only the standard library."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Kind:
    name: str
    template: str          # the file under templates/ its CUDA renders through
    templates: str         # a glob under templates/ of every file that rendering reads
    spec: bool = True      # written as a YAML spec (embedding: a template with no formula)
    backward: bool = True  # has a derived backward (update: an in-place step)
    # update: the first slots of its kernels' float64 `control` array, before its runtime
    # params: whether the step is skipped, and the factor every grad input is scaled by
    control: tuple[str, ...] = ()


KINDS = {k.name: k for k in (
    Kind("pointwise", "pointwise.cu.j2", "pointwise.cu.j2"),
    Kind("row", "row.cu.j2", "row.cu.j2"),
    Kind("pair", "pair.cu.j2", "pair.cu.j2"),
    Kind("update", "update.cu.j2", "update.cu.j2", backward=False,
         control=("skip", "grad_scale")),
    Kind("attention", "attention.cu.j2", "attention*.j2"),
    Kind("embedding", "embedding.cu.j2", "embedding.cu.j2", spec=False),
)}
SPEC_KINDS = tuple(name for name, k in KINDS.items() if k.spec)
