"""The op kinds as the runtime calls them, one module each (pointwise, row, pair, update,
attention, embedding): the calls an op of the kind takes, on numpy (its generated module)
and on CuPy (its kernels, looked up by what they are: signature.select), each a
`base.OpKind` that runtime/engine/registry.py lists by name."""
