"""model.h, model.c and ops.h of `eulergen export-c`'s program: an Arch as C, one token at a
time over a KV cache, node by node as its graph (runtime/model/graph.py) gives the stem, the
block and the head, as the decoder (runtime/generate/decoder.py) runs them at one row.

Each value is its graph.py slot's buffer (a part, a view of its root's heads); each op node
is a call of the op's C function by the signature its manifest entry records (`CFunction`),
its arguments bound by name as the runtime binds kernels; a linear is the backend's
eg_linear. `Call`s record every op call, for the CUDA build's launches (c_cuda.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

from eulergen.errors import EulerError
from eulergen.runtime.interop import c_weights
from eulergen.runtime.model.params import parameters
from eulergen.signature import CFunction

WIDTH = 96          # model.c's lines
IN_BLOCK = "layer"  # the layer of a block's nodes: model.c's variable of that name
# the config key of each op the decoder runs
SLOTS = {"norm": "model.norm", "activation": "model.activation",
         "attention": "model.attention", "embedding": "model", "rope": "model.positions"}


@dataclass(frozen=True)
class Call:
    """One call of an op's C function: its arguments, an int where it is a constant (a
    size), else C text."""
    op: object              # manifest OpEntry
    fn: CFunction
    values: dict


def literal(v) -> str:
    if isinstance(v, float):
        return f"{v!r}f"
    return str(v)


def bound(op, fn: CFunction, values: dict, indent: str, calls: list) -> list[str]:
    """The call of `op`'s C function `fn`, each argument bound by name from `values`
    (recorded in `calls`); EulerError where one has none."""
    missing = [n for n, _ in fn.args if n not in values]
    if missing:
        raise EulerError(f"{fn.name} takes {missing[0]!r}, which export-c has no value for "
                         "(a newer generator? rebuild with `eulergen build`)",
                         file=str(op.manifest), key=f"ops.{op.name}.c_functions")
    calls.append(Call(op, fn, values))
    return wrapped(fn.name, [literal(values[n]) for n, _ in fn.args], indent)


def wrapped(head: str, args: list[str], indent: str, brackets: str = "();") -> list[str]:
    """`head(args…);` in lines of at most WIDTH, continued four spaces in (`brackets`: "{};"
    for an initializer)."""
    lines, line = [], f"{indent}{head}{brackets[0]}"
    for n, a in enumerate(args):
        piece = a + (", " if n + 1 < len(args) else brackets[1:])
        if len(line) + len(piece.rstrip()) > WIDTH and not line.endswith(brackets[0]):
            lines.append(line.rstrip())
            line = indent + "    "
        line += piece
    return lines + [line]


class _Program:
    def __init__(self, a, context: int):
        self.a, self.g, self.context = a, a.graph, context
        self.tensors = parameters(a)
        self.index = {p.name: i for i, p in enumerate(self.tensors)}
        self.calls: list[Call] = []
        self.buffers, self.sizes = self._buffers()
        self.block_params = [local for node in self.g.block
                             for local, _ in self.g.parameters(node, 0, self.index)]

    # -- values, buffers, parameters -------------------------------------------------

    def _buffers(self) -> tuple[dict[str, str], dict[str, int]]:
        """Each value the forward makes -> its buffer, and each buffer's floats. The head
        reads what the last block hands on where that block left it (one row: no copy)."""
        g, out, sizes = self.g, {}, {}

        def add(names):
            for n in names:
                if n != "idx" and n not in out:
                    out[n] = g.values[g.root(n)].buffer
                    sizes[out[n]] = max(sizes.get(out[n], 0), self._elements(g.root(n)))
        for node in g.stem + g.block:
            add(node.inputs + (node.outputs[:1] if node.kind == "attention" else node.outputs))
        for value, (_, head) in g.handoff.items():
            out[head] = out[value]
        for node in g.head:
            add(node.inputs + node.outputs)
        return out, sizes

    def _elements(self, name: str) -> int:
        return prod(self.g.values[name].shape((1, 1)))

    def ptr(self, name: str) -> str:
        part = self.g.values[name].part
        offset = part[1] * self.a.head_dim if part else 0
        return f"m->{self.buffers[name]}" + (f" + {offset}" if offset else "")

    def strided(self, operand: str, name: str) -> dict:
        """An operand of [B, T, heads, head_dim] at one token: its pointer and strides."""
        token = self._elements(self.g.root(name))
        return {operand: self.ptr(name), f"{operand}_sb": token, f"{operand}_st": token,
                f"{operand}_sh": self.a.head_dim}

    def heads(self, name: str) -> int:
        return self.g.values[name].shape((1, 1))[2]

    def params(self, node, layer) -> list[tuple[str, str]]:
        """(name as the node gives it, C expression) of each parameter it reads: in a block
        P(…), the layer's (BLOCK), else the tensor itself."""
        if layer == IN_BLOCK:
            return [(local, f"P({_enum(local)})")
                    for local, _ in self.g.parameters(node, 0, self.index)]
        return [(local, f"m->w[{self.index[full]}]")
                for local, full in self.g.parameters(node, layer, self.index)]

    # -- the calls ---------------------------------------------------------------------

    def call(self, op, fn: CFunction, values: dict, indent: str) -> list[str]:
        return bound(op, fn, values, indent, self.calls)

    def op_params(self, op, node) -> dict:
        given = {**op.params, **node.params}
        unset = [n for n, v in given.items() if v is None]
        if unset:
            raise EulerError(f"{op.name}'s param {unset[0]!r} has no default and the model gives "
                             "none", file=str(op.manifest), key=f"ops.{op.name}.params")
        return {n: float(v) for n, v in given.items()}

    def node(self, node, layer, indent: str = "  ") -> list[str]:
        """One graph node as C: a comment naming it, then its calls."""
        what = node.kind + (f" {node.op.name}" if node.op is not None else
                            f" {', '.join(node.weights)}")
        fused = " (the residual add fused)" if node.fusion == "add" else ""
        outputs = node.outputs[:1] if node.kind == "attention" else node.outputs  # lse: training's
        lines = [f"{indent}/* {', '.join(node.inputs)} -> {what}{fused} -> {', '.join(outputs)} */"]
        return lines + getattr(self, f"_{node.kind}")(node, layer, indent)

    def _embedding(self, node, layer, indent):
        a = self.a
        (_, wte), *rest = self.params(node, layer)
        wpe = f"{rest[0][1]} + (long long)pos * {a.d}" if rest else "NULL"   # row pos: T = 1
        return self.call(node.op, node.op.c_function("forward"), {
            "ids": "m->ids", "wte": wte, "wpe": wpe, "out": self.ptr(node.outputs[0]),
            "BT": 1, "T": 1, "C": a.d, "V": a.vocab_rows}, indent)

    def _norm(self, node, layer, indent):
        op = node.op
        side = op.fusions[node.fusion].forward if node.fusion else op
        weights = iter(expr for _, expr in self.params(node, layer))
        rows = iter(node.inputs)
        values = {o.name: self.ptr(next(rows)) if o.role == "row" else next(weights)
                  for o in side.inputs}
        values |= {o.name: self.ptr(n) for o, n in zip(side.outputs, node.outputs)}
        values |= {**self.op_params(op, node), "rows": 1, "cols": self.a.d}
        return self.call(op, op.c_function("forward", node.fusion), values, indent)

    def _rope(self, node, layer, indent):
        op = node.op
        (x,), (y,) = node.inputs, node.outputs
        values = {**self.strided(op.inputs[0].name, x), **self.strided(op.outputs[0].name, y),
                  **self.op_params(op, node), "B": 1, "T": 1, "H": self.heads(x),
                  "D": self.a.head_dim, "pos0": "pos"}
        return self.call(op, op.c_function("forward"), values, indent)

    def _attention(self, node, layer, indent):
        a, op = self.a, node.op
        q, k, v = node.inputs
        kv = a.kv_heads * a.head_dim
        lines = [f"{indent}eg_copy(m->{c}_cache[layer] + (long long)pos * {kv}, {self.ptr(n)}, "
                 f"{kv});   /* {n} into the cache at pos */" for c, n in (("k", k), ("v", v))]
        cache = {"k": "m->k_cache[layer]", "v": "m->v_cache[layer]"}
        values = {**self.strided("q", q), **self.strided("o", node.outputs[0]),
                  **{f"{c}{s}": val for c in cache for s, val in
                     (("", cache[c]), ("_sb", self.context * kv), ("_st", kv),
                      ("_sh", a.head_dim))},
                  "tq": 1, "pos0": "pos", "batch": 1, "n_heads": a.heads,
                  "n_kv_heads": a.kv_heads, "head_dim": a.head_dim, **self.op_params(op, node)}
        return lines + self.call(op, op.c_function("decode"), values, indent)

    def _linear(self, node, layer, indent):
        (w, *b) = [expr for _, expr in self.params(node, layer)]
        x = node.inputs[0]
        n_in = self._features(x)
        lines = []
        for y, rows in zip(node.outputs, self.g.row_blocks(node)):
            lo = rows.start or 0
            weight = f"{w} + {lo * n_in}" if lo else w
            bias = (f"{b[0]} + {lo}" if lo else b[0]) if b else "NULL"
            lines += wrapped("eg_linear", [self.ptr(x), weight, bias, self.ptr(y),
                                         str(self._features(y)), str(n_in)], indent)
        return lines

    def _activation(self, node, layer, indent):
        op = node.op
        bias = [expr for _, expr in self.params(node, layer)]
        fusion = "bias" if bias else ""
        side = op.fusions["bias"].forward if fusion else op
        halves = iter(f"{bias[0]} + {s.start}" if s.start else bias[0]
                      for s in (self.g.bias_blocks(node) if bias else ()))
        rows = iter(node.inputs)
        values = {o.name: next(halves) if o.role == "bias" else self.ptr(next(rows))
                  for o in side.inputs}
        values |= {o.name: self.ptr(n) for o, n in zip(side.outputs, node.outputs)}
        width = self._features(node.outputs[0])
        values |= self.op_params(op, node)
        values |= {"rows": 1, "cols": width} if fusion else {"n": width}
        return self.call(op, op.c_function("forward", fusion), values, indent)

    def _features(self, name: str) -> int:
        """Floats a token: a value's trailing dims (the logits: [tokens, vocab_rows])."""
        shape = self.g.values[name].shape((1, 1))
        return prod(shape[2:]) if len(shape) > 2 else shape[-1]


