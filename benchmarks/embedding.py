"""Embedding forward and backward as the model calls them, per id distribution: ids
8 × 1024 into a 50304 × 768 table, the backward into planned out= and workspace= buffers.

`bwd write` writes the whole table gradient (zeros where an id does not occur: a dense
50304 × 768 write), `bwd add` adds onto it as the model does after the tied LM head;
`sort` is the backward's device sort alone (its two launches), read off the launches the
runtime makes. Distributions: uniform ids, Zipf-like (a few ids own most tokens), and one
id over three quarters of the batch (one run of 6144 keys, which the long-run kernel
sums). Times are medians of CUDA-event-timed calls
(benchmarks/common.py); the table goes to stdout."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import say, time_ms  # noqa: E402

B, T, V, C = 8, 1024, 50304, 768


def ids_of(np, rng, kind: str):
    if kind == "uniform":
        return rng.integers(0, 50257, (B, T)).astype(np.int32)
    if kind == "zipf":
        return np.minimum(rng.zipf(1.2, (B, T)) - 1, V - 1).astype(np.int32)
    ids = rng.integers(0, 50257, (B, T)).astype(np.int32)
    ids.reshape(-1)[: 3 * B * T // 4] = 11
    return ids


def main() -> int:
    try:
        import cupy as cp
        import numpy as np
        if cp.cuda.runtime.getDeviceCount() == 0:
            raise RuntimeError("no CUDA device")
    except Exception as err:
        print(f"benchmarks/embedding.py needs a CUDA GPU with CuPy: {err}", file=sys.stderr)
        return 2
    from eulergen.runtime.engine.backend import get_backend
    from eulergen.runtime.engine.cuda_ops import workspace_elements
    from eulergen.runtime.engine.kinds.embedding import sort_keys
    from eulergen.runtime.engine.bf16 import to_bf16
    from eulergen.runtime.engine.ops import OpLibrary
    lib = OpLibrary(get_backend("cuda"))
    op = lib.op("embedding")
    rng = np.random.default_rng(0)
    rows = []
    for dtype in ("f32", "bf16"):
        def store(x):
            x = x.astype(np.float32)
            return cp.asarray(to_bf16(x) if dtype == "bf16" else x)
        wte = store(rng.standard_normal((V, C)) * 0.02)
        wpe = store(rng.standard_normal((T, C)) * 0.02)
        dout = store(rng.standard_normal((B, T, C)))
        out = cp.empty_like(dout)
        dwte, dwpe = cp.empty_like(wte), cp.empty_like(wpe)
        ws = cp.empty(workspace_elements(op, "backward", (B, T), table_rows=V), cp.float32)
        for kind in ("uniform", "zipf", "one_long_run"):
            ids = cp.asarray(ids_of(np, rng, kind))

            def fwd():
                lib.forward("embedding", ids, wte, wpe, out=out)

            def bwd(add):
                return lambda: lib.backward("embedding", ids, wte, wpe, dout, out=(dwte, dwpe),
                                            accumulate=(add, add), workspace=ws)

            def both():
                fwd()
                bwd(True)()

            def sort():
                sort_keys(lib._cuda, op, dtype, ids, V, ws)

            times = {}
            for label, fn in (("fwd", fwd), ("sort", sort), ("bwd add", bwd(True)),
                              ("bwd write", bwd(False)), ("fwd+bwd add", both)):
                times[label] = time_ms(fn, warmup=5, iters=50)
                say(f"{dtype} {kind} {label}: {times[label]:.4f} ms")
            rows.append((dtype, kind, times))
    labels = list(rows[0][2])
    print(f"{'dtype':<5} {'ids':<13}" + "".join(f"{lb:>13}" for lb in labels) + "   (ms)")
    for dtype, kind, times in rows:
        print(f"{dtype:<5} {kind:<13}" + "".join(f"{times[lb]:13.4f}" for lb in labels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
