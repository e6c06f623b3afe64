"""Flash attention (causal_attention) against torch SDPA, measured in the same run.

    python benchmarks/attention.py            # the table
    python benchmarks/attention.py --sweep    # bf16 d=64 tilings, one kernel family at a time

Cases: B=8, T=1024 and B=2, T=4096; 12 query heads, 4 kv heads (GQA), head dim 64; fp32
and bf16 storage. Torch: bf16 on SDPA's flash backend (enable_gqa); fp32 on the faster of
SDPA's default choice with enable_gqa (the materialised math path) and the
memory-efficient backend on kv repeated to 12 heads (the repeat counted in its time).
Causal FLOPs: forward 4·B·H·T²·D / 2; forward + backward 3.5 × that (backward = 2.5 ×
forward, FlashAttention's convention). Times are medians of CUDA-event-timed calls.
"""
from __future__ import annotations

import contextlib
import sys
import tempfile
from pathlib import Path

import jinja2
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import say, time_ms  # noqa: E402

from eulergen import OPS_DIR, TEMPLATES_DIR  # noqa: E402
from eulergen.generator import derive, spec  # noqa: E402
from eulergen.generator.render_attention import (AttentionPlan, plan_attention,  # noqa: E402
                                                 render_attention)
from eulergen.runtime.attention import (AttentionKernels, attention_backward,  # noqa: E402
                                        attention_forward)
from eulergen.runtime.compile import compile_file  # noqa: E402
from eulergen.runtime.ops import to_bf16  # noqa: E402

CASES = [(8, 1024), (2, 4096)]
H, KVH, D = 12, 4, 64


PRELUDE_HEADER = "eulergen_common.cuh, rendered for the attention tests and benchmark"


def kernels(plans=None, configs=None) -> AttentionKernels:
    """causal_attention rendered (with optional tiles), written beside the prelude, compiled."""
    folder = Path(tempfile.mkdtemp(prefix="eg-attn-bench-"))
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES_DIR)))
    (folder / "eulergen_common.cuh").write_text(
        env.get_template("common.cuh.j2").render(header=PRELUDE_HEADER))
    derived = derive.derive(spec.load_spec(OPS_DIR / "causal_attention.yaml"))
    rendered = render_attention(derived, plans=plans, configs=configs)
    cu = folder / "causal_attention.cu"
    cu.write_text(rendered.source)
    compiled = compile_file(cu)
    return AttentionKernels("causal_attention", {k.name: dict(k.plan) for k in rendered.kernels},
                            {}, compiled.function)


class _Only:
    """AttentionKernels that launch only the kernels whose names contain `role` (the others
    are skipped), for timing one backward kernel inside attention_backward."""

    def __init__(self, ak: AttentionKernels, role: str):
        self.ak, self.role = ak, role

    def kernel(self, *args):
        return self.ak.kernel(*args)

    def param_values(self, given):
        return self.ak.param_values(given)

    def launch(self, name, plan, grid, args):
        if self.role in name:
            self.ak.launch(name, plan, grid, args)


def ours(ak, B, T, dtype, split=False):
    """(forward ms, forward + backward ms), and with split the backward's kernels one by one
    ({rowdot, dkv, dq: ms}). A split time is one attention_backward call launching only that
    kernel, so it includes the call's host-side checks (≈ 0.05–0.1 ms on the H200): the
    rowdot figure is mostly that, dkv and dq are long enough to hide it."""
    import cupy
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s, dtype=np.float32)
              for s in [(B, T, H, D), (B, T, KVH, D), (B, T, KVH, D), (B, T, H, D)]]
    q, k, v, do = (cupy.asarray(to_bf16(a) if dtype == "bf16" else a) for a in arrays)
    o, lse = attention_forward(ak, q, k, v)
    grads = (cupy.empty_like(q), cupy.empty_like(k), cupy.empty_like(v))
    delta = cupy.empty((B, H, T), np.float32)

    def fwd():
        attention_forward(ak, q, k, v, out=o, lse=lse)

    def fwd_bwd():
        attention_forward(ak, q, k, v, out=o, lse=lse)
        attention_backward(ak, q, k, v, o, lse, do, out=grads, delta=delta)
    times = time_ms(fwd), time_ms(fwd_bwd)
    if not split:
        return times
    parts = {}
    for role in ("rowdot", "dkv", "dq"):
        only = _Only(ak, f"_{role}_")
        parts[role] = time_ms(
            lambda: attention_backward(only, q, k, v, o, lse, do, out=grads, delta=delta))
    return times, parts


