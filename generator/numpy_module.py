"""DerivedOp → the text of a readable numpy module (docs/internals.md, "Generated numpy
modules"): the CPU backend and the reference every kernel is tested against, printed from
the same derived expressions as the CUDA.

Generated functions compute in the float dtype of their inputs and return fresh arrays of
the op's shape: a formula may reduce to a constant or to one of its inputs (`db = dy`),
and callers may write into what they get back.
"""
from __future__ import annotations

import types

from eulergen.generator import fuse, ir
from eulergen.generator.emit import numpy_header
from eulergen.generator.numpy_attention import render_attention_module
from eulergen.generator.plan_ops import update_control
from eulergen.generator.printer import numpy_helpers, numpy_imports, print_numpy
from eulergen.kinds import KINDS

_LAYOUT = '''\
def _dtype(*arrays):
    """The float dtype to compute in: that of the float inputs (float64 if none are)."""
    floats = [a.dtype for a in arrays if a.dtype.kind == "f"]
    return np.result_type(*floats) if floats else np.dtype(np.float64)


def _fresh(value, shape, dtype):
    """value as a new array of the given shape and dtype."""
    out = np.empty(shape, dtype)
    out[...] = value
    return out
'''

_ROW = '''\
def _reduce(op, term, shape):
    """One row reduction over the last axis, kept as [..., 1] to broadcast against rows."""
    term = np.broadcast_to(term, shape)
    if op == "max":
        return np.max(term, axis=-1, keepdims=True)
    total = np.sum(term, axis=-1, keepdims=True)
    return total / shape[-1] if op == "mean" else total
'''


def render_numpy_module(derived: ir.DerivedOp) -> str:
    if derived.kind == "attention":
        return render_attention_module(derived)
    body = {"pointwise": _pointwise, "row": _row, "pair": _pair, "update": _update}[derived.kind]
    functions = body(derived)
    constants = [
        f"KIND = {derived.kind!r}",
        f"INPUTS = {tuple(o.name for o in derived.inputs)!r}",
        f"OUTPUTS = {tuple(o.name for o in derived.outputs)!r}",
        f"PARAMS = {dict((p.name, p.default) for p in derived.params)!r}",
        f"GRADS = {tuple(o.name for o in derived.inputs if o.differentiable and KINDS[derived.kind].backward)!r}",
    ] + ([f"CONTROL = {update_control(derived)!r}"] if derived.kind == "update" else [])
    helpers = numpy_helpers(functions)
    support = ([] if derived.kind == "update" else [_LAYOUT]) + ([_ROW] if derived.kind == "row" else [])
    head = "\n".join([numpy_header(derived),
                      f'"""{derived.name}: numpy reference, generated from its spec."""', "",
                      *numpy_imports(functions), "", *constants])
    blocks = [head, *support, "\n".join(helpers), "\n".join(functions)]
    return "\n\n\n".join(b.strip("\n") for b in blocks if b.strip()) + "\n"


def load_module_from_source(name: str, text: str) -> types.ModuleType:
    """Import generated module text under `name` (for check and tests; not sys.modules)."""
    module = types.ModuleType(name)
    exec(compile(text, f"<generated {name}>", "exec"), module.__dict__)
    return module


# The functions, per kind -----------------------------------------------------------------

def _signature(fname: str, args: list[str], params: tuple[ir.Param, ...],
               extra: tuple[str, ...] = ()) -> str:
    kw = [p.name if p.default is None else f"{p.name}={p.default!r}" for p in params]
    kw += list(extra)
    return f"def {fname}({', '.join(args + (['*'] + kw if kw else []))}):"


def _code(code: ir.Code) -> list[str]:
    return ["    " + line for line in print_numpy(code)]


def _returns(values: list[str]) -> str:
    return "    return " + (values[0] if len(values) == 1 else "(" + ", ".join(values) + ")")


def _pointwise(d: ir.DerivedOp) -> list[str]:
    """forward and backward, then the bias variant's (generator/fuse.py): forward_bias and
    backward_bias, whose bias gradients are summed over every row."""
    return [*_pointwise_pair(d, ""), "", "", *_pointwise_pair(fuse.bias_variant(d), "_bias")]


def _pointwise_pair(d: ir.DerivedOp, suffix: str) -> list[str]:
    body: ir.PointwiseDerived = d.body
    ins = [o.name for o in d.inputs]
    douts = ["d" + o.name for o in d.outputs]
    out = [_signature(f"forward{suffix}", ins, d.params),
           *(f"    {a} = np.asarray({a})" for a in ins),
           f"    shape = np.broadcast_shapes({', '.join(a + '.shape' for a in ins)})",
           f"    dtype = _dtype({', '.join(ins)})",
           *_code(body.forward),
           _returns([f"_fresh({o.name}, shape, dtype)" for o in d.outputs]), "", ""]
    args = ins + douts
    grads = [f"_fresh(np.broadcast_to(d{o.name}, shape).reshape(-1, shape[-1]).sum(axis=0), "
             f"{o.name}.shape, dtype)" if o.role == "bias" else f"_fresh(d{o.name}, shape, dtype)"
             for o in d.inputs]
    out += [_signature(f"backward{suffix}", args, d.params),
            *(f"    {a} = np.asarray({a})" for a in args),
            f"    shape = np.broadcast_shapes({', '.join(a + '.shape' for a in args)})",
            f"    dtype = _dtype({', '.join(args)})",
            *_code(body.backward),
            _returns(grads)]
    return out


