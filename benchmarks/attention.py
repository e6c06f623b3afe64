"""Flash attention (causal_attention) against torch SDPA, measured in the same run.

    python benchmarks/attention.py            # the table
    python benchmarks/attention.py --sweep    # bf16 d=64 tilings, one kernel family at a time
    python benchmarks/attention.py --sweep wgmma   # the same for the sm_90a backward's tiles
    python benchmarks/attention.py --decode   # KV-cache decoding, one new query a sequence
    python benchmarks/attention.py --decode-sweep   # decode tiles and split targets
    python benchmarks/attention.py --backward # bf16 backward kernels, mma.sync and wgmma

Cases: B=8, T=1024 and B=2, T=4096; 12 query heads, 4 kv heads (GQA), head dim 64; fp32
and bf16 storage. Torch: bf16 on SDPA's flash backend (enable_gqa); fp32 on the faster of
SDPA's default choice with enable_gqa (the materialised math path) and the
memory-efficient backend on kv repeated to 12 heads (the repeat counted in its time).
Causal FLOPs: forward 4·B·H·T²·D / 2; forward + backward 3.5 × that (backward = 2.5 ×
forward, FlashAttention's convention). Times are medians of CUDA-event-timed calls.
"""
from __future__ import annotations

import contextlib
import functools
import sys
import tempfile
from pathlib import Path

import jinja2
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import say, time_ms  # noqa: E402

from eulergen import OPS_DIR, TEMPLATES_DIR  # noqa: E402
from eulergen.generator import derive, spec  # noqa: E402
from eulergen.generator.plan_attention import (ROLES, TilePlan, plan_attention,  # noqa: E402
                                               plan_tiles)
from eulergen.generator.render_attention import render_attention  # noqa: E402
from eulergen.runtime.engine.attention import (AttentionKernels, attention_backward,  # noqa: E402
                                        attention_decode, attention_forward)
from eulergen.runtime.engine.compile import compile_file, device_arch  # noqa: E402
from eulergen.runtime.engine.bf16 import to_bf16  # noqa: E402

CASES = [(8, 1024), (2, 4096)]
H, KVH, D = 12, 4, 64


PRELUDE_HEADER = "eulergen_common.cuh, rendered for the attention tests and benchmark"


def kernels(tiles=None, configs=None, roles=ROLES) -> AttentionKernels:
    """causal_attention rendered (with optional tiles, some kernels), written beside the
    prelude, compiled."""
    folder = Path(tempfile.mkdtemp(prefix="eg-attn-bench-"))
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES_DIR)))
    (folder / "eulergen_common.cuh").write_text(
        env.get_template("common.cuh.j2").render(header=PRELUDE_HEADER))
    derived = derive.derive(spec.load_spec(OPS_DIR / "causal_attention.yaml"))
    rendered = render_attention(derived, plan_attention(derived, tiles=tiles, configs=configs,
                                                        roles=roles))
    cu = folder / "causal_attention.cu"
    cu.write_text(rendered.source)
    compiled = compile_file(cu)
    return AttentionKernels("causal_attention", rendered.kernels, {}, compiled.function,
                            device_arch())


class _Only:
    """AttentionKernels that launch only the kernels whose names contain `role` (the others
    are skipped), for timing one backward kernel inside attention_backward."""

    def __init__(self, ak: AttentionKernels, role: str):
        self.ak, self.role = ak, role

    def kernel(self, *args, **kw):
        return self.ak.kernel(*args, **kw)

    def param_values(self, given):
        return self.ak.param_values(given)

    def backward_isa(self, dtype, head_dim):
        return self.ak.backward_isa(dtype, head_dim)

    def launch(self, kernel, at, args):
        if self.role in kernel.name:
            self.ak.launch(kernel, at, args)


