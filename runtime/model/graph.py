"""The model's forward pass, written once as data: the stem, one block and the head, each
a tuple of Nodes over named Values. runtime/model/gpt.py builds the training memory plan and
tape from it, runtime/generate/decoder.py the KV-cache decoder's plan and tape.

    stem   idx -> embedding -> next;  next -> norm -> next_ln          (block 0's x, ln_1)
    block  ln_1 -> c_attn -> qkv (q, k, v: its parts) [-> rope -> q_rope, k_rope]
             -> attention -> attn, lse -> c_proj -> attn_proj
           x + attn_proj -> add + norm -> x_mid, ln_2
           ln_2 -> c_fc -> fc (fc_a, fc_b: gated) -> activation (+ c_fc's bias) -> act
             -> c_proj -> mlp_proj
           x_mid + mlp_proj -> add + norm -> next, next_ln            (the next x, ln_1)
    head   ln_f -> wte (tied) -> logits

Each residual add is folded into the norm after it (the norm op's `add` fusion: one pass
writes the sum, the stream the model keeps, and the normed row), and c_fc's bias into the
activation (its `bias` fusion: act(fc + b) in one pass; c_fc writes x·Wᵀ alone). So the
norm that ends a block is the next block's ln_1: a block reads `x` and `ln_1` and hands
on `next` and `next_ln` (`handoff`), which are the next block's x and ln_1 and, after the
last block, the head's x_final and ln_f; the stem hands block 0 its x and ln_1 the same
way. A norm's weights are named for the value it writes, so the one that ends a block
takes the next block's ln_1 weights (after the last block, ln_f's).

Each value has its own name within a block (training plans h.{i}.ln_1 and h.{i}.ln_2);
its `slot` is the buffer it takes where one buffer serves every block (the decoder runs
the blocks one after another over one set of activations; training keeps the values no
backward reads there, in its workspace), and its `grad` the training workspace buffer that
holds its gradient, which every block shares too. The values a residual add joins share
one gradient (`d.x`): the add's backward is the fan-in of writers adding into it, which
each norm's backward does in its own pass.

A value with a `part` is a view of some heads (axis 2) of another value, its root, and
its gradient the same view of the root's: q, k and v are parts of `qkv`, which c_attn
writes in one GEMM. Where the rope op allows it (arch.rope_in_place) q_rope and k_rope
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
    stream: bool = False        # the residual stream (the embedding's output, the norms'
                                # sums): float32, as its gradient, in autocast precision

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
    'linear' (a GEMM). `weights`: the prefixes of the parameters it reads, in the order it
    takes them (Graph.parameter_names). A linear with several outputs makes them from
    consecutive row blocks of its weight, one GEMM each (dense outputs, one gradient each).
    `saved`: outputs its backward reads besides its inputs (attention's o and lse).
    `fusion`: the op's fused variant it runs: 'add' (a norm of two inputs x, branch: it
    writes their sum, then the normed row; its backward reads the sum, saved, not its
    inputs). `bias`: the linear whose bias it adds to its inputs (the op's 'bias'
    variant), which that linear then leaves out."""
    kind: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    weights: tuple[str, ...] = ()
    op: object = None                                 # manifest.OpEntry
    params: dict = field(default_factory=dict, hash=False)
    saved: tuple[str, ...] = ()
    fusion: str = ""
    bias: str = ""


@dataclass(frozen=True)
class Graph:
    values: dict = field(hash=False)   # name -> Value
    stem: tuple[Node, ...]
    block: tuple[Node, ...]
    head: tuple[Node, ...]
    layers: int
    # what a block (or the stem) hands on: its name -> (the next block's, the head's)
    handoff: dict = field(hash=False)

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

    def bias_blocks(self, node: Node) -> list[slice]:
        """The rows of the bias of linear `node.bias` that each input of `node` adds: that
        linear's row blocks (a gated activation's fc_a and fc_b: its halves)."""
        linear = next(n for n in self.block if n.kind == "linear" and n.weights == (node.bias,))
        return self.row_blocks(linear)

    def key(self, layer: int | None, name: str) -> tuple:
        """The value a node's name means, as (block, name): at a block's `layer` its own
        values; a name it hands on the next block's value (the stem, at layer -1, hands
        block 0 its own), after the last block the head's; outside the blocks (None) the
        stem's and head's own."""
        if name in self.handoff:
            ours, heads = self.handoff[name]
            return (layer + 1, ours) if layer + 1 < self.layers else (None, heads)
        if layer is not None and layer >= 0 and name in self.order(self.block):
            return (layer, name)
        return (None, name)

    def parameter_names(self, node: Node, layer: int | None, params) -> list[str]:
        """The parameters `node` at `layer` (Graph.key) reads, of those in `params`: for
        each of its weights `<w>.weight`, then `.bias` where the model has one, w prefixed
        h.{layer}. in a block; a weight named for a value the block hands on is that
        value's (the norm that ends a block: the next block's ln_1, after the last block
        ln_f). A linear whose bias a later node adds (`Node.bias`) reads its weight
        alone, and that node the bias."""
        return [name for _, name in self.parameters(node, layer, params)]

    def parameters(self, node: Node, layer: int | None, params) -> list[tuple[str, str]]:
        """parameter_names, each with the name the node gives it (`<w>.weight`, `<w>.bias`:
        the same at every layer)."""
        def scoped(w: str) -> str:
            if w in self.handoff:
                block, name = self.key(layer, w)
                return name if block is None else f"h.{block}.{name}"
            return f"h.{layer}.{w}" if layer is not None and layer >= 0 else w
        added = {n.bias for n in self.block if n.bias}
        names = []
        for w in node.weights:
            names.append((w, "weight"))
            if not (node.kind == "linear" and w in added):
                names.append((w, "bias"))
        if node.bias:
            names.append((node.bias, "bias"))
        return [(f"{w}.{part}", f"{scoped(w)}.{part}") for w, part in names
                if f"{scoped(w)}.{part}" in params]

    def steps(self) -> list[tuple]:
        """The forward pass as the training tape records it, one step a tape node:
        (layer, node, part) with layer as Graph.key takes it (the stem -1, the head None),
        a linear of several outputs once per output (`part`, else None). The tape's
        backward runs them in reverse."""
        nodes = ([(-1, n) for n in self.stem]
                 + [(i, n) for i in range(self.layers) for n in self.block]
                 + [(None, n) for n in self.head])
        return [(layer, node, part) for layer, node in nodes
                for part in (range(len(node.outputs)) if node.kind == "linear" else (None,))]

    def kept(self) -> frozenset[str]:
        """The values a backward reads (every node's inputs but an `add` norm's, the
        outputs a node saves) and the model's output: what training keeps from forward to
        backward, each as its root. A handed-on value is kept as the next block's and the
        head's."""
        nodes = self.stem + self.block + self.head
        read = {n for node in nodes if node.fusion != "add" for n in node.inputs}
        names = read | {n for node in nodes for n in node.saved} | {self.head[-1].outputs[-1]}
        return frozenset(self.root(n) for name in names for n in self.handoff.get(name, (name,)))


