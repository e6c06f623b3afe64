"""The model presets (GPT-2's shapes and NanoEuler-style models of the same widths and
depths) and the GPU's built-in default: the values that differ from runtime/train/config.py's
dataclass defaults, which are the CPU's."""
from __future__ import annotations

from typing import Any


# Values that differ from the built-in default. mlp_hidden and num_kv_heads, when the
# user does not give them, keep the preset's ratio to hidden_dim and num_heads.
PRESETS: dict[str, dict[str, Any]] = {
    "gpt2": dict(hidden_dim=768, num_layers=12, num_heads=12, num_kv_heads=12,
                 vocab_size=50257, max_seq_len=1024, mlp_hidden=3072, norm="layernorm",
                 activation="gelu", positions="learned", bias=True),
    "nanoeuler": dict(hidden_dim=768, num_layers=12, num_heads=12, num_kv_heads=4,
                      vocab_size=50257, max_seq_len=1024, mlp_hidden=2048, norm="rmsnorm",
                      activation="swiglu", positions="rope", bias=False),
}
# GPT-2's larger shapes (head dim 64), and NanoEuler-style models of the same widths and
# depths: mlp_hidden 8/3 of the width rounded up to 8 (as a changed width resolves it); none
# of 16, 20, 25 heads divides by nanoeuler's 3 query heads per KV head, so the group is the
# divisor of the heads nearest 3 (ties: the larger group).
PRESETS.update({
    "gpt2-medium": {**PRESETS["gpt2"], "num_layers": 24, "hidden_dim": 1024, "num_heads": 16,
                    "num_kv_heads": 16, "mlp_hidden": 4096},
    "gpt2-large": {**PRESETS["gpt2"], "num_layers": 36, "hidden_dim": 1280, "num_heads": 20,
                   "num_kv_heads": 20, "mlp_hidden": 5120},
    "gpt2-xl": {**PRESETS["gpt2"], "num_layers": 48, "hidden_dim": 1600, "num_heads": 25,
                "num_kv_heads": 25, "mlp_hidden": 6400},
    "nanoeuler-medium": {**PRESETS["nanoeuler"], "num_layers": 24, "hidden_dim": 1024,
                         "num_heads": 16, "num_kv_heads": 4, "mlp_hidden": 2736},
    "nanoeuler-large": {**PRESETS["nanoeuler"], "num_layers": 36, "hidden_dim": 1280,
                        "num_heads": 20, "num_kv_heads": 5, "mlp_hidden": 3416},
    "nanoeuler-xl": {**PRESETS["nanoeuler"], "num_layers": 48, "hidden_dim": 1600,
                     "num_heads": 25, "num_kv_heads": 5, "mlp_hidden": 4272},
})

# The built-in default on a GPU: what differs from the CPU's (the dataclass defaults), taken
# when no config file is given and training.device resolves to cuda; sized to end well within
# two minutes on an H200 (benchmarks/RESULTS.md, "The default run"). Below a preset, as the CPU
# default is; mlp_hidden keeps 4 x hidden_dim when only the width is changed.
GPU_DEFAULT: dict[str, dict[str, Any]] = {
    "model": dict(hidden_dim=512, num_layers=8, num_heads=8, num_kv_heads=8, max_seq_len=256,
                  mlp_hidden=2048),
    "training": dict(batch_size=32, learning_rate=1e-3, warmup_steps=100, total_steps=2500,
                     eval_every=500, eval_steps=20, checkpoint_every=1000),
}
DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {"cpu": {}, "gpu": GPU_DEFAULT}
