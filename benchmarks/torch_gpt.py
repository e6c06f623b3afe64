"""A PyTorch model with eulergen's architecture, built from a ModelConfig: the reference
for the GPU tests (same weights ⇒ same loss and gradients) and the baseline for
benchmarks/train.py.

Same math as runtime/model/gpt.py and the op specs: pre-norm blocks; layernorm (weight and
bias) or rmsnorm (weight); gelu (tanh), gelu_erf, silu, relu, relu2, or gated swiglu
(silu(a)·b) / geglu (gelu_tanh(a)·b) with a = c_fc rows 0..F-1, b = rows F..2F-1;
learned positions or RoPE on pairs (k, k + hd/2) with θ = t·base^(-2k/hd); causal
attention through SDPA with enable_gqa; tied LM head; mean cross-entropy. Parameter
names and shapes are eulergen's (torch nn.Linear orientation), so the state dict and
eulergen's parameter dict are the same mapping.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from eulergen.errors import EulerError
from eulergen.runtime.train.config import ModelConfig
from eulergen.runtime.model.params import padded_vocab


def _gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {
    "gelu": _gelu_tanh,
    "gelu_erf": F.gelu,
    "silu": F.silu,
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),
}
GATED_ACTIVATIONS = {
    "swiglu": lambda a, b: F.silu(a) * b,
    "geglu": lambda a, b: _gelu_tanh(a) * b,
}
NORMS = ("layernorm", "rmsnorm")
ATTENTIONS = ("causal_attention",)


def _norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "layernorm":
        return nn.LayerNorm(cfg.hidden_dim, eps=cfg.norm_eps)
    return nn.RMSNorm(cfg.hidden_dim, eps=cfg.norm_eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, repeat_kv: bool = False):
        super().__init__()
        self.repeat_kv = repeat_kv
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_dim, kv_dim = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.c_attn = nn.Linear(cfg.hidden_dim, q_dim + 2 * kv_dim, bias=cfg.bias)
        self.c_proj = nn.Linear(q_dim, cfg.hidden_dim, bias=cfg.bias)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        B, T, _ = x.shape
        hd = self.head_dim
        q, k, v = self.c_attn(x).split([self.heads * hd, self.kv_heads * hd, self.kv_heads * hd], dim=-1)
        q = q.view(B, T, self.heads, hd)
        k = k.view(B, T, self.kv_heads, hd)
        v = v.view(B, T, self.kv_heads, hd)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        grouped = self.kv_heads != self.heads
        if grouped and self.repeat_kv:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
            grouped = False
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)
        return self.c_proj(o.transpose(1, 2).reshape(B, T, self.heads * hd))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gated = cfg.activation in GATED_ACTIVATIONS
        self.act = (GATED_ACTIVATIONS if self.gated else ACTIVATIONS)[cfg.activation]
        self.hidden = cfg.mlp_hidden
        self.c_fc = nn.Linear(cfg.hidden_dim, (2 if self.gated else 1) * cfg.mlp_hidden, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.mlp_hidden, cfg.hidden_dim, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)
        if self.gated:
            h = self.act(h[..., :self.hidden], h[..., self.hidden:])
        else:
            h = self.act(h)
        return self.c_proj(h)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, repeat_kv: bool = False):
        super().__init__()
        self.ln_1 = _norm(cfg)
        self.attn = Attention(cfg, repeat_kv)
        self.ln_2 = _norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x, rope):
        x = x + self.attn(self.ln_1(x), rope)
        return x + self.mlp(self.ln_2(x))


class TorchGPT(nn.Module):
    """`repeat_kv`: copy the KV heads up to the query heads before SDPA instead of passing
    enable_gqa. PyTorch has no fused fp32 kernel for enable_gqa (it falls back to the
    materialised math path), so an fp32 baseline is fastest with repeated KV."""

    def __init__(self, cfg: ModelConfig, *, repeat_kv: bool = False):
        super().__init__()
        _check_supported(cfg)
        self.cfg = cfg
        # eulergen's padded rows (runtime/model/gpt.py padded_vocab): the same shapes, the same loss
        # (over the real ids only)
        self.wte = nn.Embedding(padded_vocab(cfg.vocab_size), cfg.hidden_dim)
        if cfg.positions == "learned":
            self.wpe = nn.Embedding(cfg.max_seq_len, cfg.hidden_dim)
        else:
            cos, sin = rope_tables(cfg.max_seq_len, cfg.head_dim, cfg.rope_base)
            # Not parameters and not saved: the state dict stays eulergen's parameter set.
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.h = nn.ModuleList(Block(cfg, repeat_kv) for _ in range(cfg.num_layers))
        self.ln_f = _norm(cfg)
        self._init_weights()

    def _init_weights(self) -> None:
        """GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2·layers)."""
        residual_std = 0.02 / math.sqrt(2 * self.cfg.num_layers)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=residual_std if name.endswith("c_proj.weight") else 0.02)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)   # norm weights keep torch's ones

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx [B, T] int ⇒ logits [B, T, padded V], and the mean cross-entropy when targets are given."""
        B, T = idx.shape
        if T > self.cfg.max_seq_len:
            raise EulerError(f"sequence length {T} exceeds max_seq_len {self.cfg.max_seq_len}")
        x = self.wte(idx)
        rope = None
        if self.cfg.positions == "learned":
            x = x + self.wpe.weight[:T]
        else:
            rope = (self.rope_cos[:T], self.rope_sin[:T])
        for block in self.h:
            x = block(x, rope)
        logits = self.ln_f(x) @ self.wte.weight.T
        if targets is None:
            return logits, None
        # padded rows take no part in the loss (runtime/model/gpt.py GPT._mask_padding)
        real = logits[..., :self.cfg.vocab_size]
        loss = F.cross_entropy(real.reshape(B * T, -1).float(), targets.reshape(-1).long())
        return logits, loss


