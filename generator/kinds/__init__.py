"""The op kinds, one module each (pointwise, row, pair, update, attention, embedding; the
runtime's own kernels step_control, draw, bf16, moves, on support.py): what an op of the kind
means to every stage of the generator (its spec keys, its derivation, its check, its plan,
its rendering, its numpy module, its fused variants and manifest entry), each a
`base.OpKind` that generator/registry.py lists by name."""