def model_graph(a) -> Graph:
    """The graph of an Arch (runtime/model/gpt.py): rope nodes with rope positions, two fc
    outputs for a gated activation, the ops and parameters arch_of resolved."""
    def per_token(*tail):
        return lambda lead: (*lead, *tail)

    width = per_token(a.d)   # a value of the model's width
    H, KVH, D = a.heads, a.kv_heads, a.head_dim
    heads, kv, qk = per_token(H, D), per_token(KVH, D), per_token(H + KVH, D)
    fc = ("fc_a", "fc_b") if a.gated else ("fc",)
    in_place = a.rope_in_place

    def of_qkv(name, shape, head):
        return Value(name, shape, grad="d.qkv", part=("qkv", head))

    values = [
        Value("idx", per_token()),
        Value("x", width, grad="d.x", stream=True),
        Value("ln_1", width, "ln", "d.ln"),
        Value("qkv", per_token(H + 2 * KVH, D), grad="d.qkv"),
        of_qkv("q", heads, 0), of_qkv("k", kv, H), of_qkv("v", kv, H + KVH),
        of_qkv("qk", qk, 0), of_qkv("qk_rope", qk, 0),
        *((of_qkv("q_rope", heads, 0), of_qkv("k_rope", kv, H)) if in_place else
          (Value("q_rope", heads, grad="d.q_rope"), Value("k_rope", kv, grad="d.k_rope"))),
        Value("attn", heads, grad="d.attn"),
        Value("lse", lambda lead: (lead[0], a.heads, *lead[1:]), per_row=True),
        Value("attn_proj", width, "proj", "d.x"),
        Value("x_mid", width, "x", "d.x", stream=True),
        Value("ln_2", width, "ln", "d.ln"),
        *(Value(name, per_token(a.ffn), grad=f"d.{name}") for name in fc),
        Value("act", per_token(a.ffn), grad="d.act"),
        Value("mlp_proj", width, "proj", "d.x"),
        Value("next", width, "x", "d.x", stream=True),
        Value("next_ln", width, "ln", "d.ln"),
        Value("x_final", width, grad="d.x", stream=True),
        Value("ln_f", width, grad="d.ln"),
        Value("logits", lambda lead: (prod(lead), a.vocab_rows), grad="logits"),  # dlogits
    ]

    def norm(inputs, outputs):
        """A norm of x, or (two inputs) of x + branch, writing the sum first; its weights
        are named for the normed value."""
        add = len(inputs) == 2
        return Node("norm", inputs, outputs, (outputs[-1],), a.ops.norm, a.norm_params,
                    saved=outputs[:1] if add else (), fusion="add" if add else "")

    def rope(x, y):
        return Node("rope", (x,), (y,), op=a.ops.rope, params=a.rope_params)

    q, k = ("q_rope", "k_rope") if a.rope else ("q", "k")
    block = (
        Node("linear", ("ln_1",), ("qkv",), ("attn.c_attn",)),
        *((rope("qk", "qk_rope"),) if in_place else
          (rope("q", "q_rope"), rope("k", "k_rope")) if a.rope else ()),
        Node("attention", (q, k, "v"), ("attn", "lse"), op=a.ops.attention,
             saved=("attn", "lse")),
        Node("linear", ("attn",), ("attn_proj",), ("attn.c_proj",)),
        norm(("x", "attn_proj"), ("x_mid", "ln_2")),
        Node("linear", ("ln_2",), fc, ("mlp.c_fc",)),
        Node("activation", fc, ("act",), op=a.ops.activation, bias="mlp.c_fc"),
        Node("linear", ("act",), ("mlp_proj",), ("mlp.c_proj",)),
        norm(("x_mid", "mlp_proj"), ("next", "next_ln")),
    )
    tables = ("wte",) if a.rope else ("wte", "wpe")    # learned positions: wpe[:T] added
    return Graph(values={v.name: v for v in values},
                 stem=(Node("embedding", ("idx",), ("next",), tables, a.ops.embedding),
                       norm(("next",), ("next_ln",))),
                 block=block,
                 head=(Node("linear", ("ln_f",), ("logits",), ("wte",)),),   # tied, no bias
                 layers=a.layers,
                 handoff={"next": ("x", "x_final"), "next_ln": ("ln_1", "ln_f")})
