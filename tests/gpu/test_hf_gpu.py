"""An imported transformers model on the CUDA backend (`pytest -m gpu tests/gpu`): loss and
every gradient equal transformers' on the same tokens, fp32 with TF32 off on both sides.

Tolerance as tests/gpu/test_model_gpu.py's (2e-3, ∞-norm relative per gradient): the GPU
kernels sum in other orders than torch's CPU ones (~1e-5 of the scale); a misrouted tensor
is off by O(1). Head dim 64, a size the flash kernels take.
"""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

TOLERANCE = 2e-3
B, T = 2, 64


def _hf_model(kind, vocab):
    import torch
    import transformers
    torch.manual_seed(0)
    if kind == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_embd=128, n_layer=2, n_head=2, vocab_size=vocab, n_positions=T,
            bos_token_id=0, eos_token_id=0))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=256, intermediate_size=320, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=T,
            tie_word_embeddings=True, rms_norm_eps=1e-5))
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("vocab", [50257, 300])
def test_imported_loss_and_every_gradient_equal_transformers_on_cuda(libs, tmp_path, kind, vocab):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from eulergen.runtime.interop import hf
    from eulergen.runtime.train.config import config_from_dict
    from eulergen.runtime.model.gpt import build

    cuda, _ = libs
    ref = _hf_model(kind, vocab)
    ref.save_pretrained(tmp_path)
    imported = hf.load_folder(tmp_path)
    cfg = config_from_dict({"model": imported.model})
    model = build(cfg.model, cuda, B, T, tf32=False)
    model.load_state_dict(imported.params)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, vocab, (B, T)), rng.integers(0, vocab, (B, T))
    model.load_tokens(x, y)
    loss = float(model.loss_and_grad()[0])
    grads = {k: cuda.backend.asnumpy(g).copy() for k, g in model.grads.items()}

    logits = ref(torch.as_tensor(x)).logits
    ref_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab),
                                                 torch.as_tensor(y).reshape(-1))
    ref_loss.backward()
    assert loss == pytest.approx(ref_loss.item(), rel=1e-4)
    ours = hf.to_hf(imported.architecture, imported.model, grads)
    theirs = {n: p.grad.numpy() for n, p in ref.named_parameters()}
    assert ours.keys() == theirs.keys()
    worst = {n: float(np.abs(ours[n] - g).max() / np.abs(g).max()) for n, g in theirs.items()}
    bad = {n: f"{e:.2e}" for n, e in worst.items() if e > TOLERANCE}
    assert not bad, f"{kind} vocab {vocab}: gradients off: {bad}"