def torch_sdpa(B, T, dtype):
    """(fwd ms, fwd+bwd ms, backend) of torch's best path for this dtype."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    tdt = torch.bfloat16 if dtype == "bf16" else torch.float32
    q = torch.randn(B, H, T, D, device="cuda", dtype=tdt, requires_grad=True)
    k = torch.randn(B, KVH, T, D, device="cuda", dtype=tdt, requires_grad=True)
    v = torch.randn(B, KVH, T, D, device="cuda", dtype=tdt, requires_grad=True)
    do = torch.randn(B, H, T, D, device="cuda", dtype=tdt)

    def gqa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def repeated():
        g = H // KVH
        return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1),
                                              v.repeat_interleave(g, 1), is_causal=True)

    # bf16: flash, or SDPA's own choice only if flash refuses; fp32: the faster of two.
    options = ([("flash", SDPBackend.FLASH_ATTENTION, gqa), ("default", None, gqa)]
               if dtype == "bf16" else
               [("math (default)", None, gqa),
                ("efficient, kv repeated", SDPBackend.EFFICIENT_ATTENTION, repeated)])
    best = None
    for label, backend, fn in options:
        if best is not None and dtype == "bf16":
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


def sweep() -> None:
    """Forward and backward times of bf16 d=64 under other tilings, one kernel family
    changed at a time, at both sizes (the backward also kernel by kernel): the data for
    choosing plan_attention's defaults."""
    base = plan_attention(D, "bf16")
    variants = [("default", {})]
    variants += [(f"fwd warps={w} slabs={mt} n={n}",
                  {"fwd_warps": w, "fwd_mtiles": mt, "fwd_block_n": n})
                 for w, mt, n in ((4, 1, 64), (8, 2, 64))]
    variants += [(f"dkv warps={w} m={m}", {"dkv_warps": w, "dkv_block_m": m})
                 for w, m in ((4, 32), (8, 64), (2, 64))]
    variants += [("dkv unpaired", {"dkv_paired": False})]
    variants += [(f"dq warps={w} slabs={mt} n={n}",
                  {"dq_warps": w, "dq_mtiles": mt, "dq_block_n": n})
                 for w, mt, n in ((4, 1, 16), (4, 1, 64), (8, 1, 32), (2, 1, 32), (4, 2, 16))]
    print(f"bf16 d={D} H={H}/{KVH}: milliseconds by tiling (default: {base})")
    print(f"{'variant':<24} {'case':<11} {'fwd':>6} {'bwd':>6} {'f+b':>6}   "
          f"{'rowdot':>6} {'dkv':>6} {'dq':>6}")
    for label, change in variants:
        fields = {**base.__dict__, **change}
        try:
            ak = kernels(plans={(D, "bf16"): AttentionPlan(**fields)}, configs=((D, "bf16"),))
            for B, T in CASES:
                (f, fb), parts = ours(ak, B, T, "bf16", split=True)
                print(f"{label:<24} {f'B={B} T={T}':<11} {f:6.3f} {fb - f:6.3f} {fb:6.3f}   "
                      f"{parts['rowdot']:6.3f} {parts['dkv']:6.3f} {parts['dq']:6.3f}",
                      flush=True)
        except Exception as err:  # a tiling that does not compile or launch: say so, go on
            print(f"{label:<24} failed: {str(err).splitlines()[0][:80]}")


def main() -> None:
    if "--sweep" in sys.argv[1:]:
        sweep()
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
