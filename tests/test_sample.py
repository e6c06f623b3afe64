"""Sampling over the KV cache on numpy: the cached graph against full recomputation
(learned positions and RoPE, grouped-query attention, batch 1 and 3, through a crop),
the draws (greedy, top-k, top-p, seed, padded ids), streaming text, and the `sample` and
`chat` commands on a checkpoint the tests train."""
from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from eulergen import PACKAGE_DIR
from eulergen.cli import main
from eulergen.errors import EulerError
from eulergen.runtime.train import checkpoint
from eulergen.runtime.model.arch import arch_of
from eulergen.runtime.engine.backend import NUMPY
from eulergen.runtime.train.config import load_config
from eulergen.runtime.data.loader import write_shard
from eulergen.runtime.generate.decode_nodes import Attend
from eulergen.runtime.generate.decoder import build_decoder, plan_decoder
from eulergen.runtime.generate.draw import pick, uniforms
from eulergen.runtime.model.gpt import build
from eulergen.runtime.model.tape import Op
from eulergen.runtime.engine.ops import OpLibrary
from eulergen.runtime.generate.sample import Sampler, TextStream
from eulergen.runtime.train.trainer import Trainer

VOCAB, SEQ = 50, 12
SMALL = ["model.hidden_dim=32", "model.num_layers=2", f"model.vocab_size={VOCAB}",
         f"model.max_seq_len={SEQ}", "model.mlp_hidden=48"]
# learned positions with layernorm, gelu and biases; RoPE with rmsnorm, swiglu and GQA
STRUCTURES = {
    "gpt2": ["model.preset=gpt2", "model.num_heads=2", "model.num_kv_heads=2", *SMALL],
    "nanoeuler": ["model.preset=nanoeuler", "model.num_heads=4", "model.num_kv_heads=2", *SMALL],
}


@pytest.fixture(scope="module")
def lib():
    return OpLibrary(NUMPY)


def _models(lib, structure, batch):
    """A float64 decoder and a full-window model reading the same weights."""
    cfg = load_config(None, STRUCTURES[structure]).model
    dec = build_decoder(arch_of(cfg, lib), lib, batch, SEQ, dtype="float64")
    full = build(cfg, lib, batch, SEQ, training=False, dtype="float64",
                 shared={"params": dec.mem.arenas["params"]})
    full.init_weights(7)
    rng = np.random.default_rng(8)
    for p in full.params.values():   # norm weights and biases off 1 and 0
        p += rng.normal(0, 0.3 if p.ndim == 1 else 0.05, p.shape)
    return cfg, dec, full