def _enum(local: str) -> str:
    return local.upper().replace(".", "_")


def sources(a, context: int) -> tuple[dict[str, str], list[Call]]:
    """{model.h, model.c, ops.h: text} of an Arch sampled in a context of `context` tokens
    (the run's training.seq_len, as `eulergen sample` takes it), and model.c's op calls."""
    p = _Program(a, context)
    g = p.g
    stem = [line for node in g.stem for line in p.node(node, -1)]
    block = [line for node in g.block for line in p.node(node, IN_BLOCK)]
    head = [line for node in g.head for line in p.node(node, None)]
    return {"model.h": _header(a, context), "model.c": _model_c(p, stem, block, head),
            "ops.h": _ops_h(p.calls)}, p.calls


def _header(a, context: int) -> str:
    constants = [("LAYERS", a.layers, ""), ("HIDDEN", a.d, ""), ("HEADS", a.heads, ""),
                 ("KV_HEADS", a.kv_heads, ""), ("HEAD_DIM", a.head_dim, ""),
                 ("VOCAB", a.vocab, "the ids the model draws from: model.vocab_size"),
                 ("VOCAB_ROWS", a.vocab_rows, "the embedding's rows: VOCAB padded to 64"),
                 ("MAX_SEQ", a.max_seq, "the positions the model has"),
                 ("CONTEXT", context, "the positions the KV cache holds: training.seq_len"),
                 ("FFN", a.ffn, "the MLP's width")]
    return "\n".join([
        "// model.h: written by `eulergen export-c`: the model this program was exported for.",
        "#pragma once", "",
        *(f"#define EG_{n} {v}" + (f"   /* {c} */" if c else "") for n, v, c in constants), "",
        "typedef struct Model Model;", "",
        "// The weights of `path` (refused unless they are this model's) on the backend, with an",
        "// empty KV cache.",
        "Model* model_load(const char* path);",
        "// The logits [EG_VOCAB_ROWS] (on the host) after the token at position pos, whose",
        "// earlier positions the cache holds.",
        "const float* model_step(Model* m, int token, int pos);", ""])


