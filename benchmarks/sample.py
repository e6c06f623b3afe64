"""Generation speed: eulergen's sampler (CUDA-graph decode steps over a static KV cache,
the draw on the device) against Hugging Face transformers' `GPT2LMHeadModel.generate`,
the same GPT-2 124M weights, in one run on one GPU.

    python benchmarks/sample.py                 # batch 1, 16, 64; 16 prompt tokens, 256 new
    python benchmarks/sample.py --quick         # 64 new tokens, one timed run each
    python benchmarks/sample.py --compiled 1    # static cache + torch.compile at batch 1 only
    python benchmarks/sample.py --batches none --prefill 1024,4096   # prompts' prefill only

Systems, each greedy with a KV cache: eulergen fp32 (TF32 off) and bf16 (bf16 weights and
cache, fp32 logits); transformers in bf16 (`--hf-dtype`; its weights and activations, the
precision eulergen bf16 stores) eager (dynamic cache), and with its static cache and
torch.compile (generate's own compile of the forward for a static cache: mode
reduce-overhead, CUDA graphs) at every batch (`--compiled`). Weights: eulergen's GPT-2
init, copied into transformers' model (its Conv1D stores weight [in, out], the transpose
of ours; gelu_new is our `gelu`, the tanh form). A 16-token random prompt, the same in
every row. tok/s: batch × new tokens over the median wall time of a whole generate call
(the prompt's prefill included), after two warm-up calls; TTFT: the median wall time of a
call for one new token (prompt in, first token on the host). Agreement: the first 32
greedy positions where every row's token is transformers eager's (rounding can break a
near-tie differently, and bf16 sooner on these random weights, whose logits are close
together: tests/gpu/test_sample_gpu.py checks bf16 on a trained model).

Prefill (`--prefill`): a prompt of each length at batch 1, its first token drawn, as a
TTFT: eulergen bf16 (one padded-bucket run of the prompt, the head at its last row, the
draw) against transformers bf16 eager `generate(max_new_tokens=1)`; a prompt longer than
GPT-2's 1,024 positions runs on GPT-2 124M with that many learned positions.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from common import say  # noqa: E402

PROMPT, AGREE = 16, 32
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def eulergen_weights(cfg, lib):
    """GPT-2's init for the preset, as a host state dict (eulergen's names and shapes)."""
    from eulergen.runtime.model.gpt import build
    model = build(cfg.model, lib, 1, 1, training=False)
    model.init_weights(0)
    return model.state_dict()


def hf_model(cfg, weights, dtype: str, device: str = "cuda"):
    """transformers' GPT-2 with the same shape and the same weights (vocab rows past
    model.vocab_size are eulergen's padding: left out)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    m = cfg.model
    config = GPT2Config(vocab_size=m.vocab_size, n_positions=m.max_seq_len, n_embd=m.hidden_dim,
                        n_layer=m.num_layers, n_head=m.num_heads, n_inner=m.mlp_hidden,
                        activation_function="gelu_new", layer_norm_epsilon=m.norm_eps,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        tie_word_embeddings=True)
    model = GPT2LMHeadModel(config)
    state = {}
    for name, value in weights.items():
        if name == "wte.weight":
            value = value[:m.vocab_size]
        elif name.endswith(CONV1D):
            value = value.T
        state[f"transformer.{name}"] = torch.from_numpy(np.ascontiguousarray(value))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise SystemExit(f"weights do not map onto GPT2LMHeadModel: missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}")
    if model.lm_head.weight.data_ptr() != model.transformer.wte.weight.data_ptr():
        raise SystemExit("transformers' LM head is not tied to wte")
    model.generation_config.eos_token_id = None   # generate exactly max_new_tokens
    model.generation_config.pad_token_id = 0
    return model.to(device=device, dtype=getattr(torch, dtype)).eval()


def timed(fn, runs: int) -> tuple[float, object]:
    """Median seconds of `fn()` after two warm-up calls (eulergen's decoder runs a shape
    eagerly at its first run and captures its CUDA graph at the second), and the last
    result."""
    fn()
    out = fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def agreement(tokens, reference) -> int:
    return int((np.asarray(tokens)[:, :AGREE] == reference[:, :AGREE]).all(axis=0).sum())