def _row_prologue(d: ir.DerivedOp) -> list[str]:
    """Bind the row layout: row inputs [..., N], weights [N], index inputs [...] → [..., 1]."""
    rows = [o.name for o in d.inputs if o.role == "row"]
    floats = [o.name for o in d.inputs if o.role != "index"]
    lines = [f"    {o.name} = np.asarray({o.name})" + ("[..., None]" if o.role == "index" else "")
             for o in d.inputs]
    lines += [f"    shape = {rows[0]}.shape",
              "    N = shape[-1]",
              "    i = np.arange(N)",
              f"    dtype = _dtype({', '.join(floats)})"]
    return lines


def _passes(passes: tuple[ir.Pass, ...]) -> list[str]:
    out = []
    for p in passes:
        out += _code(p.body)
        out += [f"    {name} = _reduce({op!r}, {name}, shape)" for name, op in p.ops]
    return out


def _row(d: ir.DerivedOp) -> list[str]:
    """forward and backward, then the `add` fusion's (generator/fuse.py) where the op has
    it: forward_add, add_forward's forward, and backward_add, add_backward's backward."""
    out = [*_row_forward(d, "forward"), "", "", *_row_backward(d, "backward")]
    fused = fuse.add_variants(d)
    if fused:
        out += ["", "", *_row_forward(fused[0], "forward_add"), "", "",
                *_row_backward(fused[1], "backward_add")]
    return out


def _row_forward(d: ir.DerivedOp, name: str) -> list[str]:
    body: ir.RowDerived = d.body
    results = []
    for o in d.outputs:
        if o.role == "row":
            results.append(f"_fresh({o.name}, shape, dtype)")
        else:
            results.append(f"_fresh(np.broadcast_to({o.name}, shape[:-1] + (1,))[..., 0], "
                           "shape[:-1], dtype)")
    return [_signature(name, [o.name for o in d.inputs], d.params), *_row_prologue(d),
            *_passes(body.passes), *_code(body.elem_outputs), *_code(body.row_outputs),
            _returns(results)]


def _row_backward(d: ir.DerivedOp, name: str) -> list[str]:
    body: ir.RowDerived = d.body
    ins = [o.name for o in d.inputs]
    douts = ["d" + o.name for o in d.outputs]
    out = [_signature(name, ins + douts, d.params), *_row_prologue(d)]
    out += [f"    d{o.name} = np.asarray(d{o.name})" + ("[..., None]" if o.role == "scalar" else "")
            for o in d.outputs]
    out += _passes(body.passes)
    if body.adjoint_pass is not None:
        out += _passes((body.adjoint_pass,))
    out += _code(body.adjoints) + _code(body.elem_grads)
    grads = []
    for o in d.inputs:
        if o.role == "row":
            grads.append(f"_fresh(d{o.name}, shape, dtype)")
        elif o.role == "weight":  # shared across rows: the sum over every row
            grads.append(f"_fresh(np.broadcast_to(d{o.name}, shape).reshape(-1, N).sum(axis=0), "
                         "(N,), dtype)")
    out.append(_returns(grads))
    return out


def _pair_prologue(d: ir.DerivedOp, arrays: list[str]) -> list[str]:
    body: ir.PairDerived = d.body
    lines = [f"    {a} = np.asarray({a})" for a in arrays]
    lines += [f"    shape = {arrays[0]}.shape",
              "    if len(shape) != 4 or shape[-1] % 2:",
              "        raise ValueError(f'expected [B, T, H, D] with D even, got {shape}')",
              "    half = shape[-1] // 2",
              f"    dtype = _dtype({', '.join(arrays)})"]
    lines += [f"    {a}0, {a}1 = {a}[..., :half], {a}[..., half:]" for a in arrays]
    axis = {"position": "(pos0 + np.arange(shape[1])).reshape(1, -1, 1, 1)",
            "head": "np.arange(shape[2]).reshape(1, 1, -1, 1)",
            "pair": "np.arange(half)",
            "head_dim": "shape[-1]"}
    lines += [f"    {name} = {axis[role]}" for name, role in body.index]
    return lines


def _pair_results(names: list[str]) -> list[str]:
    out = []
    for n in names:
        out += [f"    {n} = np.empty(shape, dtype)",
                f"    {n}[..., :half] = {n}0",
                f"    {n}[..., half:] = {n}1"]
    return out + [_returns(names)]


def _pair(d: ir.DerivedOp) -> list[str]:
    body: ir.PairDerived = d.body
    ins = [o.name for o in d.inputs]
    outs = [o.name for o in d.outputs]
    # pos0: the position of the first row (KV-cache decoding), as the CUDA kernels take it
    out = [_signature("forward", ins, d.params, ("pos0=0",)), *_pair_prologue(d, ins),
           *_code(body.forward), *_pair_results(outs), "", ""]
    args = ins + ["d" + n for n in outs]
    out += [_signature("backward", args, d.params, ("pos0=0",)), *_pair_prologue(d, args),
            *_code(body.backward), *_pair_results(["d" + n for n in ins])]
    return out


def _update(d: ir.DerivedOp) -> list[str]:
    body: ir.UpdateDerived = d.body
    ins = [o.name for o in d.inputs]
    updated = [a.name for a in body.step.results]
    control = update_control(d)
    fixed = tuple(p for p in d.params if p.default is not None)
    out = [_signature("step", ins + ["control"], fixed),
           '    """In place and sequential: a later update reads the new value of an earlier one.',
           "    `control`: the values of CONTROL (a skip flag, the factor the grads are scaled",
           '    by, the runtime params), as the CUDA kernels read them."""',
           f"    {', '.join(control)} = (float(c) for c in control)",
           "    if skip:",
           "        return"]
    out += [f"    {o.name} = {o.name}*grad_scale" for o in d.inputs if o.role == "grad"]
    out += [f"    {', '.join('_' + n for n in updated)} = {', '.join(updated)}"]
    out += _code(body.step)
    out += [f"    _{n}[...] = {n}" for n in updated]
    return out
