"""The model's shape (`Arch`), the ops it runs (`ModelOps`), its forward pass as data
(`Arch.graph`) and its params arena (`Arch.param_layout`), from a ModelConfig checked
against the op library once a run: what the plans, the training tape, data parallel's
buckets and the decoder are built for.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from eulergen.errors import EulerError
from eulergen.runtime.engine.attention import head_dims
from eulergen.runtime.model.graph import Graph, model_graph
from eulergen.runtime.model.params import ParamLayout, padded_vocab, param_layout
from eulergen.signature import select

# norm-op weight inputs are named `weight`, then `bias`, as torch names them
_NORM_PARAM_NAMES = ("weight", "bias")


@dataclass(frozen=True)
class ModelOps:
    """The manifest entries of the ops a model runs, resolved once by arch_of: the tape's
    nodes call the library with them, never by name."""
    norm: object            # manifest.OpEntry
    activation: object
    attention: object
    embedding: object
    loss: object            # cross_entropy
    rope: object = None     # positions 'rope' only


@dataclass(frozen=True)
class Arch:
    """The model's shape, with what it learns from the ops it names."""
    d: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int                        # the tokenizer's (model.vocab_size); vocab_rows is padded
    max_seq: int
    ffn: int                          # F: the activation's width
    gated: bool
    rope: bool
    rope_in_place: bool               # rope_in_place(ops.rope): q_rope, k_rope over q, k
    bias: bool
    norm_weights: tuple[str, ...]     # 'weight'[, 'bias'] per norm, from the op's weight inputs
    norm_params: dict = field(hash=False)
    rope_params: dict = field(hash=False)
    ops: ModelOps = field(repr=False)
    graph: Graph = field(init=False, repr=False, compare=False)   # model_graph of the rest
    param_layout: ParamLayout = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        # made once a shape (budget's one- and two-layer copies get their own): whoever
        # holds the Arch reads this graph and this params layout, none makes another
        object.__setattr__(self, "graph", model_graph(self))
        object.__setattr__(self, "param_layout", param_layout(self))

    @property
    def vocab_rows(self) -> int:
        return padded_vocab(self.vocab)

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


def _need_op(lib, name: str, key: str, kinds: tuple[str, ...]):
    try:
        op = lib.op(name)
    except EulerError as err:
        raise EulerError(err.message, key=key) from None
    if op.kind not in kinds:
        raise EulerError(f"op {name!r} is a {op.kind} op; this slot wants {' or '.join(kinds)}",
                         key=key)
    return op


def _op_params(op, wanted: dict) -> dict:
    """The config values an op declares as parameters (eps, base), and nothing else."""
    return {k: v for k, v in wanted.items() if k in op.params}


def ops_used(m, optimizer: str | None = None) -> tuple[str, ...]:
    """The ops a model of this ModelConfig calls, and its training's `optimizer` (an update
    op; its rest op, which its spec names, is built with it):
    what `eulergen train` builds before it starts (export-c: the model's alone)."""
    return tuple(dict.fromkeys((m.norm, m.activation, m.attention, "cross_entropy")
                               + ((optimizer,) if optimizer else ())
                               + (("rope",) if m.positions == "rope" else ())))


def arch_of(cfg, lib) -> Arch:
    """Check a ModelConfig against the ops it names; EulerError names the key at fault.
    The shape checks that need no op (heads dividing hidden_dim, an even rope head dim…)
    are the config loader's (config._validate): every ModelConfig comes from it."""
    d, H, KVH = cfg.hidden_dim, cfg.num_heads, cfg.num_kv_heads
    norm = _need_op(lib, cfg.norm, "model.norm", ("row",))
    weights = [o.name for o in norm.inputs if o.role == "weight"]
    rows = [o for o in norm.inputs if o.role == "row"]
    if len(rows) != 1 or len(weights) > len(_NORM_PARAM_NAMES) or len(norm.outputs) != 1:
        raise EulerError(f"op {cfg.norm!r} does not look like a norm (one row input, at most "
                         "two weights, one output)", key="model.norm")
    act = _need_op(lib, cfg.activation, "model.activation", ("pointwise",))
    if len(act.inputs) not in (1, 2) or len(act.outputs) != 1:
        raise EulerError(f"activation {cfg.activation!r} has {len(act.inputs)} inputs and "
                         f"{len(act.outputs)} outputs; want 1 (or 2: gated) and 1",
                         key="model.activation")
    # the graph folds the residual adds into the norms and c_fc's bias into the activation
    for op, fusion, key in ((norm, "add", "model.norm"), (act, "bias", "model.activation")):
        if fusion not in op.fusions:
            raise EulerError(f"op {op.name!r} has no `{fusion}` fusion in its manifest (a build "
                             "older than fused variants: run `eulergen build`)", key=key)
    attention = _need_op(lib, cfg.attention, "model.attention", ("attention",))
    if lib.backend.is_gpu:
        _check_head_dim(attention, d, H)
    rope, rope_params = None, {}
    if cfg.positions == "rope":
        rope = _need_op(lib, "rope", "model.positions", ("pair",))
        rope_params = _op_params(rope, {"base": float(cfg.rope_base)})
    ops = ModelOps(norm=norm, activation=act, attention=attention, rope=rope,
                   embedding=_need_op(lib, "embedding", "model", ("embedding",)),
                   loss=_need_op(lib, "cross_entropy", "model", ("row",)))
    return Arch(d=d, layers=cfg.num_layers, heads=H, kv_heads=KVH, head_dim=d // H,
                vocab=cfg.vocab_size, max_seq=cfg.max_seq_len, ffn=cfg.mlp_hidden,
                gated=len(act.inputs) == 2, rope=rope is not None,
                rope_in_place=rope is not None and rope_in_place(rope), bias=bool(cfg.bias),
                norm_weights=_NORM_PARAM_NAMES[:len(weights)],
                norm_params=_op_params(norm, {"eps": float(cfg.norm_eps)}),
                rope_params=rope_params, ops=ops)


def rope_in_place(rope) -> bool:
    """Whether a pair op may rotate q and k where they lie in `qkv`, in one call over both:
    its backward reads only the output gradients (so q and k need not outlive q_rope and
    k_rope) and its formula has no head index (which would count k's heads on from q's)."""
    backward = {name for k in select(rope.kernels.values(), "backward") for name, _ in k.args}
    reads = backward & {o.name for o in rope.inputs + rope.outputs}
    return not reads and "head" not in rope.index.values()


def _check_head_dim(attention, d: int, heads: int) -> None:
    """The flash kernels exist for a few head dims only: refuse another one when the
    config is read, not at the first attention launch after the run has started."""
    dims = head_dims(attention)
    if d // heads in dims:
        return
    fits = [d // hd for hd in dims if d % hd == 0]
    hint = f"; e.g. --set model.num_heads={fits[0]} (num_kv_heads dividing it)" if fits else ""
    raise EulerError(f"head dim {d // heads} (hidden_dim {d} / num_heads {heads}): "
                     f"{attention.name} has CUDA kernels for head dims {dims} only{hint}",
                     key="model.num_heads")