def ours(ak, B, T, dtype, split=False, isa=None, shape=None):
    """(forward ms, forward + backward ms), and with split the backward's kernels one by one
    ({rowdot, dkv, dq: ms}). A split time is one attention_backward call launching only that
    kernel, so it includes the call's host-side checks (≈ 0.05–0.1 ms on the H200): the
    rowdot figure is mostly that, dkv and dq are long enough to hide it."""
    import cupy
    heads, kv_heads, dim = shape or (H, KVH, D)
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s, dtype=np.float32)
              for s in [(B, T, heads, dim), (B, T, kv_heads, dim), (B, T, kv_heads, dim),
                        (B, T, heads, dim)]]
    q, k, v, do = (cupy.asarray(to_bf16(a) if dtype == "bf16" else a) for a in arrays)
    o, lse = attention_forward(ak, q, k, v)
    grads = (cupy.empty_like(q), cupy.empty_like(k), cupy.empty_like(v))
    delta = cupy.empty((B, heads, T), np.float32)

    def fwd():
        attention_forward(ak, q, k, v, out=o, lse=lse)

    def fwd_bwd():
        attention_forward(ak, q, k, v, out=o, lse=lse)
        attention_backward(ak, q, k, v, o, lse, do, out=grads, delta=delta, isa=isa)
    times = time_ms(fwd), time_ms(fwd_bwd)
    if not split:
        return times
    parts = {}
    for role in ("rowdot", "dkv", "dq"):
        only = _Only(ak, f"_{role}_")
        parts[role] = time_ms(lambda: attention_backward(only, q, k, v, o, lse, do, out=grads,
                                                         delta=delta, isa=isa))
    return times, parts