def _full_logits(full, context):
    """Logits of each row's last token, recomputing the whole context [B, T]."""
    B, T = context.shape
    window = np.zeros((B, SEQ), dtype=np.int64)
    window[:, :T] = context   # later positions cannot reach earlier ones (causal)
    full.load_tokens(window)
    return full.logits()[:, T - 1]


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("structure", sorted(STRUCTURES))
def test_cached_logits_equal_full_recomputation_through_a_crop(lib, structure, batch):
    _, dec, full = _models(lib, structure, batch)
    rng = np.random.default_rng(batch)
    context = rng.integers(0, VOCAB, (batch, 5))
    got = dec.prefill(context)
    crops = 0
    for step in range(20):
        want = _full_logits(full, context)
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < 1e-12, f"{structure} B={batch} step {step}: {err:.1e}"
        new = rng.integers(0, VOCAB, (batch, 1))
        context = np.concatenate([context, new], axis=1)
        if context.shape[1] > SEQ:   # the decoder's crop: the last SEQ // 2 tokens
            context, crops = context[:, -(SEQ // 2):], crops + 1
        got = dec.decode(new)
        assert dec.length == context.shape[1]
    assert crops >= 2


@pytest.mark.parametrize("structure", sorted(STRUCTURES))
def test_appending_several_tokens_equals_prefilling_them(lib, structure):
    _, dec, full = _models(lib, structure, 2)
    ids = np.random.default_rng(0).integers(0, VOCAB, (2, 9))
    dec.prefill(ids[:, :4])
    got = dec.append(ids[:, 4:]).copy()
    assert np.abs(got - _full_logits(full, ids)).max() < 1e-12


@pytest.mark.parametrize("structure", sorted(STRUCTURES))
def test_a_prefill_attends_by_the_flash_forward_and_fills_the_cache_rows_it_covers(lib, structure):
    """A run of several rows from position 0 takes training's attention forward (no
    decode over the cache), writing k and v into the rows it covers and no others; the
    decode after it reads them (its logits are the full recomputation's)."""
    _, dec, full = _models(lib, structure, 2)
    for layer in range(dec.arch.layers):
        for part in ("k", "v"):
            dec.mem[f"h.{layer}.{part}_cache"][...] = np.nan
    ids = np.random.default_rng(3).integers(0, VOCAB, (2, 7))
    dec.prefill(ids)
    nodes = dec._tapes[7, True].nodes
    assert not any(isinstance(n, Attend) for n in nodes)
    attention = [n for n in nodes if isinstance(n, Op) and n.op is dec.arch.ops.attention]
    assert len(attention) == dec.arch.layers
    for layer in range(dec.arch.layers):
        for part in ("k", "v"):
            cache = dec.mem[f"h.{layer}.{part}_cache"]
            assert np.isfinite(cache[:, :7]).all() and np.isnan(cache[:, 7:]).all()
    new = np.random.default_rng(4).integers(0, VOCAB, (2, 1))
    got = dec.decode(new)
    assert any(isinstance(n, Attend) for n in dec._tapes[1, False].nodes)
    want = _full_logits(full, np.concatenate([ids, new], axis=1))
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-12


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("structure", sorted(STRUCTURES))
def test_greedy_sampling_equals_greedy_over_full_recomputation(lib, structure, batch):
    cfg, dec, full = _models(lib, structure, batch)
    sampler = Sampler(dec.arch, lib, batch=batch, seq_len=SEQ, params=dec.mem.arenas["params"],
                      dtype="float64")
    prompt = [3, 1, 4, 1, 5]
    rows = sampler.samples(prompt, 20, temperature=0)
    # the same crop policy, step by step: tokens since the last crop, at most SEQ
    context = np.tile(np.asarray(prompt), (batch, 1))
    want = []
    for _ in range(20):
        token = np.argmax(_full_logits(full, context)[:, :VOCAB], axis=1)
        want.append(token)
        context = np.concatenate([context, token[:, None]], axis=1)
        if context.shape[1] > SEQ:
            context = context[:, -(SEQ // 2):]
    assert np.array_equal(np.asarray(rows), np.stack(want, axis=1))


def test_numpy_rope_at_pos0_is_those_rows_of_rope_from_zero(lib):
    x, dy = np.random.default_rng(2).normal(size=(2, 2, 9, 3, 8))
    full = lib.forward("rope", x)
    assert np.array_equal(lib.forward("rope", x[:, 6:], pos0=6), full[:, 6:])
    (dx,) = lib.backward("rope", x, dy)
    assert np.array_equal(lib.backward("rope", x[:, 6:], dy[:, 6:], pos0=6)[0], dx[:, 6:])


# -- the draws ---------------------------------------------------------------------------

def _u(rows, seed=0, step=0):
    return uniforms(seed, step, rows)


def test_padded_ids_are_never_drawn():
    logits = np.zeros((4, 64))
    logits[:, 50:] = 100.0            # padding rows of an untrained head can be anything
    for temperature in (0, 1.0):
        assert (pick(logits, 50, _u(4), temperature, None, None) < 50).all()


def test_top_k_draws_only_the_k_most_likely():
    logits = np.log(np.array([[0.1, 0.4, 0.05, 0.3, 0.15]] * 4000))
    got = pick(logits, 5, _u(4000), 1.0, 2, None)
    assert set(got.tolist()) == {1, 3}
    assert 0.5 < np.mean(got == 1) < 0.64, "0.4 / (0.4 + 0.3) = 0.57"


def test_top_p_draws_from_the_smallest_set_reaching_p():
    logits = np.log(np.array([[0.05, 0.5, 0.15, 0.3]] * 4000))
    assert set(pick(logits, 4, _u(4000), 1.0, None, 0.75).tolist()) == {1, 3}
    assert set(pick(logits, 4, _u(4000), 1.0, None, 0.85).tolist()) == {1, 2, 3}
    assert set(pick(logits, 4, _u(4000), 1.0, None, 1e-9).tolist()) == {1}


def test_the_nucleus_keeps_equal_logits_together():
    # mass strictly above either 0.3 is 0.4 < 0.5: both stay, whichever id comes first
    logits = np.log(np.array([[0.3, 0.4, 0.3]] * 2000))
    assert set(pick(logits, 3, _u(2000), 1.0, None, 0.5).tolist()) == {0, 1, 2}


def test_the_draw_is_the_first_id_whose_running_weight_passes_u():
    logits = np.log(np.array([[0.25, 0.25, 0.5]] * 3))
    u = np.array([0.0, 0.49, 0.51])    # cumulative 0.25, 0.5, 1.0
    assert pick(logits, 3, u, 1.0, None, None).tolist() == [0, 1, 2]


def test_uniforms_are_a_function_of_seed_step_and_row():
    a = uniforms(7, 3, 1000)
    assert ((a >= 0) & (a < 1)).all() and len(set(a.tolist())) == 1000
    assert np.array_equal(a, uniforms(7, 3, 1000))
    assert not np.array_equal(a, uniforms(7, 4, 1000))
    assert not np.array_equal(a, uniforms(8, 3, 1000))
    assert abs(a.mean() - 0.5) < 0.05


def test_temperature_zero_is_argmax_and_a_seed_repeats_its_draws():
    logits = np.random.default_rng(1).normal(size=(8, 30))
    assert np.array_equal(pick(logits, 30, _u(8), 0, None, None), logits.argmax(axis=1))
    a, b, c = (pick(logits, 30, _u(8, seed=s), 1.5, 20, 0.9) for s in (4, 4, 5))
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_seeded_samples_repeat_and_rows_differ(lib):
    cfg, dec, _ = _models(lib, "gpt2", 3)
    sampler = Sampler(dec.arch, lib, batch=3, seq_len=SEQ, params=dec.mem.arenas["params"],
                      dtype="float64")
    first = sampler.samples([1, 2], 15, temperature=1.0, seed=11)
    assert first == sampler.samples([1, 2], 15, temperature=1.0, seed=11)
    assert first != sampler.samples([1, 2], 15, temperature=1.0, seed=12)
    assert len({tuple(r) for r in first}) > 1, "one batch, three different samples"


def test_streaming_and_reading_every_drawn_steps_give_the_same_tokens(lib):
    cfg, dec, _ = _models(lib, "nanoeuler", 2)
    sampler = Sampler(dec.arch, lib, batch=2, seq_len=SEQ, params=dec.mem.arenas["params"],
                      dtype="float64")
    seen = []
    settings = dict(temperature=1.0, top_k=20, seed=4)
    streamed = sampler.samples([5, 6], 70, on_step=seen.append, **settings)   # > DRAWN, crops
    assert np.array_equal(np.asarray(seen).T, streamed)
    assert sampler.samples([5, 6], 70, **settings) == streamed


def test_a_prompt_the_tokenizer_cannot_encode_is_one_error():
    from eulergen.cli.sample import _prompt_ids

    class Words:   # a word-level tokenizer that knows "a" and "b"
        name = "words.json"

        def unknown(self, text):
            return next((i for i, c in enumerate(text) if c not in "ab "), None)

        def encode(self, text):
            return [1 if c == "a" else 2 for c in text if c != " "]

    assert _prompt_ids(Words(), "a b", "--prompt") == [1, 2]
    with pytest.raises(EulerError, match=r"character 2 \('z'\) is not in the tokenizer's "
                                         r"vocabulary \(words.json"):
        _prompt_ids(Words(), "a z", "--prompt")


def test_a_row_ends_at_the_stop_token(lib):
    cfg, dec, _ = _models(lib, "gpt2", 1)
    sampler = Sampler(dec.arch, lib, seq_len=SEQ, params=dec.mem.arenas["params"],
                      dtype="float64")
    (greedy,) = sampler.samples([7], 10, temperature=0)
    stop = greedy[3]
    seen = []
    (row,) = sampler.samples([7], 10, temperature=0, stop=stop, on_step=seen.append)
    assert row == greedy[:greedy.index(stop)]
    assert len(seen) == greedy.index(stop) + 1, "generation ends at the step that drew it"


def test_a_prompt_longer_than_the_context_keeps_its_end_and_says_so(lib):
    cfg, dec, _ = _models(lib, "gpt2", 1)
    notes = []
    sampler = Sampler(dec.arch, lib, seq_len=SEQ, params=dec.mem.arenas["params"],
                      dtype="float64", notify=notes.append)
    long_prompt = list(range(30))
    (row,) = sampler.samples(long_prompt, 3, temperature=0)
    assert len(notes) == 2 and "30 tokens" in notes[0] and f"last {SEQ}" in notes[0]
    assert f"pass the context of {SEQ}: once it is full, generation goes on from the last " \
           f"{SEQ // 2} tokens" in notes[1], "the cache will crop: stated"
    notes.clear()
    assert sampler.samples(long_prompt[-SEQ:], 3, temperature=0) == [row] and len(notes) == 1
    notes.clear()
    sampler.samples(long_prompt[:4], 3, temperature=0)
    assert not notes, "a run that fits says nothing"


@pytest.mark.parametrize("settings, key", [
    (dict(temperature=-1), "temperature"), (dict(top_k=0), "top_k"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p")])
def test_bad_settings_are_one_error_naming_the_setting(lib, settings, key):
    cfg, dec, _ = _models(lib, "gpt2", 1)
    sampler = Sampler(dec.arch, lib, seq_len=SEQ, params=dec.mem.arenas["params"],
                      dtype="float64")
    with pytest.raises(EulerError, match=key):
        sampler.samples([1], 2, **settings)


def test_text_stream_prints_multibyte_characters_whole():
    decode = lambda ids: bytes(ids).decode("utf-8", errors="replace")  # noqa: E731
    stream = TextStream(decode)
    pieces = [stream.push(b) for b in "aé€😀".encode()]
    assert [p for p in pieces if p] == ["a", "é", "€", "😀"]
    assert stream.push(0xFF) == "" and stream.flush() == "\ufffd", "invalid bytes still show"


def test_the_inference_plan_holds_the_kv_cache(lib):
    arch = arch_of(load_config(None, STRUCTURES["nanoeuler"]).model, lib)
    plan = plan_decoder(arch, 3, SEQ)
    assert plan.buffer("h.1.k_cache").shape == (3, SEQ, 2, 8)
    assert plan.buffer("h.0.v_cache").arena == "kv_cache"
    assert plan.buffer("logits").shape == (3, 64), "the last position only, padded vocab"
    assert plan.buffer("logits").arena == "logits" and plan.buffer("held").shape == (3, SEQ)
    assert {a.name for a in plan.arenas} == {"params", "kv_cache", "activations", "logits",
                                             "tokens"}, "no GPU workspace on a plan for numpy"
    gpu = plan_decoder(arch, 3, SEQ, dtype="bf16", sms=132)
    assert gpu.buffer("gemm_ws").nbytes == 32 << 20
    assert gpu.buffer("h.0.k_cache").dtype == "bf16" and gpu.buffer("logits").dtype == "float32"


# -- the commands ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A byte-level model trained for a few steps on this package's source."""
    root = tmp_path_factory.mktemp("sample")
    text = b"".join(p.read_bytes() for p in sorted((PACKAGE_DIR / "runtime").rglob("*.py")))
    write_shard(root / "text_train.bin", np.frombuffer(text, dtype=np.uint8))
    cfg = load_config(None, [
        f"run_dir={root / 'run'}", f"data.dataset={root / 'text_train.bin'}",
        f"data.val_dataset={root / 'text_train.bin'}",
        "model.hidden_dim=32", "model.num_layers=2", "model.num_heads=2",
        "model.max_seq_len=32", "model.mlp_hidden=64", "training.batch_size=4",
        "training.seq_len=32", "training.total_steps=3", "training.warmup_steps=1",
        "training.eval_every=0", "training.sample_tokens=0"])
    Trainer(cfg, OpLibrary(NUMPY), progress=False, tensorboard=False).run()
    return root / "run"


def _invoke(*args, stdin=None):
    return CliRunner().invoke(main, [*args, "--device", "numpy"], input=stdin)


def test_sample_streams_a_continuation_and_repeats_it_for_a_seed(run):
    args = ["sample", str(run), "--prompt", "def ", "--max-new-tokens", "40", "--seed", "3"]
    first = _invoke(*args)
    assert first.exit_code == 0, first.output + first.stderr
    assert first.stdout.startswith("def ") and len(first.stdout) > len("def \n")
    assert _invoke(*args).stdout == first.stdout


def test_sample_several_prints_each(run):
    result = _invoke("sample", str(run), "--prompt", "x", "--num-samples", "3",
                     "--max-new-tokens", "8", "--top-p", "0.9")
    assert result.exit_code == 0, result.output + result.stderr
    assert [line for line in result.stdout.splitlines() if line.startswith("--- sample")] == \
        [f"--- sample {n} of 3" for n in (1, 2, 3)]


def test_sample_says_when_it_cuts_a_long_prompt(run):
    result = _invoke("sample", str(run), "--prompt", "y" * 50, "--max-new-tokens", "4")
    assert result.exit_code == 0, result.output + result.stderr
    assert "the prompt has 50 tokens, the context 32: keeping its last 32" in result.stderr


def test_chat_answers_each_line_until_quit(run):
    result = _invoke("chat", str(run), "--max-new-tokens", "6", stdin="hello\nclass \n/quit\n")
    assert result.exit_code == 0, result.output + result.stderr
    assert result.stdout.count("> ") == 3, "two answered lines, then /quit"
    ended = _invoke("chat", str(run), "--max-new-tokens", "6", stdin="hello\n")
    assert ended.exit_code == 0 and ended.stdout.count("> ") == 2, "end of input ends it"


def test_chat_turns_continue_one_conversation(run, monkeypatch):
    from eulergen.runtime.generate import sample as sample_module
    calls = []
    original = sample_module.Sampler.samples

    def spy(self, prompt, n, **kw):
        calls.append((list(prompt), kw["append"], self.decoder.length))
        return original(self, prompt, n, **kw)

    monkeypatch.setattr(sample_module.Sampler, "samples", spy)
    result = _invoke("chat", str(run), "--max-new-tokens", "5", "--temperature", "0",
                     stdin="ab\ncd\n")
    assert result.exit_code == 0, result.output + result.stderr
    (first, append0, _), (second, append1, held) = calls
    assert (first, second) == (list(b"ab\n"), list(b"cd\n"))
    assert (append0, append1) == (False, True)
    assert held >= len(first) + 4, "the second turn starts from the first one's cache"


def _refit(run, tmp_path, model_changes: dict, wte=None):
    """A copy of the run's checkpoint whose config says `model_changes` (and whose wte is
    `wte`, when given)."""
    ck = checkpoint.load(run)
    params = dict(ck.params)
    if wte is not None:
        params["wte.weight"] = wte
    config = {**ck.state["config"]}
    config["model"] = {**config["model"], **model_changes}
    checkpoint.save(tmp_path, 1, params, {}, {"config": config})
    return _invoke("sample", str(tmp_path), "--max-new-tokens", "2")


def test_a_checkpoint_of_another_architecture_is_one_error(run, tmp_path):
    result = _refit(run, tmp_path, {"hidden_dim": 48})
    assert result.exit_code == 2
    (line,) = result.stderr.strip().splitlines()
    assert "model.safetensors" in line and "wte.weight" in line, line
    assert "(256, 32), the model wants (256, 48)" in line, line


def test_an_unpadded_checkpoint_is_one_error_naming_both_shapes(run, tmp_path):
    # saved before vocab padding: 257 rows where the model now has 320
    wte = np.concatenate([checkpoint.load(run).params["wte.weight"], np.zeros((1, 32))])
    result = _refit(run, tmp_path, {"vocab_size": 257}, wte=wte.astype(np.float32))
    assert result.exit_code == 2
    (line,) = result.stderr.strip().splitlines()
    assert "wte.weight has shape (257, 32), the model wants (320, 32)" in line, line


def test_a_tokenizer_larger_than_the_model_vocab_is_one_error(run, tmp_path):
    result = _refit(run, tmp_path, {"vocab_size": 200})
    assert result.exit_code == 2
    (line,) = result.stderr.strip().splitlines()
    assert "256" in line and "200" in line and "model.vocab_size" in line, line


def test_plan_inference_shows_the_kv_cache():
    result = CliRunner().invoke(main, ["plan", "--inference", "--set", "model.num_layers=2"])
    assert result.exit_code == 0, result.output
    assert "h.1.v_cache" in result.stdout and "kv_cache total" in result.stdout
    assert "adamw.m" not in result.stdout
