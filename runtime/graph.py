"""The model's forward pass, written once as data: the stem, one block and the head, each
a tuple of Nodes over named Values. runtime/model.py builds the training memory plan and
tape from it, runtime/decoder.py the KV-cache decoder's plan and tape.

    stem   idx -> embedding -> x
    block  x -> norm -> ln_1 -> c_attn -> qkv (q, k, v: its parts) [-> rope -> q_rope, k_rope]
             -> attention -> attn, lse -> c_proj -> attn_proj;  x + attn_proj -> x_mid
           x_mid -> norm -> ln_2 -> c_fc -> fc (fc_a, fc_b: gated) -> activation -> act
             -> c_proj -> mlp_proj;  x_mid + mlp_proj -> next
    head   x_final -> norm -> ln_f -> wte (tied) -> logits

A block reads `x` and writes `next`: the next block's `x`, or after the last block the
head's `x_final`. Each value has its own name within a block (training plans
h.{i}.ln_1 and h.{i}.ln_2); its `slot` is the buffer it takes where one buffer serves
every block (the decoder runs the blocks one after another over one set of
activations; training keeps the values no backward reads there, in its workspace), and
its `grad` the training workspace buffer that holds its gradient, which every block
shares too. The values a residual add joins share one gradient (`d.x`): the add's
backward is the fan-in of writers adding into it.

A value with a `part` is a view of some heads (axis 2) of another value, its root, and
its gradient the same view of the root's: q, k and v are parts of `qkv`, which c_attn
writes in one GEMM. Where the rope op allows it (model.rope_in_place) q_rope and k_rope
are parts too, at q's and k's heads: rope rotates `qk` (q and k side by side) in place,
in one call, into `qk_rope`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from math import prod
from typing import Callable

Shape = Callable[[tuple], tuple]   # the leading dims, (B, T) or (B,), -> the value's shape


@dataclass(frozen=True)
class Value:
    name: str
    shape: Shape
    slot: str = ""              # "" : its own name
    grad: str | None = None     # None: no gradient flows into it
    per_row: bool = False       # a per-row statistic the kernels keep in float32 in every
                                # storage dtype (attention's lse)
    part: tuple[str, int] | None = None   # (root value, first head): a view of its heads

    @property
    def buffer(self) -> str:
        return self.slot or self.name

    @property
    def features(self) -> int:
        """Elements per token: the rows of a weight that a GEMM writes it from."""
        return prod(self.shape((1, 1))[2:])


@dataclass(frozen=True)
class Node:
    """One step of the forward pass. `kind` is 'embedding', 'norm', 'rope', 'attention' or
    'activation' (a manifest op: `op` is its entry, `params` its call parameters), or
    'linear' (a GEMM) or 'add' (the residual add). `weights`: the prefixes of the
    parameters it reads, in the order it takes them (`parameter_names`). A linear with
    several outputs makes them from consecutive row blocks of its weight, one GEMM each
    (dense outputs, one gradient each). `saved`: outputs its backward reads besides its
    inputs (attention's o and lse)."""
    kind: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    weights: tuple[str, ...] = ()
    op: object = None                                 # manifest.OpEntry
    params: dict = field(default_factory=dict, hash=False)
    saved: tuple[str, ...] = ()


@dataclass(frozen=True)
class Graph:
    values: dict = field(hash=False)   # name -> Value
    stem: tuple[Node, ...]
    block: tuple[Node, ...]
    head: tuple[Node, ...]

    def order(self, nodes) -> list[str]:
        """The values `nodes` read and write, in order of first appearance."""
        return list(dict.fromkeys(n for node in nodes for n in node.inputs + node.outputs))

    def row_blocks(self, node: Node) -> list[slice]:
        """The weight rows each output of a linear is made from: all of them for one output,
        consecutive blocks of each output's features for several (a gated MLP's fc_a, fc_b)."""
        if len(node.outputs) == 1:
            return [slice(None)]
        sizes = [self.values[n].features for n in node.outputs]
        return [slice(lo, lo + n) for lo, n in zip(accumulate([0] + sizes), sizes)]

    def root(self, name: str) -> str:
        """The value whose buffer holds `name`: its part's root, or itself."""
        part = self.values[name].part
        return part[0] if part else name

    def view(self, name: str, root):
        """The array of value `name` given its root's array (or its root's gradient)."""
        part = self.values[name].part
        if not part:
            return root
        return root[:, :, part[1]:part[1] + self.values[name].shape((1, 1))[2]]

    def steps(self, layers: int) -> list[tuple]:
        """The forward pass as the training tape records it, one step a tape node:
        (prefix, block or None, node, part), a linear of several outputs once per output
        (`part`, else None). The tape's backward runs them in reverse."""
        nodes = ([("", 0, n) for n in self.stem]
                 + [(f"h.{i}.", i, n) for i in range(layers) for n in self.block]
                 + [("", None, n) for n in self.head])
        return [(prefix, layer, node, part) for prefix, layer, node in nodes
                for part in (range(len(node.outputs)) if node.kind == "linear" else (None,))]

    def kept(self) -> frozenset[str]:
        """The values a backward reads (every node's inputs but an add's, the outputs a node
        saves) and the model's output, each as its root: what training keeps from forward
        to backward."""
        nodes = self.stem + self.block + self.head
        read = {n for node in nodes if node.kind != "add" for n in node.inputs}
        return frozenset(self.root(n) for n in read | {n for node in nodes for n in node.saved}
                         | {self.head[-1].outputs[-1]})


def parameter_names(node: Node, prefix: str, params) -> list[str]:
    """The parameters `node` reads, of those in `params`: for each of its weights
    `<prefix><w>.weight`, then `.bias` where the model has one (prefix: h.{i}. in a block)."""
    return [name for w in node.weights for name in (f"{prefix}{w}.weight", f"{prefix}{w}.bias")
            if name in params]


def model_graph(a) -> Graph:
    """The graph of an Arch (runtime/model.py): rope nodes with rope positions, two fc
    outputs for a gated activation, the ops and parameters arch_of resolved."""
    def per_token(*tail):
        return lambda lead: (*lead, *tail)

    stream = per_token(a.d)
    H, KVH, D = a.heads, a.kv_heads, a.head_dim
    heads, kv, qk = per_token(H, D), per_token(KVH, D), per_token(H + KVH, D)
    fc = ("fc_a", "fc_b") if a.gated else ("fc",)
    in_place = a.rope_in_place

    def of_qkv(name, shape, head):
        return Value(name, shape, grad="d.qkv", part=("qkv", head))

    values = [
        Value("idx", per_token()),
        Value("x", stream, grad="d.x"),
        Value("ln_1", stream, "ln", "d.ln"),
        Value("qkv", per_token(H + 2 * KVH, D), grad="d.qkv"),
        of_qkv("q", heads, 0), of_qkv("k", kv, H), of_qkv("v", kv, H + KVH),
        of_qkv("qk", qk, 0), of_qkv("qk_rope", qk, 0),
        *((of_qkv("q_rope", heads, 0), of_qkv("k_rope", kv, H)) if in_place else
          (Value("q_rope", heads, grad="d.q_rope"), Value("k_rope", kv, grad="d.k_rope"))),
        Value("attn", heads, grad="d.attn"),
        Value("lse", lambda lead: (lead[0], a.heads, *lead[1:]), per_row=True),
        Value("attn_proj", stream, "proj", "d.x"),
        Value("x_mid", stream, "x", "d.x"),
        Value("ln_2", stream, "ln", "d.ln"),
        *(Value(name, per_token(a.ffn), grad=f"d.{name}") for name in fc),
        Value("act", per_token(a.ffn), grad="d.act"),
        Value("mlp_proj", stream, "proj", "d.x"),
        Value("next", stream, "x", "d.x"),
        Value("x_final", stream, grad="d.x"),
        Value("ln_f", stream, grad="d.ln"),
        Value("logits", lambda lead: (prod(lead), a.vocab_rows), grad="logits"),  # dlogits
    ]

    def norm(x, y, param):
        return Node("norm", (x,), (y,), (param,), a.ops.norm, a.norm_params)

    def rope(x, y):
        return Node("rope", (x,), (y,), op=a.ops.rope, params=a.rope_params)

    q, k = ("q_rope", "k_rope") if a.rope else ("q", "k")
    block = (
        norm("x", "ln_1", "ln_1"),
        Node("linear", ("ln_1",), ("qkv",), ("attn.c_attn",)),
        *((rope("qk", "qk_rope"),) if in_place else
          (rope("q", "q_rope"), rope("k", "k_rope")) if a.rope else ()),
        Node("attention", (q, k, "v"), ("attn", "lse"), op=a.ops.attention,
             saved=("attn", "lse")),
        Node("linear", ("attn",), ("attn_proj",), ("attn.c_proj",)),
        Node("add", ("x", "attn_proj"), ("x_mid",)),
        norm("x_mid", "ln_2", "ln_2"),
        Node("linear", ("ln_2",), fc, ("mlp.c_fc",)),
        Node("activation", fc, ("act",), op=a.ops.activation),
        Node("linear", ("act",), ("mlp_proj",), ("mlp.c_proj",)),
        Node("add", ("x_mid", "mlp_proj"), ("next",)),
    )
    tables = ("wte",) if a.rope else ("wte", "wpe")    # learned positions: wpe[:T] added
    return Graph(values={v.name: v for v in values},
                 stem=(Node("embedding", ("idx",), ("x",), tables, a.ops.embedding),),
                 block=block,
                 head=(norm("x_final", "ln_f", "ln_f"),
                       Node("linear", ("ln_f",), ("logits",), ("wte",))))   # tied, no bias