def _model_c(p: _Program, stem, block, head) -> str:
    a = p.a
    header, tensors = weight_tables(a)
    table = []
    for layer in range(a.layers):
        idx = [p.index[full] for node in p.g.block
               for _, full in p.g.parameters(node, layer, p.index)]
        table.append(f"  {{{', '.join(map(str, idx))}}},   /* h.{layer} */")
    buffers = ", ".join(f"*{b}" for b in p.sizes)
    allocs = [f"  m->{b} = eg_alloc(sizeof(float) * {n});" for b, n in p.sizes.items()]
    kv = p.context * a.kv_heads * a.head_dim
    return "\n".join([
        "// model.c: written by `eulergen export-c` from the model's graph",
        "// (runtime/model/graph.py): its stem, its block at each layer and its head, node by",
        "// node, for one token at a time over a KV cache. The ops are the generated C",
        "// functions of ops.h; eg_linear is the backend's matrix-vector product (backend.h).",
        "#include <stdlib.h>", "",
        '#include "backend.h"', '#include "error.h"', '#include "model.h"', '#include "ops.h"',
        '#include "weights.h"', "",
        "// weights.bin's header and tensors, as this program expects them",
        f"static const HeaderField HEADER[] = {{", *header, "};",
        f"static const TensorSpec TENSORS[] = {{", *tensors, "};",
        f"enum {{ TENSOR_COUNT = {len(p.tensors)} }};", "",
        "// The parameters a block reads, by the names its nodes give them, and their tensors",
        "// at each layer (the norm that ends a block takes the next block's ln_1, after the",
        "// last block ln_f).",
        f"enum {{ {', '.join(map(_enum, p.block_params))}, BLOCK_PARAMS }};",
        "static const int BLOCK[EG_LAYERS][BLOCK_PARAMS] = {", *table, "};",
        "#define P(name) m->w[BLOCK[layer][name]]", "",
        "struct Model {",
        "  const float* w[TENSOR_COUNT];   // the weights, on the backend",
        f"  float {buffers};   // one token's values: graph.py's slots",
        f"  float* k_cache[EG_LAYERS];   // [EG_CONTEXT, EG_KV_HEADS, EG_HEAD_DIM] each",
        "  float* v_cache[EG_LAYERS];",
        "  int* ids;                      // the token, where the embedding reads it",
        "  float* host_logits;",
        "};", "",
        "Model* model_load(const char* path) {",
        "  Model* m = calloc(1, sizeof *m);",
        '  if (!m) eg_fail("out of memory");',
        "  float* host[TENSOR_COUNT];",
        "  const long long floats = weights_load(path, HEADER, sizeof HEADER / sizeof *HEADER,",
        "                                        TENSORS, TENSOR_COUNT, host);",
        "  const float* device = eg_weights(host[0], floats);",
        "  for (int i = 0; i < TENSOR_COUNT; ++i) m->w[i] = device + (host[i] - host[0]);",
        *allocs,
        "  for (int layer = 0; layer < EG_LAYERS; ++layer) {",
        f"    m->k_cache[layer] = eg_alloc(sizeof(float) * {kv});",
        f"    m->v_cache[layer] = eg_alloc(sizeof(float) * {kv});",
        "  }",
        "  m->ids = eg_alloc(sizeof(int));",
        "  m->host_logits = malloc(sizeof(float) * EG_VOCAB_ROWS);",
        '  if (!m->host_logits) eg_fail("out of memory");',
        "  return m;", "}", "",
        "// The stem: the token's embedding, then the first norm.",
        "static void stem(Model* m, int pos) {", *stem, "}", "",
        "// The block at `layer` for the token at position pos: k and v join the cache there.",
        "static void block(Model* m, int layer, int pos) {", *block, "}", "",
        "// The head: the logits of the final norm (the embedding's table, tied).",
        "static void head(Model* m) {", *head, "}", "",
        "const float* model_step(Model* m, int token, int pos) {",
        "  eg_upload(m->ids, &token, sizeof token);",
        "  stem(m, pos);",
        "  for (int layer = 0; layer < EG_LAYERS; ++layer) block(m, layer, pos);",
        "  head(m);",
        "  eg_download(m->host_logits, m->logits, sizeof(float) * EG_VOCAB_ROWS);",
        "  return m->host_logits;", "}", ""])


