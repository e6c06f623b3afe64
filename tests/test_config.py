"""Run configuration: NanoEuler JSON, YAML, presets, overrides and one-line errors."""
from __future__ import annotations

import json

import pytest

from eulergen import CONFIG_DIR
from eulergen.errors import EulerError
from eulergen.runtime.train.config import (ModelConfig, as_dict, config_from_dict,
                                           derive_val_dataset, load_config)
from eulergen.runtime.train.presets import GPU_DEFAULT


def _write_json(tmp_path, data, name="run.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data, indent=2))
    return path


def test_shipped_gpt2_small_is_gpt2_124m():
    cfg = load_config(CONFIG_DIR / "gpt2-small.json")
    m = cfg.model
    assert (m.hidden_dim, m.num_layers, m.num_heads, m.num_kv_heads) == (768, 12, 12, 12)
    assert (m.vocab_size, m.max_seq_len, m.mlp_hidden) == (50257, 1024, 3072)
    assert (m.norm, m.activation, m.positions, m.bias) == ("layernorm", "gelu", "learned", True)
    assert cfg.training.seq_len == 1024
    assert cfg.data.val_dataset == "data/fineweb10B/fineweb_val_*.bin"
    assert cfg.run_dir == "runs/gpt2-small"


def test_shipped_config_found_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config("config/gpt2-small.json")
    assert cfg.model.preset == "gpt2" and cfg.run_dir == "runs/gpt2-small"
    with pytest.raises(EulerError, match="config/nope.json: config file not found"):
        load_config("config/nope.json")


def test_shipped_nanoeuler_preset():
    m = load_config(CONFIG_DIR / "nanoeuler.json").model
    assert (m.norm, m.activation, m.positions, m.bias) == ("rmsnorm", "swiglu", "rope", False)
    assert (m.num_heads, m.num_kv_heads, m.mlp_hidden) == (12, 4, 2048)


def _gpu(found: bool):
    """A finds_gpu that answers `found` and counts how often it was asked."""
    def finds_gpu() -> bool:
        finds_gpu.asked += 1
        return found
    finds_gpu.asked = 0
    return finds_gpu


@pytest.mark.parametrize("found", [False, True])
def test_each_device_default_is_a_byte_level_model_on_stdlib_the_gpu_kernels_take(found):
    cfg = load_config(None, finds_gpu=_gpu(found))
    assert cfg.model.vocab_size == 256 and cfg.data.dataset == "builtin:stdlib"
    assert cfg.model.head_dim == 64, "the CUDA attention kernels take head dim 64 and 128 only"
    assert cfg.training.seq_len == cfg.model.max_seq_len
    assert cfg.training.dtype == "auto", "bf16 where the GPU has it, fp32 on numpy"


def test_the_built_in_default_resolves_per_device():
    cpu_probe, gpu_probe = _gpu(False), _gpu(True)
    cpu, gpu = load_config(None, finds_gpu=cpu_probe), load_config(None, finds_gpu=gpu_probe)
    assert (cpu.default, gpu.default) == ("cpu", "gpu")
    assert cpu_probe.asked == gpu_probe.asked == 1
    assert as_dict(cpu) == as_dict(load_config(None)), "the CPU's is the dataclasses' default"
    for section, values in GPU_DEFAULT.items():
        for key, value in values.items():
            assert getattr(getattr(gpu, section), key) == value, f"{section}.{key}"
    assert gpu.training.min_lr == pytest.approx(gpu.training.learning_rate / 10)
    m, c = gpu.model, cpu.model
    assert m.hidden_dim * m.num_layers > c.hidden_dim * c.num_layers, "a larger model on a GPU"
    # without finds_gpu (library callers naming their sizes): the CPU's, whatever the device
    plain = load_config(None, ["training.device=cuda"])
    assert plain.default is None and plain.model == cpu.model


def test_a_named_device_is_not_probed_and_a_file_takes_no_device_default(tmp_path):
    probe = _gpu(True)
    assert load_config(None, ["training.device=cuda"], finds_gpu=_gpu(False)).default == "gpu"
    assert load_config(None, ["training.device=numpy"], finds_gpu=probe).default == "cpu"
    path = _write_json(tmp_path, {"training": {"total_steps": 50}})
    from_file = load_config(path, finds_gpu=probe)
    assert probe.asked == 0
    assert from_file.default is None and from_file.model == load_config(None).model


def test_set_values_win_over_the_gpu_default_which_keeps_its_ratios():
    cfg = load_config(None, ["model.hidden_dim=256", "model.num_heads=4", "training.batch_size=4",
                             "training.learning_rate=1e-2"], finds_gpu=_gpu(True))
    assert (cfg.model.hidden_dim, cfg.model.num_heads, cfg.training.batch_size) == (256, 4, 4)
    g = GPU_DEFAULT["model"]
    assert cfg.model.mlp_hidden == 256 * g["mlp_hidden"] // g["hidden_dim"]
    assert cfg.model.num_kv_heads == 4 * g["num_kv_heads"] // g["num_heads"]
    assert cfg.model.num_layers == g["num_layers"]
    assert cfg.training.min_lr == pytest.approx(1e-3)
    # a preset sits above the device default, as above the CPU's
    assert load_config(None, ["model.preset=gpt2"], finds_gpu=_gpu(True)).model == \
        load_config(None, ["model.preset=gpt2"]).model


def test_a_gpu_default_run_saves_every_key_and_reloads_unchanged():
    cfg = load_config(None, finds_gpu=_gpu(True))
    again = config_from_dict(json.loads(json.dumps(as_dict(cfg))))
    assert as_dict(again) == as_dict(cfg) and again == cfg
    assert again.default is None   # a saved config is a file: every key given


def test_nanoeuler_json_format_accepted_as_is(tmp_path):
    path = _write_json(tmp_path, {
        "model": {"hidden_dim": 256, "num_layers": 2, "num_heads": 8, "num_kv_heads": 2,
                  "vocab_size": 1000, "max_seq_len": 64},
        "training": {"batch_size": 4, "learning_rate": 3e-4, "warmup_steps": 5,
                     "total_steps": 50, "gradient_accumulation": 2},
        "data": {"dataset": "d/train.bin", "tokenizer_path": "tok.json"}})
    cfg = load_config(path)
    assert cfg.model.head_dim == 32 and cfg.model.num_kv_heads == 2
    assert cfg.model.mlp_hidden == 4 * 256
    assert cfg.training.gradient_accumulation == 2 and cfg.training.min_lr == pytest.approx(3e-5)
    assert cfg.data.val_dataset == "d/val.bin" and cfg.data.tokenizer_path == "tok.json"


def test_yaml_reads_exponent_floats_that_pyyaml_leaves_as_strings(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  preset: nanoeuler\ntraining:\n  learning_rate: 6e-4\n  tf32: false\n")
    cfg = load_config(path)
    assert cfg.training.learning_rate == pytest.approx(6e-4)
    assert cfg.training.tf32 is False
    assert cfg.model.positions == "rope"


def test_overrides_win_over_file_and_parse_as_yaml_scalars():
    cfg = load_config(CONFIG_DIR / "gpt2-small.json",
                      ["training.learning_rate=1e-3", "training.tf32=false", "model.num_layers=2",
                       "run_dir=/tmp/r", "data.tokenizer_path=null"])
    assert cfg.training.learning_rate == pytest.approx(1e-3)
    assert cfg.training.tf32 is False
    assert cfg.model.num_layers == 2
    assert cfg.run_dir == "/tmp/r"


def test_preset_ratios_follow_a_changed_width():
    m = load_config(None, ["model.preset=nanoeuler", "model.hidden_dim=384"]).model
    assert m.mlp_hidden == 1024          # keeps 8/3 of hidden_dim
    assert m.num_kv_heads == 4           # keeps 3 query heads per KV head
    m = load_config(None, ["model.preset=gpt2", "model.num_heads=8"]).model
    assert m.num_kv_heads == 8


@pytest.mark.parametrize("preset, params", [
    ("gpt2-medium", 354_823_168), ("gpt2-large", 774_030_080), ("gpt2-xl", 1_557_611_200)])
def test_the_larger_gpt2_presets_have_gpt2s_parameter_counts(preset, params):
    """Hugging Face's counts of GPT-2 medium, large and XL, plus our 47 padded vocab rows."""
    from eulergen.runtime.engine.backend import NUMPY
    from eulergen.runtime.engine.ops import OpLibrary
    from eulergen.runtime.model.arch import arch_of
    from eulergen.runtime.model.params import param_count
    m = load_config(None, [f"model.preset={preset}"]).model
    assert m.head_dim == 64
    assert param_count(arch_of(m, OpLibrary(NUMPY))) == params + 47 * m.hidden_dim


@pytest.mark.parametrize("size", ["medium", "large", "xl"])
def test_the_nanoeuler_sizes_are_nanoeuler_at_gpt2s_shapes(size):
    nano = load_config(None, [f"model.preset=nanoeuler-{size}"]).model
    gpt2 = load_config(None, [f"model.preset=gpt2-{size}"]).model
    shape = ("hidden_dim", "num_layers", "num_heads", "vocab_size", "max_seq_len")
    assert [getattr(nano, k) for k in shape] == [getattr(gpt2, k) for k in shape]
    widened = load_config(None, ["model.preset=nanoeuler", f"model.hidden_dim={nano.hidden_dim}",
                                 f"model.num_heads={nano.num_heads}",
                                 f"model.num_kv_heads={nano.num_kv_heads}"]).model
    assert nano == ModelConfig(**{**vars(widened), "preset": nano.preset,
                                  "num_layers": nano.num_layers})
    assert 2 <= nano.num_heads // nano.num_kv_heads <= 5


def test_as_dict_round_trips_exactly():
    cfg = load_config(CONFIG_DIR / "nanoeuler.json", ["training.batch_size=2"])
    assert config_from_dict(json.loads(json.dumps(as_dict(cfg)))) == cfg


def test_unknown_key_suggests_nearest_with_file_and_line(tmp_path):
    text = (CONFIG_DIR / "gpt2-small.json").read_text().replace("learning_rate", "learnig_rate")
    path = tmp_path / "gpt2-small.json"
    path.write_text(text)
    with pytest.raises(EulerError) as err:
        load_config(path)
    line = text.splitlines().index('    "learnig_rate": 6e-4,') + 1
    assert str(err.value) == (f"{path}:{line}: training.learnig_rate: unknown key "
                              "(did you mean 'learning_rate'?)")


@pytest.mark.parametrize("override, message", [
    ("model.num_heads=5", "model.num_heads: 5 heads do not divide hidden_dim 768"),
    ("model.num_kv_heads=5", "model.num_kv_heads: 5 KV heads do not divide num_heads 12"),
    ("training.batch_size=abc", 'training.batch_size: expected an integer, got "abc"'),
    ("training.batch_size=2.5", "training.batch_size: expected an integer, got 2.5"),
    ("model.bias=1", "model.bias: expected true or false, got 1"),
    ("training.seq_len=2048", "training.seq_len: 2048 is longer than model.max_seq_len 1024"),
    ("training.schedule=cosin", "training.schedule: 'cosin' is not one of cosine, linear, constant "
                                "(did you mean 'cosine'?)"),
    ("model.preset=gtp2", "model.preset: unknown preset 'gtp2' (did you mean 'gpt2'?)"),
    ("model.preset=gpt2-meduim", "model.preset: unknown preset 'gpt2-meduim' "
                                 "(did you mean 'gpt2-medium'?)"),
    ("trainig.seed=1", "trainig.seed: unknown section (did you mean 'training'?)"),
    ("training.learning_rate=0", "training.learning_rate: must be positive, got 0.0"),
    ("model.activation=no-such op", "model.activation: 'no-such op' is not an op name"),
])
def test_bad_values_are_one_line_errors(override, message):
    with pytest.raises(EulerError) as err:
        load_config(CONFIG_DIR / "gpt2-small.json", [override])
    assert str(err.value) == f"--set: {message}"
    assert "\n" not in str(err.value)


def test_rope_needs_even_head_dim():
    with pytest.raises(EulerError, match="rope needs an even head dim, got 7"):
        load_config(None, ["model.positions=rope", "model.hidden_dim=28", "model.num_heads=4"])


def test_override_without_equals_is_an_error():
    with pytest.raises(EulerError, match="expected section.key=value"):
        load_config(None, ["training.seed"])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(EulerError, match="config file not found"):
        load_config(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": {\n  "hidden_dim": 128,\n}\n}')
    with pytest.raises(EulerError, match=r"bad.json:3: invalid JSON"):
        load_config(bad)


def test_val_dataset_derivation():
    assert derive_val_dataset("data/fineweb_train_*.bin") == "data/fineweb_val_*.bin"
    assert derive_val_dataset("shake/train.bin") == "shake/val.bin"
    assert derive_val_dataset("builtin:stdlib") == "builtin:stdlib"
    assert derive_val_dataset("corpus/*.bin") is None


def test_head_dim():
    assert ModelConfig(hidden_dim=768, num_heads=12).head_dim == 64


def test_shipped_yaml_example_is_a_small_nanoeuler_on_stdlib():
    cfg = load_config(CONFIG_DIR / "stdlib-nanoeuler.yaml")
    m = cfg.model
    assert (m.norm, m.activation, m.positions, m.bias) == ("rmsnorm", "swiglu", "rope", False)
    assert (m.hidden_dim, m.num_heads, m.num_kv_heads, m.vocab_size) == (128, 4, 2, 256)
    assert cfg.training.learning_rate == pytest.approx(2e-3)
    assert cfg.data.dataset == "builtin:stdlib"
