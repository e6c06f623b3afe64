"""Generation speed: eulergen's KV-cache sampler against Hugging Face transformers'
`GPT2LMHeadModel.generate`, with the same GPT-2 124M weights, in one run on one GPU.

    python benchmarks/sample.py              # batch 1 and 16, 16 prompt tokens, 256 new
    python benchmarks/sample.py --quick      # 64 new tokens, one timed run each

Both sides: fp32 with TF32 off, greedy, the KV cache, a 16-token random prompt (the same
prompt in every row), random-init weights (eulergen's GPT-2 init, copied into
transformers' model: its Conv1D stores weight [in, out], the transpose of ours; gelu_new
is our `gelu`, the tanh form). tokens/s is batch x new tokens over the median wall time
of a whole generate call (the prompt's prefill included), after a warm-up call. The
first 32 greedy tokens of every row are compared with transformers' (fp32 rounding can
break a near-tie between two logits differently; a random-init model's logits are well
apart).
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
    from eulergen.runtime.model import build
    model = build(cfg.model, lib, 1, 1, training=False)
    model.init_weights(0)
    return model.state_dict()


def hf_model(cfg, weights, device: str = "cuda"):
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
    return model.to(device).eval()


def timed(fn, runs: int) -> tuple[float, object]:
    """Median seconds of `fn()` after one warm-up call, and the last result."""
    out = fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--runs", type=int, default=3, help="timed calls (after a warm-up)")
    args = parser.parse_args()
    new, runs = (64, 1) if args.quick else (256, args.runs)

    import cupy
    import torch

    from eulergen.runtime.backend import get_backend
    from eulergen.runtime.config import load_config
    from eulergen.runtime.ops import OpLibrary
    from eulergen.runtime.sample import Sampler

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = load_config(None, ["model.preset=gpt2", "training.device=cuda"])
    lib = OpLibrary(get_backend("cuda"))
    say(f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, torch {torch.__version__}")
    weights = eulergen_weights(cfg, lib)
    hf = hf_model(cfg, weights)
    prompt = np.random.default_rng(1).integers(0, cfg.model.vocab_size, PROMPT).tolist()
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        ids = torch.tensor([prompt] * batch, device="cuda")

        def hf_generate():
            with torch.no_grad():
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=new, use_cache=True)
            torch.cuda.synchronize()
            return out[:, PROMPT:].cpu().numpy()

        hf_s, hf_tokens = timed(hf_generate, runs)
        say(f"B={batch} transformers: {batch * new / hf_s:,.0f} tok/s")
        sampler = Sampler(cfg.model, lib, batch=batch, seq_len=cfg.model.max_seq_len)
        sampler.decoder.load_state_dict(weights)
        our_s, tokens = timed(lambda: sampler.samples(prompt, new, temperature=0), runs)
        tokens = np.asarray(tokens)
        agree = int((tokens[:, :AGREE] == hf_tokens[:, :AGREE]).all(axis=0).sum())
        say(f"B={batch} eulergen: {batch * new / our_s:,.0f} tok/s, first {AGREE} agree "
            f"{agree}/{AGREE}")
        sampler = None   # frees its planned memory before the next batch size
        cupy.get_default_memory_pool().free_all_blocks()
        rows.append((batch, our_s, hf_s, agree))

    print(f"\ngeneration, GPT-2 124M fp32 (TF32 off), greedy, prompt {PROMPT}, {new} new "
          f"tokens, median of {runs}")
    head = (f"{'batch':>5} {'eulergen tok/s':>15} {'transformers tok/s':>19} {'ratio':>6} "
            f"{'first 32 agree':>15}")
    print(head)
    print("-" * len(head))
    for batch, our_s, hf_s, agree in rows:
        ours, theirs = batch * new / our_s, batch * new / hf_s
        print(f"{batch:>5} {ours:>15,.0f} {theirs:>19,.0f} {ours / theirs:>6.2f} "
              f"{f'{agree}/{AGREE}':>15}")
    print("tokens/s: batch x new tokens / wall time of one generate call; ratio: eulergen "
          "over transformers (above 1: faster); agree: positions where every row's greedy "
          "token is transformers'")


if __name__ == "__main__":
    main()