def rope_tables(max_seq: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos θ and sin θ, [T, hd/2], θ = t·base^(-2k/hd): ops/rope.yaml's angle."""
    k = torch.arange(head_dim // 2, dtype=torch.float64)
    theta = torch.arange(max_seq, dtype=torch.float64)[:, None] * base ** (-2 * k / head_dim)
    return theta.cos().float(), theta.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, hd]: rotate the pairs (k, k + hd/2) by θ(t, k)."""
    half = x.shape[-1] // 2
    x0, x1 = x[..., :half], x[..., half:]
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return torch.cat([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)


def load_eulergen_params(model: TorchGPT, params: dict[str, np.ndarray]) -> None:
    """Copy eulergen's parameter dict into the model, by name; names and shapes must
    match exactly (one line naming the first difference otherwise)."""
    state = model.state_dict()
    missing = sorted(set(state) - set(params))
    extra = sorted(set(params) - set(state))
    if missing or extra:
        raise EulerError(f"parameter names differ: missing {missing[:3]}, unexpected {extra[:3]}")
    with torch.no_grad():
        for name, tensor in state.items():
            value = np.asarray(params[name])
            if tuple(value.shape) != tuple(tensor.shape):
                raise EulerError(f"shape {tuple(value.shape)}, the torch model has {tuple(tensor.shape)}",
                                 key=name)
            tensor.copy_(torch.from_numpy(np.ascontiguousarray(value)))


def eulergen_params(model: TorchGPT) -> dict[str, np.ndarray]:
    """The model's parameters as eulergen's dict (float32 numpy, by name)."""
    return {name: t.detach().float().cpu().numpy() for name, t in model.state_dict().items()}


def eulergen_grads(model: TorchGPT) -> dict[str, np.ndarray]:
    """Gradients after backward(), by eulergen's parameter names (float32 numpy)."""
    return {name: p.grad.detach().float().cpu().numpy() for name, p in model.named_parameters()
            if p.grad is not None}


def _check_supported(cfg: ModelConfig) -> None:
    if cfg.norm not in NORMS:
        raise EulerError(f"the torch reference has no {cfg.norm!r} (has {', '.join(NORMS)})", key="model.norm")
    if cfg.activation not in ACTIVATIONS and cfg.activation not in GATED_ACTIVATIONS:
        known = ", ".join([*ACTIVATIONS, *GATED_ACTIVATIONS])
        raise EulerError(f"the torch reference has no {cfg.activation!r} (has {known})", key="model.activation")
    if cfg.attention not in ATTENTIONS:
        raise EulerError(f"the torch reference has no {cfg.attention!r} (has {', '.join(ATTENTIONS)})",
                         key="model.attention")
