"""The op kinds the runtime knows, by the name a manifest gives: each one module of
runtime/engine/kinds/, whose `OpKind` ops.OpLibrary asks. A new kind is its module and its
line here (and the generator's side: generator/kinds/)."""
from __future__ import annotations

from eulergen.errors import EulerError
from eulergen.runtime.engine.kinds import (attention, embedding, pair, pointwise, row, support,
                                           update)
from eulergen.runtime.engine.kinds.base import OpKind
from eulergen.runtime.engine.manifest import OpEntry

KINDS: dict[str, OpKind] = {k.name: k for k in (
    pointwise.KIND, row.KIND, pair.KIND, update.KIND, attention.KIND, embedding.KIND,
    *support.KINDS)}


def kind_of(op: OpEntry) -> OpKind:
    """The kind of a manifest's op; EulerError naming the manifest and key if it is none
    this runtime knows."""
    try:
        return KINDS[op.kind]
    except KeyError:
        raise EulerError(f"unknown kind {op.kind!r} (expected one of {', '.join(KINDS)}; "
                         "rebuild with `eulergen build`)", file=str(op.manifest),
                         key=f"ops.{op.name}.kind") from None