def torch_sdpa(B, T, dtype, shape=None, backends=None):
    """(fwd ms, fwd+bwd ms, backend) of torch's best path for this dtype; `backends` (bf16):
    the SDPA backends to take the fastest of (default: flash, else SDPA's own choice)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    heads, kv_heads, dim = shape or (H, KVH, D)
    tdt = torch.bfloat16 if dtype == "bf16" else torch.float32
    q = torch.randn(B, heads, T, dim, device="cuda", dtype=tdt, requires_grad=True)
    k = torch.randn(B, kv_heads, T, dim, device="cuda", dtype=tdt, requires_grad=True)
    v = torch.randn(B, kv_heads, T, dim, device="cuda", dtype=tdt, requires_grad=True)
    do = torch.randn(B, heads, T, dim, device="cuda", dtype=tdt)

    def gqa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def repeated():
        g = heads // kv_heads
        return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1),
                                              v.repeat_interleave(g, 1), is_causal=True)

    # bf16: flash, or SDPA's own choice only if flash refuses; fp32: the faster of two.
    named = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    options = ([(b, named[b], gqa) for b in backends] if backends else
               [("flash", SDPBackend.FLASH_ATTENTION, gqa), ("default", None, gqa)]
               if dtype == "bf16" else
               [("math (default)", None, gqa),
                ("efficient, kv repeated", SDPBackend.EFFICIENT_ATTENTION, repeated)])
    best = None
    for label, backend, fn in options:
        if best is not None and dtype == "bf16" and not backends:
            break

        def run(fn=fn, backward=False, backend=backend):
            with (sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()):
                o = fn()
                if backward:
                    o.backward(do)
        try:
            f = time_ms(lambda: run(), warmup=3)
            fb = time_ms(lambda: run(backward=True), warmup=3)
        except RuntimeError as err:  # backend refused these inputs
            say(f"torch {label}: {err}".splitlines()[0])
            continue
        if best is None or fb < best[1]:
            best = (f, fb, label)
    return best


def sweep(wgmma: bool = False) -> None:
    """Forward and backward times of bf16 d=64 under other tilings, one kernel family
    changed at a time, at both sizes (the backward also kernel by kernel): the data for
    choosing plan_tiles' defaults. wgmma: the tiles of the sm_90a backward kernels instead
    (on a Hopper GPU, which attention_backward then takes)."""
    base = plan_tiles(D, "bf16")
    variants = [("default", {})]
    if wgmma:
        variants += [(f"wg dkv warps={w} m={m}", {"wg_dkv_warps": w, "wg_dkv_block_m": m})
                     for w, m in ((4, 32), (8, 64), (8, 32))]
        variants += [(f"wg dq warps={w} n={n}", {"wg_dq_warps": w, "wg_dq_block_n": n})
                     for w, n in ((4, 32), (4, 128), (8, 64))]
    else:
        variants += _mma_variants()
    _run_sweep(base, variants)


def _mma_variants() -> list:
    variants = [(f"fwd warps={w} slabs={mt} n={n}",
                  {"fwd_warps": w, "fwd_mtiles": mt, "fwd_block_n": n})
                 for w, mt, n in ((4, 1, 64), (8, 2, 64))]
    variants += [(f"dkv warps={w} m={m}", {"dkv_warps": w, "dkv_block_m": m})
                 for w, m in ((4, 32), (8, 64), (2, 64))]
    variants += [("dkv unpaired", {"dkv_paired": False})]
    variants += [(f"dq warps={w} slabs={mt} n={n}",
                  {"dq_warps": w, "dq_mtiles": mt, "dq_block_n": n})
                 for w, mt, n in ((4, 1, 16), (4, 1, 64), (8, 1, 32), (2, 1, 32), (4, 2, 16))]
    return variants


def _run_sweep(base: TilePlan, variants: list) -> None:
    print(f"bf16 d={D} H={H}/{KVH}: milliseconds by tiling (default: {base})")
    print(f"{'variant':<24} {'case':<11} {'fwd':>6} {'bwd':>6} {'f+b':>6}   "
          f"{'rowdot':>6} {'dkv':>6} {'dq':>6}")
    for label, change in variants:
        fields = {**base.__dict__, **change}
        try:
            ak = kernels(tiles={(D, "bf16"): TilePlan(**fields)}, configs=((D, "bf16"),))
            for B, T in CASES:
                (f, fb), parts = ours(ak, B, T, "bf16", split=True)
                print(f"{label:<24} {f'B={B} T={T}':<11} {f:6.3f} {fb - f:6.3f} {fb:6.3f}   "
                      f"{parts['rowdot']:6.3f} {parts['dkv']:6.3f} {parts['dq']:6.3f}",
                      flush=True)
        except Exception as err:  # a tiling that does not compile or launch: say so, go on
            print(f"{label:<24} failed: {str(err).splitlines()[0][:80]}")


BACKWARD_CASES = [(8, 1024, 12, 4, 64), (8, 1024, 12, 12, 64), (2, 4096, 12, 4, 64),
                  (1, 8192, 12, 4, 64), (8, 1024, 12, 4, 128), (2, 4096, 12, 4, 128)]


def backward_table() -> None:
    """bf16, both backward kernel sets (mma.sync; wgmma where the GPU is sm_90) kernel by
    kernel, against the faster of torch SDPA's flash and cuDNN backends, forward + backward.
    TFLOP/s count causal FLOPs, the backward as 2.5x the forward."""
    import cupy
    hopper = cupy.cuda.Device().compute_capability == "90"
    dims = sorted({c[4] for c in BACKWARD_CASES})
    ak = kernels(configs=tuple((d, "bf16") for d in dims))
    print(f"{'case':<24} {'isa':<6} {'fwd':>6} {'bwd':>6} {'dkv':>6} {'dq':>6} "
          f"{'bwd TF/s':>8} {'f+b':>6} {'torch f+b':>9} {'ratio':>6}  torch backend")
    for B, T, heads, kv_heads, dim in BACKWARD_CASES:
        shape = (heads, kv_heads, dim)
        tf, tfb, label = torch_sdpa(B, T, "bf16", shape, backends=("flash", "cudnn"))
        flops = 4 * B * heads * T * T * dim / 2
        for isa in ("mma", "wgmma") if hopper else ("mma",):
            (f, fb), parts = ours(ak, B, T, "bf16", split=True, isa=isa, shape=shape)
            print(f"{f'B={B} T={T} H={heads}/{kv_heads} d={dim}':<24} {isa:<6} {f:6.3f} "
                  f"{fb - f:6.3f} {parts['dkv']:6.3f} {parts['dq']:6.3f} "
                  f"{2.5 * flops / (fb - f) / 1e9:8.1f} {fb:6.3f} {tfb:9.3f} {tfb / fb:6.2f}  "
                  f"{label}", flush=True)
    print("ratio: torch f+b time / ours (above 1: ours faster); dkv, dq: one kernel alone "
          "(with the call's host checks)")


DECODE_CACHE = 1024
DECODE_CASES = [(1, 12), (1, 4), (16, 12), (16, 4), (64, 12)]   # (B, KVH); H = 12, d = 64
DECODE_LAYERS = 12   # caches cycled through, one per layer, as a model's decode step does


@functools.lru_cache(maxsize=None)
def _decode_data(B, kvh, dtype) -> list:
    """Per layer: q, k_cache, v_cache, o on the device for eulergen, and the same q, k, v in
    torch's [B, heads, T, D] layout (drawn on the GPU: 12 layers of B=16 caches are GBs)."""
    import cupy
    import torch
    tdt = torch.bfloat16 if dtype == "bf16" else torch.float32
    gen = cupy.random.default_rng(0)
    layers = []
    for _ in range(DECODE_LAYERS):
        f32 = [gen.standard_normal(s, dtype=np.float32)
               for s in ((B, 1, H, D), (B, DECODE_CACHE, kvh, D), (B, DECODE_CACHE, kvh, D))]
        ours = [to_bf16(a) if dtype == "bf16" else a for a in f32]
        theirs = [torch.from_dlpack(a).to(tdt).transpose(1, 2).contiguous() for a in f32]
        # the new key and value, passed apart from the cache as the decoder passes them:
        # copies of its last position's rows (so writing them back changes nothing)
        new = tuple(c[:, -1:].copy() for c in ours[1:])
        layers.append((*ours, cupy.empty_like(ours[0]), new, *theirs))
    return layers


