"""One call API over both backends (docs/internals.md, "runtime/engine/ops.py").

    lib = OpLibrary(get_backend("auto"))
    y = lib.forward("rmsnorm", x, w, eps=1e-5)
    dx, dw = lib.backward("rmsnorm", x, w, dy, eps=1e-5)
    lib.forward("gelu", x, out=y)              # write into a planned buffer
    lib.step("adamw", p, g, m, v, lr=3e-4, step=1)   # or control=: a device array of lr, step…
    lib.forward("rope", q, out=q, pos0=t)      # pair ops: first position (KV-cache decoding)
    o = lib.decode("causal_attention", q, k_cache, v_cache, pos0)   # attention over a KV cache
    loss, dx = lib.fused("cross_entropy", x, target, dloss, out=(loss, x))
    gelu = lib.op("gelu"); lib.forward(gelu, x, out=y)   # an entry, resolved once (the model's)
    h, y = lib.forward("rmsnorm", x, r, w, fusion="add")  # fused variants (the manifest's
    dx, dw = lib.backward("rmsnorm", h, w, dy, dh, fusion="add")   # `fusions`), below
    y = lib.forward("gelu", x, b, fusion="bias")          # gelu(x + b), b [F] over rows
    dx, db = lib.backward("gelu", x, b, dy, fusion="bias")

Each op's kind (runtime/engine/kinds/, through runtime/engine/registry.py) says which calls
it takes and runs them: on numpy the generated numpy modules (the same derived math as the
kernels); on a GPU the op's generated kernels, launched through runtime/engine/kernels.py,
which checks shapes, dtypes and contiguity before the launch.

Results: `forward` returns one array bare and several as a tuple (spec order);
`backward` always returns a tuple, one gradient per differentiable input in input order
(the module's GRADS), so a tape can zip it with the inputs; `fused` returns the forward
outputs followed by the gradients; with `out=` the given arrays come back.

bf16 on the GPU: CuPy has no bfloat16 dtype, so a bf16 tensor is a uint16 array holding
the bf16 bit patterns (the top half of the float32 bits). `to_bf16` rounds float32 to
nearest-even into that form and `from_bf16` widens it back exactly (runtime/engine/bf16.py,
with the runtime's other steps on bf16 arrays); a kernel's dtype
(f32 or bf16) follows its first floating input. Compute inside kernels is fp32; per-row
scalar outputs such as a loss stay float32 whatever the storage dtype. The numpy
backend computes in float32 or float64 and has no bf16.

Fused variants (generator/fuse.py), `fusion=` on forward and backward, with the arrays
the manifest's `fusions` names: `add` (norm-shaped row ops): forward (x, branch,
weights…) -> (h = x + branch, outputs…); backward (h, weights…, d_outputs…, dh) -> (dx =
dh + the op's dx at h, d_weights…), so `out=` may give dh's array as dx (an in-place add
into the stream's gradient). `bias` (pointwise ops): forward (x…, b…) -> the op of x + b,
each x [..., F] and its b [F]; backward (x…, b…, d_outputs…) -> (dx…, db…), db the column
sums of dx.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from eulergen.errors import EulerError, suggest
from eulergen.runtime.engine.backend import Backend
from eulergen.runtime.engine.kinds.base import OpKind
from eulergen.runtime.engine.manifest import BUILTIN_MANIFEST, OpEntry, load_manifest
from eulergen.runtime.engine.registry import kind_of
from eulergen.signature import variant_name


class OpLibrary:
    """The ops of the built-in manifest and of any extra manifests (user ops), by name.

    A later manifest's op replaces an earlier one of the same name: the spec loader has
    already refused such a clash unless the user's spec says `override: true`."""

    def __init__(self, backend: Backend, manifests: list[str | Path] = ()):
        self.backend = backend
        self.ops: dict[str, OpEntry] = {}
        self._cuda = None
        if backend.is_gpu:
            from eulergen.runtime.engine.cuda_ops import CudaOps
            self._cuda = CudaOps()
        self._missing_builtin = not BUILTIN_MANIFEST.exists()
        paths = ([] if self._missing_builtin else [BUILTIN_MANIFEST]) + [Path(p) for p in manifests]
        for path in paths:
            ops = load_manifest(path).ops
            for op in ops.values():   # an op of a kind this runtime does not know: refused here
                kind_of(op)
            self.ops.update(ops)

    def op(self, name: str) -> OpEntry:
        try:
            return self.ops[name]
        except KeyError:
            pass
        hint = suggest(name, self.ops)
        if self._missing_builtin:
            hint += f"; {BUILTIN_MANIFEST} is missing: run `eulergen build`"
        raise EulerError(f"unknown op {name!r}{hint}", key="op") from None

    def workspace_elements(self, op: OpEntry, stage: str, shape, *, dtype: str = "f32",
                           table_rows: int = 0, fusion: str = "", precision: str = "") -> int:
        """The float32 elements a `stage` call of `op` (its `fusion` variant, in the
        `precision` variant) over `dtype` ("f32" | "bf16") inputs of `shape` needs from the
        caller's `workspace=` on this backend (a memory plan asks): the CUDA kernels'
        temporaries (cuda_ops.workspace_elements); numpy needs none."""
        if not self._cuda:
            return 0
        from eulergen.runtime.engine.cuda_ops import workspace_elements
        return workspace_elements(op, stage, shape, dtype, table_rows=table_rows, fusion=fusion,
                                  precision=precision)

    def _entry(self, op: str | OpEntry) -> OpEntry:
        """A call's op: its name, looked up here, or its entry, resolved once by the caller."""
        return op if isinstance(op, OpEntry) else self.op(op)

    # -- the calls: each takes an op's name or its OpEntry (`lib.op(name)`) ---------------

    def forward(self, name: str | OpEntry, *inputs, out=None, fusion: str = "",
                precision: str = "", **params):
        """`fusion`: the op's fused variant of that name (module docstring); `precision`:
        its precision variant (signature.PRECISIONS: the operands' storage types; numpy
        computes in its arrays' dtype, which is the same math)."""
        op = self._entry(name)
        kind = _kind(op, "forward")
        side = self._side(op, fusion, "forward")
        self._arity(op, "forward", inputs, len(side.inputs), side)
        keywords = kind.keywords(params)
        prec = kind.precision_keywords(op, precision)   # checked on both backends
        p = self._params(op, params)
        if self._cuda:
            got = kind.forward(self._cuda, op, inputs, _tuple(out), p, fusion, **keywords, **prec)
            return got[0] if len(got) == 1 else tuple(got)
        got = getattr(kind.module(op), variant_name("forward", fusion))(
            *inputs, **p, **keywords, _out=_tuple(out))
        return self._deliver(op, "forward", got, out, len(side.outputs))

    def backward(self, name: str | OpEntry, *inputs_and_douts, out=None, workspace=None,
                 accumulate=False, fusion: str = "", precision: str = "", copy=None,
                 **params):
        """`workspace`: a planned float32 buffer for the GPU kernels' temporaries
        (`workspace_elements` says how big); numpy needs none and ignores it.
        `accumulate`: add the gradients into `out` instead of overwriting it, one flag for
        all or one per gradient (GRADS order); ops of a kind that accumulates only (the
        embedding: its table gradient meets the tied LM head's). `fusion`: the op's fused
        variant of that name; `precision` as for forward, and `copy`: a bf16 array its
        autocast kernels also write the row input's gradient into, rounded (GPU only)."""
        op = self._entry(name)
        kind = _kind(op, "backward")
        side = self._side(op, fusion, "backward")
        self._arity(op, "backward", inputs_and_douts, len(kind.backward_names(op, side)), side)
        keywords = kind.keywords(params)
        prec = kind.precision_keywords(op, precision)   # checked on both backends
        adds = self._accumulate(op, kind, accumulate, out)
        p = self._params(op, params)
        if self._cuda:
            if copy is not None:
                prec["copy"] = copy
            return tuple(kind.backward(self._cuda, op, inputs_and_douts, _tuple(out), p,
                                       workspace, adds, fusion, **keywords, **prec))
        if copy is not None:
            raise EulerError(f"{op.name}.backward: copy= is a bf16 copy; the numpy backend "
                             "has no bf16", file=op.spec, key="copy")
        module = kind.module(op)
        if kind.accumulates:   # its numpy backward writes into `out` itself, adding as asked
            return module.backward(*inputs_and_douts, out=_tuple(out), accumulate=adds)
        got = getattr(module, variant_name("backward", fusion))(*inputs_and_douts, **p,
                                                                 **keywords, _out=_tuple(out))
        grads = self._deliver(op, "backward", got, out, len(side.grads))
        return grads if isinstance(grads, tuple) else (grads,)

    def decode(self, name: str | OpEntry, q, k_cache, v_cache, pos0: int, *, out=None,
               keys: int | None = None, workspace=None, new=None, **params):
        """Attention of new queries q [B, Tq, H, D], at positions pos0 … pos0+Tq-1, over a KV
        cache [B, Tmax, KVH, D] whose rows 0 … pos0+Tq-1 are valid (later rows are never
        read) -> o [B, Tq, H, D]: rows pos0 … of `forward` over the whole sequence.
        `new`: (k, v) [B, Tq, KVH, D] of those positions, written into the cache's rows
        pos0 … by the same call (on the GPU inside the decode kernel), which then need not
        hold them yet.
        On the GPU, `keys` fixes the split of the cache whatever pos0 is and `workspace`
        is its planned (part, counts) (runtime/engine/attention.py attention_decode); numpy needs
        neither."""
        op = self._entry(name)
        kind = _kind(op, "decode")
        p = self._params(op, params)
        pos0 = int(pos0)
        if self._cuda:   # checked there, once per layout of the arrays
            return kind.decode(self._cuda, op, q, k_cache, v_cache, pos0, out, p, keys, workspace,
                               new)
        got = kind.numpy_decode(kind.module(op), q, k_cache, v_cache, pos0, p, new)
        return self._deliver(op, "decode", got, out, 1)

    def step(self, name: str | OpEntry, *state_and_grads, control=None, copy=None,
             gemm=None, workspace=None, half=False, **params) -> None:
        """An update op's step, in place. Its kernels read the values that change between
        steps from `control`, an array on this backend holding `control_slots(op)` (skip,
        grad_scale, then the op's runtime params; float32 on the GPU, as the kernels read
        it, float32 or float64 on numpy), so that a captured step replays with new ones;
        without it the runtime params come by value (`lr=`, `step=`) and a control array of
        them is made for this call (not skipped, grads unscaled).
        `copy`: a bf16 (uint16) array the bf16 kernel writes the updated weight into,
        rounded (GPU only: numpy has no bf16).
        An op with a matrix step (`op.matrix`) steps one parameter, its arrays [rows, cols]:
        the Newton-Schulz GEMMs run on `gemm` (the model's, runtime/engine/gemm.py; None: a
        plain one, fp32) over `workspace`, a flat float32 array of
        `newton_schulz.workspace_elements(rows, cols)` (None: one made for the call);
        `half`: its iterations in bf16 (GPU only: a bf16 run's)."""
        op = self._entry(name)
        kind = _kind(op, "step")
        self._arity(op, "step", state_and_grads, len(op.inputs))
        runtime = [k for k, v in op.params.items() if v is None]
        slots = self.control_slots(op)
        if control is None:
            given = self._params(op, params)
            values = {"skip": 0.0, "grad_scale": 1.0, **given}   # not skipped, grads unscaled
            control = self.backend.xp.asarray(np.array([values[s] for s in slots],
                                                       np.float32 if self._cuda else np.float64))
        else:
            passed = [k for k in params if k in runtime]
            if passed:
                raise EulerError(f"{op.name}.step: {passed[0]!r} comes from control= when "
                                 "that is given", file=op.spec, key=f"params.{passed[0]}")
            dtypes = (np.float32,) if self._cuda else (np.float32, np.float64)
            if control.dtype not in dtypes or tuple(control.shape) != (len(slots),):
                raise EulerError(f"{op.name}.step: control= must be "
                                 f"{' or '.join(np.dtype(d).name for d in dtypes)} "
                                 f"[{len(slots)}] ({', '.join(slots)}), got {control.dtype} "
                                 f"{tuple(control.shape)}", file=op.spec, key="control")
            given = self._params(op, {**params, **dict.fromkeys(runtime, 0.0)})
        fixed = {k: v for k, v in given.items() if k not in runtime}
        if copy is not None and not self._cuda:
            raise EulerError(f"{op.name}.step: copy= is a bf16 copy; the numpy backend has "
                             "no bf16", file=op.spec, key="copy")
        if half and (op.matrix is None or not self._cuda):
            raise EulerError(f"{op.name}.step: half= iterates a matrix step in bf16, on a GPU "
                             "only", file=op.spec, key="half")
        if op.matrix is not None:
            self._matrix_step(op, kind, state_and_grads, fixed, control, copy, gemm, workspace,
                              half)
        elif self._cuda:
            kind.step(self._cuda, op, state_and_grads, fixed, control, copy)
        else:
            kind.module(op).step(*state_and_grads, control, **fixed)

    def _matrix_step(self, op, kind, arrays, fixed, control, copy, gemm, workspace,
                     half) -> None:
        """A matrix op's phases and Newton-Schulz GEMMs over one [rows, cols] parameter."""
        from eulergen.runtime.engine import newton_schulz
        from eulergen.runtime.engine.gemm import gemm_for
        from eulergen.runtime.engine.launch_args import same_shape
        named = dict(zip((o.name for o in op.inputs), arrays))
        shape = tuple(arrays[0].shape)
        if len(shape) != 2:
            raise EulerError(f"{op.name}.step: a matrix step takes [rows, cols] arrays, got "
                             f"{shape}", file=op.spec, key="matrix")
        same_shape(op, "step", named, shape)
        fixed = {**fixed, "rows": float(shape[0]), "cols": float(shape[1])}
        if workspace is None:
            workspace = self.backend.xp.zeros(newton_schulz.workspace_elements(*shape),
                                              np.float32)
        if self._cuda:
            from eulergen.runtime.engine.kinds.update import dtype_of
            dtype = dtype_of(op, arrays)

            def phase(part, values):
                kind.phase(self._cuda, op, part, values, {} if part == "normalize" else fixed,
                           control, copy if part == "apply" else None, dtype)
        else:
            module = kind.module(op)

            def phase(part, values):
                if part == "normalize":
                    module.normalize(values[op.matrix.orthogonalize], values["_sumsq"], control)
                else:
                    getattr(module, part or "step")(*(values[o.name] for o in op.inputs),
                                                   control, **fixed)
        newton_schulz.step(op.matrix, named, phase, gemm or gemm_for(self.backend, False),
                           workspace, self.backend.xp, half)

    def control_slots(self, name: str | OpEntry) -> tuple[str, ...]:
        """What each element of an update op's `control` array holds, as its kernels (and
        its numpy module, on numpy) were generated to read them."""
        op = self._entry(name)
        if self._cuda:
            return op.kernel("step", "f32").control
        return tuple(_kind(op, "step").module(op).CONTROL)

    def fused(self, name: str | OpEntry, *inputs_and_douts, out=None, **params) -> tuple:
        """Forward and backward in one call: the forward outputs, then the gradients.

        On a GPU this is the op's one-pass kernel where it has one (cross-entropy's
        `fwdbwd`: loss and dlogits in one pass, without storing probabilities). On numpy it
        is forward then backward of the same generated module, the backward writing `out`'s
        gradients as it goes (each row read before it is written) and the forward's outputs
        copied after, so a gradient buffer may alias an input (dlogits over logits) here
        too."""
        op = self._entry(name)
        kind = _kind(op, "fused")
        n_in = len(op.inputs)
        self._arity(op, "fused", inputs_and_douts, len(kind.backward_names(op, op)))
        inputs = inputs_and_douts[:n_in]
        p = self._params(op, params)
        if self._cuda:
            return tuple(kind.fused(self._cuda, op, inputs_and_douts, _tuple(out), p))
        module = kind.module(op)
        fwd = module.forward(*inputs, **p)
        fwd = fwd if isinstance(fwd, tuple) else (fwd,)
        grads = module.backward(*inputs_and_douts, **p,
                                _out=None if out is None else _tuple(out)[len(fwd):])
        grads = grads if isinstance(grads, tuple) else (grads,)
        return self._deliver(op, "fused", fwd + grads, out,
                             len(op.outputs) + len(op.grads), bare=False)

    # -- helpers -------------------------------------------------------------------------

    @staticmethod
    def _accumulate(op: OpEntry, kind: OpKind, accumulate, out) -> tuple[bool, ...]:
        """`accumulate=` as one flag per gradient."""
        flags = (tuple(bool(a) for a in accumulate) if isinstance(accumulate, (tuple, list))
                 else (bool(accumulate),) * len(op.grads))
        if len(flags) != len(op.grads):
            raise EulerError(f"{op.name}.backward: accumulate= has {len(flags)} flags, expected "
                             f"{len(op.grads)} ({', '.join(op.grads)})", file=op.spec,
                             key="accumulate")
        if any(flags) and not kind.accumulates:
            raise EulerError(f"{op.name}.backward: accumulate= is not for a {kind.name} op "
                             "(its backward writes its gradients); add them yourself",
                             file=op.spec, key="accumulate")
        if any(flags) and out is None:
            raise EulerError(f"{op.name}.backward: accumulate= needs out= (the arrays to add "
                             "into)", file=op.spec, key="accumulate")
        return flags

    @staticmethod
    def _side(op: OpEntry, fusion: str, call: str):
        """The operands a call takes and gives: the op's own, or a fused variant's
        (manifest.Operands)."""
        if not fusion:
            return op
        if fusion not in op.fusions:
            have = ", ".join(op.fusions) or "none"
            raise EulerError(f"op {op.name!r} has no fused variant {fusion!r} (it has: {have}; "
                             "a build older than the fusions: run `eulergen build`)",
                             file=op.spec, key="fusion")
        return getattr(op.fusions[fusion], call)

    @staticmethod
    def _arity(op: OpEntry, call: str, args: tuple, want: int, side=None) -> None:
        if len(args) != want:
            side = side or op
            names = (kind_of(op).backward_names(op, side) if call in ("backward", "fused")
                     else [o.name for o in side.inputs])
            raise EulerError(f"{op.name}.{call} takes {want} arrays ({', '.join(names)}), "
                             f"got {len(args)}", file=op.spec, key=call)

    @staticmethod
    def _params(op: OpEntry, given: dict) -> dict:
        unknown = [k for k in given if k not in op.params]
        if unknown:
            raise EulerError(f"op {op.name!r} has no parameter {unknown[0]!r}"
                             f"{suggest(unknown[0], op.params)}; "
                             f"parameters: {', '.join(op.params) or 'none'}",
                             file=op.spec, key=f"params.{unknown[0]}")
        merged = {**op.params, **given}
        missing = [k for k, v in merged.items() if v is None]
        if missing:
            raise EulerError(f"op {op.name!r} needs parameter {missing[0]!r} at each call "
                             "(it has no default)", file=op.spec, key=f"params.{missing[0]}")
        return merged

    def _deliver(self, op: OpEntry, call: str, got, out, count: int, bare: bool = True):
        """Return the module's results, or the caller's `out` arrays, the results copied
        into those the module has not written itself (numpy modules take `_out=`)."""
        results = got if isinstance(got, tuple) else (got,)
        if len(results) != count:
            raise EulerError(f"numpy module returned {len(results)} arrays from {call}, "
                             f"the manifest says {count} (stale build: run `eulergen build`)",
                             file=str(op.numpy), key=call)
        if out is None:
            return results[0] if bare and count == 1 else tuple(results)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if len(outs) != count:
            raise EulerError(f"{op.name}.{call}: out= has {len(outs)} arrays, expected {count}",
                             file=op.spec, key="out")
        for n, (dst, src) in enumerate(zip(outs, results)):
            if src is None or dst is None:   # an absent optional input has no gradient
                continue
            if tuple(dst.shape) != tuple(src.shape):
                raise EulerError(f"{op.name}.{call}: out[{n}] has shape {tuple(dst.shape)}, "
                                 f"the result has {tuple(src.shape)}", file=op.spec, key="out")
        for dst, src in zip(outs, results):
            if src is not None and dst is not None and src is not dst:
                self.backend.xp.copyto(dst, src, casting="same_kind")
        return outs[0] if bare and count == 1 else tuple(outs)


def _kind(op: OpEntry, call: str) -> OpKind:
    """The op's kind, if it takes the call."""
    kind = kind_of(op)
    if call not in kind.calls:
        raise EulerError(f"op {op.name!r} is a {kind.name} op: it has no {call} (its calls: "
                         f"{', '.join(kind.calls) or 'none'})", file=op.spec, key="kind")
    return kind


def _tuple(out):
    return None if out is None else tuple(out) if isinstance(out, (tuple, list)) else (out,)