def prefill(lib, lengths: list[int], hf_dtype: str, runs: int) -> None:
    """TTFT of a prompt of each length at batch 1, eulergen bf16 against transformers eager
    (module docstring); the table at the end."""
    import cupy
    import torch

    from eulergen.runtime.generate.sample import Sampler
    from eulergen.runtime.model.arch import arch_of
    from eulergen.runtime.train.config import load_config

    rows = []
    for length in lengths:
        cfg = load_config(None, ["model.preset=gpt2", "training.device=cuda",
                                 f"model.max_seq_len={max(length, 1024)}"])
        weights = eulergen_weights(cfg, lib)
        prompt = np.random.default_rng(2).integers(0, cfg.model.vocab_size, length).tolist()
        hf = hf_model(cfg, weights, hf_dtype)
        ids = torch.tensor([prompt], device="cuda")

        def hf_first():
            with torch.no_grad():
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=1, use_cache=True)
            return int(out[0, -1])

        hf_s, hf_token = timed(hf_first, runs)
        hf = None
        torch.cuda.empty_cache()
        sampler = Sampler(arch_of(cfg.model, lib), lib, batch=1, seq_len=length, dtype="bf16")
        sampler.decoder.load_state_dict(weights)
        ours_s, tokens = timed(lambda: sampler.samples(prompt, 1, temperature=0), runs)
        rows.append((length, ours_s, hf_s, int(np.asarray(tokens).reshape(-1)[0]) == hf_token))
        say(f"prefill {length}: eulergen bf16 {ours_s * 1e3:.2f} ms, transformers "
            f"{hf_s * 1e3:.2f} ms")
        sampler = None
        cupy.get_default_memory_pool().free_all_blocks()
    print(f"\nprefill, GPT-2 124M, batch 1, first token drawn greedily, median of {runs}")
    head = (f"{'prompt':>6}  {'eulergen bf16 ms':>16} {'tok/s':>10}  "
            f"{f'transformers {hf_dtype} ms':>24} {'ratio':>6} {'same token':>10}")
    print(head)
    print("-" * len(head))
    for length, ours_s, hf_s, same in rows:
        print(f"{length:>6}  {ours_s * 1e3:>16.2f} {length / ours_s:>10,.0f}  "
              f"{hf_s * 1e3:>24.2f} {hf_s / ours_s:>6.1f} {'yes' if same else 'no':>10}")
    print("ms: wall time of one call, prompt in, first token on the host; ratio: "
          "transformers' over eulergen's (above 1: eulergen faster). Target (issue 32): "
          "TTFT <= 5 ms for a 1k prompt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--batches", default="1,16,64", help="'none' for none")
    parser.add_argument("--compiled", default=None,
                        help="batches to run transformers' static cache + compile at "
                             "[default: all]; 'none' for none")
    parser.add_argument("--hf-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--prefill", default="",
                        help="prompt lengths to time the prefill of, e.g. 1024,4096")
    parser.add_argument("--runs", type=int, default=3, help="timed calls (after two warm-ups)")
    args = parser.parse_args()
    new, runs = (64, 1) if args.quick else (256, args.runs)
    batches = [] if args.batches == "none" else [int(b) for b in args.batches.split(",")]
    compiled = (batches if args.compiled is None else [] if args.compiled == "none"
                else [int(b) for b in args.compiled.split(",")])

    import cupy
    import torch

    from eulergen.runtime.engine.backend import get_backend
    from eulergen.runtime.engine.gemm import describe
    from eulergen.runtime.train.config import load_config
    from eulergen.runtime.engine.ops import OpLibrary
    from eulergen.runtime.generate.sample import Sampler
    from eulergen.runtime.model.arch import arch_of

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = load_config(None, ["model.preset=gpt2", "training.device=cuda"])
    lib = OpLibrary(get_backend("cuda"))
    say(f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, torch {torch.__version__}, "
        f"{describe(lib.backend)}")
    weights = eulergen_weights(cfg, lib)
    hf = hf_model(cfg, weights, args.hf_dtype) if batches else None
    hf_name = "bf16" if args.hf_dtype == "bfloat16" else "fp32"
    prompt = np.random.default_rng(1).integers(0, cfg.model.vocab_size, PROMPT).tolist()
    rows = []   # (batch, system, tok/s, ttft ms, agreement or None)
    for batch in batches:
        ids = torch.tensor([prompt] * batch, device="cuda")

        def hf_generate(n, **extra):
            with torch.no_grad():
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=n, use_cache=True, **extra)
            torch.cuda.synchronize()
            return out[:, PROMPT:].cpu().numpy()

        systems = [(f"transformers {hf_name} eager", {})]
        if batch in compiled:
            systems.append((f"transformers {hf_name} static+compile",
                            {"cache_implementation": "static"}))
        reference = None
        for name, extra in systems:
            try:
                seconds, tokens = timed(lambda: hf_generate(new, **extra), runs)
                ttft, _ = timed(lambda: hf_generate(1, **extra), runs)
            except Exception as err:   # torch.compile that does not run here: say so, go on
                say(f"B={batch} {name}: {type(err).__name__}: {str(err)[:200]}")
                rows.append((batch, name, None, None, None))
                continue
            reference = tokens if reference is None else reference
            rows.append((batch, name, batch * new / seconds, ttft * 1e3,
                         agreement(tokens, reference)))
            say(f"B={batch} {name}: {batch * new / seconds:,.0f} tok/s")
        for dtype in ("float32", "bf16"):
            sampler = Sampler(arch_of(cfg.model, lib), lib, batch=batch,
                              seq_len=cfg.model.max_seq_len, dtype=dtype)
            sampler.decoder.load_state_dict(weights)
            seconds, tokens = timed(lambda: sampler.samples(prompt, new, temperature=0), runs)
            ttft, _ = timed(lambda: sampler.samples(prompt, 1, temperature=0), runs)
            name = f"eulergen {'fp32' if dtype == 'float32' else 'bf16'}"
            rows.append((batch, name, batch * new / seconds, ttft * 1e3,
                         agreement(tokens, reference) if reference is not None else None))
            say(f"B={batch} {name}: {batch * new / seconds:,.0f} tok/s"
                + ("" if sampler.decoder.graphs else " (CUDA graphs off)"))
            sampler = None   # frees its planned memory before the next one
            cupy.get_default_memory_pool().free_all_blocks()
    hf = None
    torch.cuda.empty_cache()
    if rows:
        table(rows, hf_name, new, runs)
    if args.prefill:
        prefill(lib, [int(n) for n in args.prefill.split(",")], args.hf_dtype, runs)