def _decode_calls(ak, B, kvh, dtype, new: bool = False):
    """(ours, torch's): one call per layer, each decoding one query against its own full
    cache (so a 12-layer step's caches, not one layer's, compete for L2); `new`: ours
    reads the last key and value from the run's rows and writes them into the cache, as
    the decoder's calls do."""
    import torch.nn.functional as F
    ours, theirs = [], []
    for q, kc, vc, o, kv, tq, tk, tv in _decode_data(B, kvh, dtype):
        ours.append(lambda q=q, kc=kc, vc=vc, o=o, kv=kv if new else None:
                    attention_decode(ak, q, kc, vc, DECODE_CACHE - 1, out=o, new=kv))
        theirs.append(lambda tq=tq, tk=tk, tv=tv: F.scaled_dot_product_attention(
            tq, tk, tv, is_causal=False, enable_gqa=kvh < H))
    return ours, theirs


def _call_us(calls) -> float:
    """Median event-timed single call, cycling through the layers: host launch included."""
    turn = iter(calls * 1000)
    return time_ms(lambda: next(turn)(), warmup=DECODE_LAYERS, iters=5 * DECODE_LAYERS) * 1e3


def _graph_us(calls, rounds: int = 8) -> float:
    """Device time a call: `rounds` passes over the layers captured in a CUDA graph (CuPy
    stream capture), replays timed by events. nan if capture fails."""
    import statistics

    import cupy
    try:
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            for fn in calls:          # workspaces and compiled kernels, before the capture
                fn()
            stream.synchronize()
            stream.begin_capture()
            for _ in range(rounds):
                for fn in calls:
                    fn()
            graph = stream.end_capture()
            graph.launch(stream)
            times = []
            for _ in range(10):
                start, stop = cupy.cuda.Event(), cupy.cuda.Event()
                start.record(stream)
                graph.launch(stream)
                stop.record(stream)
                stop.synchronize()
                times.append(cupy.cuda.get_elapsed_time(start, stop) * 1e3)
        return statistics.median(times) / (rounds * len(calls))
    except Exception as err:  # noqa: BLE001 - a capture the runtime refuses: say so, go on
        say(f"graph capture failed: {str(err).splitlines()[0][:100]}")
        return float("nan")


def _torch_graph_us(calls, rounds: int = 8) -> float:
    """The same for torch calls (torch.cuda.CUDAGraph)."""
    import statistics

    import torch
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for fn in calls:
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(rounds):
                for fn in calls:
                    fn()
        graph.replay()
        times = []
        for _ in range(10):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) * 1e3)
        return statistics.median(times) / (rounds * len(calls))
    except Exception as err:  # noqa: BLE001
        say(f"torch graph capture failed: {str(err).splitlines()[0][:100]}")
        return float("nan")


def decode_kernels(**change) -> AttentionKernels:
    """causal_attention's decode kernels alone at d=D (fp32 and bf16), plan fields changed."""
    tiles = {(D, dt): TilePlan(**{**plan_tiles(D, dt).__dict__, **change})
             for dt in ("f32", "bf16")}
    return kernels(tiles=tiles, configs=tuple(tiles), roles=("decode",))


