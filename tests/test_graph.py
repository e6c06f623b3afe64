"""The model graph as data (runtime/graph.py) and what the training tape and the decoder
build from it: node order, the values training keeps, the gradient wiring of the
residual stream and the tied table, and the decoder's fused q/k/v buffer."""
from __future__ import annotations

import numpy as np
import pytest

from eulergen.runtime.backend import NUMPY
from eulergen.runtime.config import load_config
from eulergen.runtime.decoder import build_decoder
from eulergen.runtime.graph import fused_shape, model_graph, parameter_names
from eulergen.runtime.model import arch_of, build
from eulergen.runtime.ops import OpLibrary
from eulergen.runtime.tape import Embedding, Linear, Op
from test_model import STRUCTURES   # gpt2 and nanoeuler at a tiny size


@pytest.fixture(scope="module")
def lib():
    return OpLibrary(NUMPY)


def _cfg(structure):
    return load_config(None, STRUCTURES[structure]).model


def test_the_block_is_a_pre_norm_block_with_the_configured_ops(lib):
    g = model_graph(arch_of(_cfg("gpt2"), lib))
    assert [n.kind for n in g.block] == ["norm", "linear", "attention", "linear", "add",
                                         "norm", "linear", "activation", "linear", "add"]
    assert [n.op.name for n in g.block if n.op] == ["layernorm", "causal_attention",
                                                   "layernorm", "gelu"]
    assert g.block[0].inputs == ("x",) and g.block[-1].outputs == ("next",)
    nano = model_graph(arch_of(_cfg("nanoeuler"), lib))
    rope = [n for n in nano.block if n.kind == "rope"]
    assert [(n.inputs, n.outputs) for n in rope] == [(("q",), ("q_rope",)), (("k",), ("k_rope",))]
    attention = next(n for n in nano.block if n.kind == "attention")
    assert attention.inputs == ("q_rope", "k_rope", "v")
    assert next(n for n in nano.block if n.kind == "activation").inputs == ("fc_a", "fc_b")
    assert nano.stem[0].weights == ("wte",) and g.stem[0].weights == ("wte", "wpe")


def test_training_keeps_what_a_backward_reads_and_not_the_branch_outputs(lib):
    g = model_graph(arch_of(_cfg("gpt2"), lib))
    kept = g.kept()
    assert {"x", "ln_1", "q", "k", "v", "attn", "lse", "x_mid", "ln_2", "fc", "act",
            "x_final", "ln_f", "logits"} <= kept
    # the c_proj outputs only feed residual adds, whose backward reads nothing
    assert not {"attn_proj", "mlp_proj"} & kept
    assert g.values["attn_proj"].buffer == g.values["mlp_proj"].buffer == "proj"


def test_a_linear_of_several_outputs_reads_consecutive_row_blocks(lib):
    a = arch_of(_cfg("nanoeuler"), lib)      # 4 q heads, 2 kv heads of 2
    g = model_graph(a)
    c_attn, c_fc = (next(n for n in g.block if n.weights == (w,))
                    for w in ("attn.c_attn", "mlp.c_fc"))
    assert g.row_blocks(c_attn) == [slice(0, 8), slice(8, 12), slice(12, 16)]
    assert g.row_blocks(c_fc) == [slice(0, 12), slice(12, 24)]
    assert g.row_blocks(g.head[-1]) == [slice(None)]
    assert fused_shape([g.values[n].shape((3, 5)) for n in c_attn.outputs]) == (3, 5, 8, 2)
    with pytest.raises(ValueError):
        fused_shape([(3, 5, 4, 2), (3, 5, 4, 3)])


def test_a_linear_reads_a_bias_only_where_the_model_has_one(lib):
    for structure, want in (("gpt2", ["h.1.attn.c_proj.weight", "h.1.attn.c_proj.bias"]),
                            ("nanoeuler", ["h.1.attn.c_proj.weight"])):
        model = build(_cfg(structure), lib, 2, 5, training=False)
        c_proj = next(n for n in model.graph.block if n.weights == ("attn.c_proj",))
        assert parameter_names(c_proj, "h.1.", model.params) == want
        assert parameter_names(model.graph.head[-1], "", model.params) == ["wte.weight"]


def test_the_first_gradient_writer_in_backward_order_writes_and_later_ones_add(lib):
    model = build(_cfg("gpt2"), lib, 2, 5)
    nodes, mem = model.tape.nodes, model.mem
    norms = [n for n in nodes if isinstance(n, Op) and n.op.name == "layernorm"]
    assert len(norms) == 5                                  # ln_1, ln_2 per block, ln_f
    # the stream's gradient: the final norm writes d.x, every block's norms add to it
    assert all(np.shares_memory(n.dins[0].buf, mem["d.x"]) for n in norms)
    assert [n.dins[0].add for n in norms] == [True, True, True, True, False]
    # q, k, v GEMMs: backward runs v, k, q; v writes d.ln, k and q add
    c_attn = [n for n in nodes if isinstance(n, Linear)
              and np.shares_memory(n.w, model.params["h.0.attn.c_attn.weight"])]
    assert [n.dx.add for n in c_attn] == [True, True, False]
    assert all(n.dw.param and not n.dw.add for n in c_attn)
    # the tied table: the head writes its gradient (per micro-step), the embedding adds
    head, (embedding,) = nodes[-1], [n for n in nodes if isinstance(n, Embedding)]
    assert head.dw.param and not head.dw.add
    assert embedding.dtable.add and not embedding.dtable.param
    assert embedding.dpositions.param


def test_training_plans_each_kept_value_per_block_and_each_gradient_once(lib):
    model = build(_cfg("nanoeuler"), lib, 2, 5)
    index = model.mem.plan.index
    assert "h.1.q_rope" in index and "h.1.attn_proj" not in index and "proj" in index
    grads = [b.name for b in model.mem.plan.buffers if b.name.startswith("d.")]
    assert grads == ["d.x", "d.ln", "d.q", "d.k", "d.v", "d.q_rope", "d.k_rope", "d.attn",
                     "d.fc_a", "d.fc_b", "d.act"]


def test_the_decoder_runs_c_attn_as_one_gemm_with_q_k_v_as_views(lib):
    dec = build_decoder(_cfg("nanoeuler"), lib, 2, 6)
    assert dec.mem.plan.buffer("qkv").shape == (2, 6, 4 + 2 * 2, 2)
    assert "lse" not in dec.mem.plan.index and "q" not in dec.mem.plan.index
    views, buffers = dec._views(3)
    qkv = buffers["qkv"]
    qkv[...] = np.arange(qkv.size).reshape(qkv.shape)
    for name, heads in (("q", slice(0, 4)), ("k", slice(4, 6)), ("v", slice(6, 8))):
        assert np.shares_memory(views[name], qkv)
        np.testing.assert_array_equal(views[name], qkv[:, :, heads])
    assert views["x_mid"] is views["x"] and views["ln_2"] is views["ln_1"]
    gemms = [n for n in dec._tape(1).nodes if isinstance(n, Linear)]
    assert len(gemms) == 2 * (1 + 1 + 2 + 1) + 1         # qkv, c_proj, fc_a, fc_b, c_proj; head
