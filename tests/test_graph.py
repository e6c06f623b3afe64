"""The model graph as data (runtime/model/graph.py) and what the training tape and the decoder
build from it: node order, the fused adds and biases, the values training keeps, the
gradient wiring of the residual stream and the tied table, q, k and v as parts of one qkv
buffer in training and in the decoder, and rope in place over them where the op allows it."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from eulergen.runtime.model.arch import arch_of, rope_in_place
from eulergen.runtime.engine.backend import NUMPY
from eulergen.runtime.train.config import load_config
from eulergen.runtime.generate.decoder import build_decoder
from eulergen.runtime.model.graph import model_graph
from eulergen.runtime.model.gpt import build
from eulergen.runtime.engine.ops import OpLibrary
from eulergen.runtime.model.tape import Embedding, Linear, Norm, Op
from test_model import STRUCTURES, _model, _tokens   # gpt2 and nanoeuler at a tiny size


@pytest.fixture(scope="module")
def lib():
    return OpLibrary(NUMPY)


def _cfg(structure):
    return load_config(None, STRUCTURES[structure]).model


def test_the_block_is_a_pre_norm_block_with_each_add_folded_into_the_next_norm(lib):
    g = model_graph(arch_of(_cfg("gpt2"), lib))
    assert [n.kind for n in g.block] == ["linear", "attention", "linear", "norm", "linear",
                                         "activation", "linear", "norm"]
    assert [n.op.name for n in g.block if n.op] == ["causal_attention", "layernorm", "gelu",
                                                   "layernorm"]
    # the stem norms block 0's x; each block's closing add + norm makes the next x and ln_1
    assert [(n.kind, n.inputs, n.outputs) for n in g.stem] == [
        ("embedding", ("idx",), ("next",)), ("norm", ("next",), ("next_ln",))]
    adds = [n for n in g.block if n.fusion == "add"]
    assert [(n.inputs, n.outputs) for n in adds] == [(("x", "attn_proj"), ("x_mid", "ln_2")),
                                                    (("x_mid", "mlp_proj"), ("next", "next_ln"))]
    assert g.block[0].inputs == ("ln_1",) and g.stem[1].fusion == ""
    assert [g.key(0, "next"), g.key(0, "next_ln"), g.key(1, "next_ln"), g.key(-1, "next")] == [
        (1, "x"), (1, "ln_1"), (None, "ln_f"), (0, "x")]   # 2 layers: block 1 is the last
    assert g.head[0].inputs == ("ln_f",)
    nano = model_graph(arch_of(_cfg("nanoeuler"), lib))
    rope = [n for n in nano.block if n.kind == "rope"]
    assert [(n.inputs, n.outputs) for n in rope] == [(("qk",), ("qk_rope",))]   # one call
    attention = next(n for n in nano.block if n.kind == "attention")
    assert attention.inputs == ("q_rope", "k_rope", "v")
    assert next(n for n in nano.block if n.kind == "activation").inputs == ("fc_a", "fc_b")
    assert nano.stem[0].weights == ("wte",) and g.stem[0].weights == ("wte", "wpe")


def test_training_keeps_what_a_backward_reads_and_not_the_branch_outputs(lib):
    g = model_graph(arch_of(_cfg("gpt2"), lib))
    kept = g.kept()
    assert {"x", "ln_1", "qkv", "attn", "lse", "x_mid", "ln_2", "fc", "act",
            "x_final", "ln_f", "logits"} <= kept
    assert not {"q", "k", "v"} & kept           # parts: kept as their root, qkv
    # the c_proj outputs only feed residual adds, whose backward (the norm's, at the sum
    # it saved) does not read them
    assert not {"attn_proj", "mlp_proj"} & kept
    assert g.values["attn_proj"].buffer == g.values["mlp_proj"].buffer == "proj"


def test_a_linear_of_several_outputs_reads_consecutive_row_blocks(lib):
    a = arch_of(_cfg("nanoeuler"), lib)      # 4 q heads, 2 kv heads of 2
    g = model_graph(a)
    c_attn, c_fc = (next(n for n in g.block if n.weights == (w,))
                    for w in ("attn.c_attn", "mlp.c_fc"))
    assert c_attn.outputs == ("qkv",) and g.row_blocks(c_attn) == [slice(None)]
    assert g.row_blocks(c_fc) == [slice(0, 12), slice(12, 24)]
    assert g.row_blocks(g.head[-1]) == [slice(None)]


def test_q_k_v_and_the_rotated_q_k_are_heads_of_qkv(lib):
    g = model_graph(arch_of(_cfg("nanoeuler"), lib))   # 4 q heads, 2 kv heads of 2
    assert g.values["qkv"].shape((3, 5)) == (3, 5, 4 + 2 * 2, 2)
    qkv = np.arange(3 * 5 * 8 * 2).reshape(3, 5, 8, 2)
    for name, heads in (("q", slice(0, 4)), ("k", slice(4, 6)), ("v", slice(6, 8)),
                        ("qk", slice(0, 6)), ("qk_rope", slice(0, 6)),
                        ("q_rope", slice(0, 4)), ("k_rope", slice(4, 6))):
        assert g.root(name) == "qkv" and g.values[name].grad == "d.qkv"
        view = g.view(name, qkv)
        assert np.shares_memory(view, qkv) and view.shape == g.values[name].shape((3, 5))
        np.testing.assert_array_equal(view, qkv[:, :, heads])


def test_a_linear_reads_a_bias_only_where_the_model_has_one(lib):
    for structure, want in (("gpt2", ["h.1.attn.c_proj.weight", "h.1.attn.c_proj.bias"]),
                            ("nanoeuler", ["h.1.attn.c_proj.weight"])):
        model = build(_cfg(structure), lib, 2, 5, training=False)
        g = model.graph
        c_proj = next(n for n in g.block if n.weights == ("attn.c_proj",))
        assert g.parameter_names(c_proj, 1, model.params) == want
        assert g.parameter_names(g.head[-1], None, model.params) == ["wte.weight"]


def test_c_fc_leaves_its_bias_to_the_activation_which_adds_it_in_its_own_pass(lib):
    model = build(_cfg("gpt2"), lib, 2, 5)
    g, P = model.graph, model.params
    c_fc = next(n for n in g.block if n.weights == ("mlp.c_fc",))
    act = next(n for n in g.block if n.kind == "activation")
    assert g.parameter_names(c_fc, 0, P) == ["h.0.mlp.c_fc.weight"]
    assert g.parameter_names(act, 0, P) == ["h.0.mlp.c_fc.bias"]
    gemm = next(n for n in model.tape.nodes if isinstance(n, Linear)
                and np.shares_memory(n.w, P["h.0.mlp.c_fc.weight"]))
    assert gemm.b is None and gemm.db is None
    (op,) = [n for n in model.tape.nodes if isinstance(n, Op) and n.op.name == "gelu"][:1]
    assert op.fusion == "bias" and np.shares_memory(op.inputs[1], P["h.0.mlp.c_fc.bias"])
    assert op.dins[1].param and np.shares_memory(op.dins[1].buf, model.grads["h.0.mlp.c_fc.bias"])


def test_a_gated_activation_adds_each_half_of_c_fc_s_bias_to_its_input(lib):
    cfg = load_config(None, STRUCTURES["nanoeuler"] + ["model.bias=true"]).model
    model = build(cfg, lib, 2, 5)
    F = model.arch.ffn
    act = next(n for n in model.tape.nodes if isinstance(n, Op) and n.fusion == "bias")
    bias = model.params["h.0.mlp.c_fc.bias"]
    assert [(b.shape, np.shares_memory(b, bias[lo:lo + F])) for b, lo in
            zip(act.inputs[2:], (0, F))] == [((F,), True), ((F,), True)]
    assert len(act.dins) == 4 and all(g.param for g in act.dins[2:])


def test_the_norm_that_ends_a_block_takes_the_next_block_s_ln_1_then_ln_f(lib):
    model = build(_cfg("gpt2"), lib, 2, 5)
    g, P = model.graph, model.params
    closing = g.block[-1]
    assert g.parameter_names(g.stem[1], -1, P) == ["h.0.ln_1.weight", "h.0.ln_1.bias"]
    assert g.parameter_names(closing, 0, P) == ["h.1.ln_1.weight", "h.1.ln_1.bias"]
    assert g.parameter_names(closing, 1, P) == ["ln_f.weight", "ln_f.bias"]
    norms = [n for n in model.tape.nodes if isinstance(n, Norm)]
    assert np.shares_memory(norms[-1].weights[0], P["ln_f.weight"])
    assert np.shares_memory(norms[-1].outputs[0], model.mem["x_final"])


def test_the_first_gradient_writer_in_backward_order_writes_and_later_ones_add(lib):
    model = build(_cfg("gpt2"), lib, 2, 5)
    nodes, mem = model.tape.nodes, model.mem
    norms = [n for n in nodes if isinstance(n, Norm)]
    assert len(norms) == 5                      # the stem's, then ln_2 and the next ln_1 a block
    # the stream's gradient: the last block's closing norm writes d.x, the others add to
    # it in their own pass (an `add` fusion) at the row they normalized
    assert all(np.shares_memory(n.dx.buf, mem["d.x"]) for n in norms)
    assert [n.dx.add for n in norms] == [True, True, True, True, False]
    assert [n.branch is None for n in norms] == [True, False, False, False, False]
    assert norms[0].row is norms[0].x and norms[1].row is norms[1].outputs[0]
    # c_attn: one GEMM a block, over all of its weight, from and into the whole of qkv
    (c_attn,) = [n for n in nodes if isinstance(n, Linear)
                 and np.shares_memory(n.w, model.params["h.0.attn.c_attn.weight"])]
    assert c_attn.w.shape == model.params["h.0.attn.c_attn.weight"].shape
    assert c_attn.y.shape == (2 * 5, (2 + 2 * 2) * 4) and np.shares_memory(c_attn.y, mem["h.0.qkv"])
    assert np.shares_memory(c_attn.dy, mem["d.qkv"]) and c_attn.dy.shape == c_attn.y.shape
    assert not c_attn.dx.add and c_attn.dw.param and not c_attn.dw.add
    assert c_attn.db.buf.shape == model.params["h.0.attn.c_attn.bias"].shape
    # the tied table: the head writes its gradient (per micro-step), the embedding adds
    head, (embedding,) = nodes[-1], [n for n in nodes if isinstance(n, Embedding)]
    assert head.dw.param and not head.dw.add
    assert embedding.dtable.add and not embedding.dtable.param
    assert embedding.dpositions.param


def test_training_plans_each_kept_value_per_block_and_each_gradient_once(lib):
    model = build(_cfg("nanoeuler"), lib, 2, 5)
    index = model.mem.plan.index
    assert "h.1.qkv" in index and "h.1.attn_proj" not in index and "proj" in index
    assert not {"h.1.q", "h.1.q_rope", "q", "q_rope", "qk"} & set(index)   # views of qkv
    assert model.mem.plan.buffer("h.1.qkv").shape == (2, 5, 4 + 2 * 2, 2)
    grads = [b.name for b in model.mem.plan.buffers if b.name.startswith("d.")]
    assert grads == ["d.x", "d.ln", "d.qkv", "d.attn", "d.fc_a", "d.fc_b", "d.act"]


def test_rope_runs_once_in_place_over_q_and_k_and_attention_reads_qkv(lib):
    model = build(_cfg("nanoeuler"), lib, 2, 5)
    qkv, dqkv = model.mem["h.0.qkv"], model.mem["d.qkv"]
    ropes = [n for n in model.tape.nodes if isinstance(n, Op) and n.op.name == "rope"]
    assert len(ropes) == 2                                  # one a block
    rope = ropes[0]
    assert rope.inputs[0].shape == rope.outputs[0].shape == (2, 5, 4 + 2, 2)
    assert all(np.shares_memory(a, qkv) for a in (rope.inputs[0], rope.outputs[0]))
    assert all(np.shares_memory(a, dqkv) for a in (rope.douts[0], rope.dins[0].buf))
    attention = next(n for n in model.tape.nodes if isinstance(n, Op) and n.op.kind == "attention")
    assert all(np.shares_memory(a, qkv) for a in attention.inputs)
    assert all(np.shares_memory(g.buf, dqkv) and not g.add for g in attention.dins)


def _rope_with_a_head_index(lib):
    """A library whose rope declares a head index: its numbers are the built-in rope's, but
    k's heads may not be counted on from q's, so it cannot run once over both."""
    other = OpLibrary(NUMPY)
    rope = other.ops["rope"]
    other.ops["rope"] = dataclasses.replace(rope, index={**rope.index, "h": "head"})
    return other


def test_rope_stays_out_of_place_where_the_op_reads_the_head_or_its_input(lib):
    assert rope_in_place(lib.op("rope"))
    assert not rope_in_place(_rope_with_a_head_index(lib).op("rope"))
    rope = lib.op("rope")
    kernels = {n: dataclasses.replace(k, args=(("x", "const float*"),) + k.args)
               if k.stage == "backward" else k for n, k in rope.kernels.items()}
    assert not rope_in_place(dataclasses.replace(rope, kernels=kernels))
    g = model_graph(arch_of(_cfg("nanoeuler"), _rope_with_a_head_index(lib)))
    rope_nodes = [(n.inputs, n.outputs) for n in g.block if n.kind == "rope"]
    assert rope_nodes == [(("q",), ("q_rope",)), (("k",), ("k_rope",))]
    assert not g.values["q_rope"].part and g.root("q") == "qkv"


def test_rope_in_place_gives_the_loss_and_gradients_of_rope_out_of_place(lib):
    x, y = _tokens(2, 5)
    losses, grads = [], []
    for library in (lib, _rope_with_a_head_index(lib)):
        model = _model(library, "nanoeuler")
        model.load_tokens(x, y)
        losses.append(float(model.loss_and_grad()[0]))
        grads.append({k: g.copy() for k, g in model.grads.items()})
    assert "h.0.q_rope" in model.mem.plan.index          # the second: out of place
    assert losses[0] == pytest.approx(losses[1], rel=1e-13)
    for name in grads[0]:
        np.testing.assert_allclose(grads[0][name], grads[1][name], rtol=1e-11, atol=1e-14,
                                   err_msg=name)


def test_the_decoder_runs_c_attn_as_one_gemm_with_q_k_v_as_views(lib):
    dec = build_decoder(arch_of(_cfg("nanoeuler"), lib), lib, 2, 6)
    assert dec.mem.plan.buffer("qkv").shape == (2, 6, 4 + 2 * 2, 2)
    assert "q" not in dec.mem.plan.index
    assert dec.mem.plan.buffer("lse").shape == (2, 4, 6)    # the prefill's flash forward's
    views = dec._views(3)
    assert views["lse"].shape == (2, 4, 3) and views["lse"].flags.c_contiguous
    qkv = views["qkv"]
    qkv[...] = np.arange(qkv.size).reshape(qkv.shape)
    for name, heads in (("qk", slice(0, 6)), ("q_rope", slice(0, 4)), ("k_rope", slice(4, 6)),
                        ("v", slice(6, 8))):
        assert np.shares_memory(views[name], qkv)
        np.testing.assert_array_equal(views[name], qkv[:, :, heads])
    rope, qk = views["qk_rope"], views["qk"]                # rope in place
    assert rope.__array_interface__ == qk.__array_interface__
    assert views["x_mid"] is views["x"] and views["ln_2"] is views["ln_1"]
    gemms = [n for n in dec._tape(1).nodes if isinstance(n, Linear)]
    assert len(gemms) == 2 * (1 + 1 + 2 + 1) + 1         # qkv, c_proj, fc_a, fc_b, c_proj; head
