"""Where a KV-cache decode step's time goes: the sampler's one-row step (runtime/generate/
decoder.py: every layer, the head and the draw) as `generate` replays it, one CUDA graph a
token, and each node of that step captured as a graph of its own and replayed back to back.

    python benchmarks/decode_step.py                          # GPT-2 124M bf16, batch 1, 16, 64
    python benchmarks/decode_step.py --preset nanoeuler --batch 1 --dtype float32
    python benchmarks/decode_step.py --batch 1,16 --gemv on,off   # the gemv kernels, then not

The step: `--steps` decode steps after a prompt of `--prompt` tokens (the cache that far
full), each between two CUDA events, all queued before one synchronize: the median is the
GPU's time a token with the host's launches (one graph launch and its live-node updates)
overlapped, and `host` the Python time of queuing one. A node's line: its graph replayed
`--replays` times between two events, over the replays: its kernels and the gap a launch
inside a graph leaves. The nodes' sum against the step says what fusing graphs gains
(nothing: the step is one graph) and what is left is the step's own gaps. `GB/s`: the bytes
the node's weights hold, read once, over its time (the GEMMs; attention's cache reads are
its keys' and values' rows up to the prompt). `--gemv`: EULERGEN_GEMV for each profile in
turn (off: every GEMM on the library, cuBLASLt), in the same process.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from common import event_ms, say  # noqa: E402
from sample import eulergen_weights  # noqa: E402

GEMMS = ("Linear", "LinearAct")   # the nodes that run a GEMM (LinearAct: with its activation)


def label(node) -> str:
    """A node's line in the table: its kind, and the op or the GEMM's shape."""
    kind = type(node).__name__
    if kind in GEMMS:
        n, k = node.w.shape
        return (f"gemm {k}->{n}" + (" +b" if node.b is not None else "")
                + (f" {node.act.name}" if kind == "LinearAct" else ""))
    if kind in ("Op", "Norm", "Rope", "Embed", "Attend"):
        return f"{kind.lower()} {node.op.name}"
    return kind.lower()


def weight_bytes(node) -> int:
    """The bytes a GEMM node's weight and bias hold (0 for the others)."""
    if type(node).__name__ not in GEMMS:
        return 0
    return node.w.nbytes + (node.b.nbytes if node.b is not None else 0)


def profile(cfg, lib, weights, batch: int, dtype: str, prompt: int, steps: int,
            replays: int) -> None:
    import cupy

    from eulergen.runtime.engine.cuda_graph import Graph
    from eulergen.runtime.generate.sample import Sampler
    from eulergen.runtime.model.arch import arch_of

    sampler = Sampler(arch_of(cfg.model, lib), lib, batch=batch,
                      seq_len=cfg.model.max_seq_len, dtype=dtype)
    dec = sampler.decoder
    dec.load_state_dict(weights)
    ids = np.random.default_rng(1).integers(0, cfg.model.vocab_size, prompt).tolist()
    for _ in range(2):          # the first compiles and runs eagerly, the second captures
        sampler.samples(ids, 4, temperature=0)
    if (1, False) not in dec._captured:
        raise SystemExit("the one-row step was not captured as a CUDA graph")
    dec.prefill(np.array([ids] * batch))
    dec.live.update(temperature=0.0)
    host = []

    def step():
        t0 = time.perf_counter()
        dec.step()
        host.append(time.perf_counter() - t0)

    step_ms = event_ms(step, steps)
    kernels = dec._captured[1, False].kernel_count()

    tape = dec._tape(1)
    lines = defaultdict(lambda: [0, 0, 0.0, 0])      # label -> calls, kernels, ms, bytes
    for node in tape.nodes:
        graph = Graph.capture(lambda: node.forward(tape), dec.live)
        graph.launch(dec.live)
        ms = statistics.median(event_ms(lambda: graph.launch(dec.live), replays))
        line = lines[label(node)]
        line[0] += 1
        line[1] += graph.kernel_count()
        line[2] += ms
        line[3] += weight_bytes(node)
    sampler = dec = tape = None
    cupy.get_default_memory_pool().free_all_blocks()

    total = sum(v[2] for v in lines.values())
    med = statistics.median(step_ms)
    print(f"\n{cfg.model.preset or 'model'} {dtype}, batch {batch}, cache at {prompt}, gemv "
          f"{os.environ.get('EULERGEN_GEMV', 'on')}: step "
          f"{med * 1e3:.1f} us ({min(step_ms) * 1e3:.1f}-{max(step_ms) * 1e3:.1f}), "
          f"{batch / med * 1e3:,.0f} tok/s, {kernels} kernels, host "
          f"{statistics.median(host) * 1e6:.1f} us a step; nodes alone sum to "
          f"{total * 1e3:.1f} us")
    head = f"{'node':<32} {'calls':>5} {'kernels':>7} {'us':>8} {'share':>6} {'GB/s':>7}"
    print(head)
    print("-" * len(head))
    for name, (calls, nk, ms, nbytes) in sorted(lines.items(), key=lambda kv: -kv[1][2]):
        rate = f"{nbytes / ms / 1e6:,.0f}" if nbytes else "-"
        print(f"{name:<32} {calls:>5} {nk:>7} {ms * 1e3:>8.1f} {ms / total:>6.1%} {rate:>7}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="gpt2")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--batch", default="1,16,64")
    parser.add_argument("--prompt", type=int, default=512, help="tokens in the cache")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--gemv", default="on", help="EULERGEN_GEMV values, comma-separated")
    args = parser.parse_args()

    import cupy

    from eulergen.runtime.engine.backend import get_backend
    from eulergen.runtime.engine.gemm import describe
    from eulergen.runtime.engine.ops import OpLibrary
    from eulergen.runtime.train.config import load_config

    cfg = load_config(None, [f"model.preset={args.preset}", "training.device=cuda"])
    lib = OpLibrary(get_backend("cuda"))
    say(f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, "
        f"{describe(lib.backend)}")
    weights = eulergen_weights(cfg, lib)
    for batch in (int(b) for b in args.batch.split(",")):
        for gemv in args.gemv.split(","):
            os.environ["EULERGEN_GEMV"] = gemv
            profile(cfg, lib, weights, batch, args.dtype, args.prompt, args.steps, args.replays)


if __name__ == "__main__":
    main()