def table(rows: list, hf_name: str, new: int, runs: int) -> None:
    print(f"\ngeneration, GPT-2 124M (TF32 off), greedy, prompt {PROMPT}, {new} new tokens, "
          f"median of {runs}")
    head = (f"{'batch':>5}  {'system':<33} {'tok/s':>9} {'vs eager':>9} {'vs compile':>11} "
            f"{'TTFT ms':>8} {'first 32 agree':>15}")
    print(head)
    print("-" * len(head))
    base = {(b, n): t for b, n, t, _, _ in rows}
    for batch, name, tps, ttft, agree in rows:
        if tps is None:
            print(f"{batch:>5}  {name:<33} {'did not run':>9}")
            continue
        eager = base.get((batch, f"transformers {hf_name} eager"))
        comp = base.get((batch, f"transformers {hf_name} static+compile"))
        print(f"{batch:>5}  {name:<33} {tps:>9,.0f} "
              f"{(f'{tps / eager:.2f}' if eager else '-'):>9} "
              f"{(f'{tps / comp:.2f}' if comp else '-'):>11} {ttft:>8.1f} "
              f"{(f'{agree}/{AGREE}' if agree is not None else '-'):>15}")
    print(f"tok/s: batch x new tokens / wall time of one generate call; vs: over transformers "
          f"{hf_name} eager / static cache + torch.compile at that batch (above 1: faster); "
          "TTFT: one call for one new token; agree: positions where every row's greedy token "
          f"is transformers {hf_name} eager's. Targets (issue 32): batch 1 >= 5,000 tok/s and "
          ">= 3x static cache + compile in bf16; batch 64 >= 250k tok/s")


if __name__ == "__main__":
    main()