def weight_tables(a) -> tuple[list[str], list[str]]:
    """The lines of weights.bin's header fields and tensor table (weights.h's HeaderField and
    TensorSpec) that a program of the Arch expects."""
    header = [f'  {{"{n}", {v}, {int(f)}}},' for n, v, f in c_weights.header(a)]
    tensors = [f'  {{"{t.name}", {len(t.shape)}, {{{", ".join(map(str, (*t.shape, 0)[:2]))}}}}},'
               for t in parameters(a)]
    return header, tensors


def prototypes(calls: list[Call]) -> list[str]:
    """The declaration of each op function `calls` call, once, under a comment naming it."""
    protos = []
    for op, fn in dict.fromkeys((c.op, c.fn) for c in calls):
        what = fn.stage + (f", its {fn.fusion} fusion" if fn.fusion else "")
        protos += [f"// {op.name} ({op.spec}): {what}",
                   *wrapped(f"void {fn.name}", [f"{t} {n}" for n, t in fn.args], "")]
    return protos


def _ops_h(calls: list[Call]) -> str:
    protos = prototypes(calls)
    return "\n".join([
        "// ops.h: written by `eulergen export-c`: the op functions model.c calls, printed from",
        "// the ops' derived expressions: their generated C (make cpu: <op>.c), or the launches",
        "// of their generated kernels (make cuda: kernels.cu).",
        "#pragma once", "", "#ifdef __cplusplus", 'extern "C" {', "#endif", "",
        *protos, "", "#ifdef __cplusplus", "}", "#endif", ""])