def decode() -> None:
    """Decoding one token against full caches of DECODE_CACHE keys (GPT-2 124M's shape: 12
    heads of 64, 12 layers' caches in turn), eulergen's decode kernel against torch SDPA on
    the same caches in torch's [B, KVH, T, D] layout (is_causal=False, q of length 1;
    enable_gqa when KVH < H). `call`: median event-timed single call, host launch included
    (what a layer sees when the host is the bottleneck); `gpu`: device time a call, from CUDA
    graph replays (what it costs once launches are off the critical path); `gpu us new`: the
    same with the new key and value passed in (`new`), read from there and written into
    the cache, as the decoder calls it."""
    ak = decode_kernels()
    head = (f"{'case':<24} {'dtype':<5} {'call us':>8} {'torch':>8} {'ratio':>6} "
            f"{'gpu us':>8} {'torch':>8} {'ratio':>6} {'gpu us new':>10}")
    lines = [head, "-" * len(head)]
    for B, kvh in DECODE_CASES:
        for dtype in ("f32", "bf16"):
            say(f"decode B={B} KVH={kvh} {dtype} …")
            ours, theirs = _decode_calls(ak, B, kvh, dtype)
            c, tc = _call_us(ours), _call_us(theirs)
            g, tg = _graph_us(ours), _torch_graph_us(theirs)
            gn = _graph_us(_decode_calls(ak, B, kvh, dtype, new=True)[0])
            lines.append(f"{f'B={B} H={H}/{kvh} d={D} T={DECODE_CACHE}':<24} {dtype:<5} "
                         f"{c:8.1f} {tc:8.1f} {c / tc:6.2f} {g:8.1f} {tg:8.1f} {g / tg:6.2f} "
                         f"{gn:10.1f}")
    print("decode attention (1 new query, full cache), ratio = eulergen time / torch time")
    print("\n".join(lines))


def decode_sweep() -> None:
    """Device time a call (us, CUDA graphs) of the decode kernel under other plans (key
    tile, rows a block) and split targets (blocks a launch aims for per SM): the data for
    plan_tiles' and attention.DECODE_BLOCKS_PER_SM's defaults."""
    from eulergen.runtime.engine import attention
    targets = (1, 2, 4, 8)
    print(f"decode d={D} T={DECODE_CACHE}: gpu us a call by plan and blocks per SM")
    for change in ({}, {"dec_tile": 32}, {"dec_tile": 128}, {"dec_rows": 1}, {"dec_rows": 2},
                   {"dec_rows": 1, "dec_tile": 128}):
        label = " ".join(f"{k[4:]}={v}" for k, v in change.items()) or "default"
        try:
            ak = decode_kernels(**change)
        except Exception as err:  # a plan that does not compile: say so, go on
            print(f"{label:<16} failed: {str(err).splitlines()[0][:80]}")
            continue
        for B, kvh in DECODE_CASES:
            for dtype in ("f32", "bf16"):
                ours, _ = _decode_calls(ak, B, kvh, dtype)
                row = []
                for per_sm in targets:
                    attention.DECODE_BLOCKS_PER_SM = per_sm
                    row.append(_graph_us(ours, rounds=4))
                print(f"{label:<16} B={B:<3} KVH={kvh:<3} {dtype:<5} " + " ".join(
                    f"{n}/SM {t:6.1f}" for n, t in zip(targets, row)), flush=True)
    attention.DECODE_BLOCKS_PER_SM = 4


def main() -> None:
    if "--sweep" in sys.argv[1:]:
        sweep(wgmma="wgmma" in sys.argv[1:])
        return
    if "--decode" in sys.argv[1:]:
        decode()
        return
    if "--decode-sweep" in sys.argv[1:]:
        decode_sweep()
        return
    if "--backward" in sys.argv[1:]:
        backward_table()
        return
    ak = kernels()
    head = (f"{'case':<22} {'dtype':<5} {'fwd ms':>7} {'TFLOP/s':>8} {'torch':>7} {'ratio':>6} "
            f"{'f+b ms':>7} {'TFLOP/s':>8} {'torch':>7} {'ratio':>6}  torch backend")
    lines = [head, "-" * len(head)]
    for B, T in CASES:
        fwd_flops = 4 * B * H * T * T * D / 2
        for dtype in ("bf16", "f32"):
            say(f"B={B} T={T} {dtype} …")
            f, fb = ours(ak, B, T, dtype)
            tf, tfb, label = torch_sdpa(B, T, dtype)
            lines.append(
                f"{f'B={B} T={T} H={H}/{KVH} d={D}':<22} {dtype:<5} {f:7.3f} "
                f"{fwd_flops / f / 1e9:8.1f} {tf:7.3f} {f / tf:6.2f} {fb:7.3f} "
                f"{3.5 * fwd_flops / fb / 1e9:8.1f} {tfb:7.3f} {fb / tfb:6.2f}  {label}")
    print("causal attention, ratio = eulergen time / torch time (below 1.0: faster)")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
