"""Update ops on a GPU: an optimizer's step, in place over flat buffers (state float32,
grads in the storage dtype, or float32 beside a bf16 weight copy: the autocast kernel),
its per-step values read from a float32 `control` array on the device (signature.CONTROL,
then the op's runtime params). An op with a matrix step (muon) launches its phases around
the Newton-Schulz GEMMs (runtime/engine/newton_schulz.py)."""
from __future__ import annotations

from eulergen.errors import EulerError
from eulergen.runtime.engine.kernels import NULL, storage_dtype_name
from eulergen.runtime.engine.kinds.base import OpKind
from eulergen.runtime.engine.launch_args import same_shape
from eulergen.signature import AUTOCAST


class Update(OpKind):
    name = "update"
    calls = ("step",)

    def step(self, cuda, op, args: tuple, params: dict, control, copy=None) -> None:
        """Every operand the same shape (the caller launches once per weight-decay range;
        a matrix op once per parameter, its arrays [rows, cols]). `control`: the float32
        device array of the kernel's control slots; `copy`: a bf16 array the kernel writes
        the updated weight into (None: not written): the bf16 kernel's, or with float32
        grads the autocast kernel's."""
        named = dict(zip((o.name for o in op.inputs), args))
        same_shape(op, "step", named, args[0].shape)
        self.phase(cuda, op, "", named, params, control, copy, dtype_of(op, args))

    def phase(self, cuda, op, part: str, values: dict, params: dict, control, copy,
              dtype: str) -> None:
        """The kernel of one phase (`part`: '' the step, or a matrix op's 'normalize' or
        'apply') over the arrays and scalars `values` binds by name."""
        kernel = op.kernel("step", dtype, part=part,
                           precision=AUTOCAST if copy is not None and dtype == "f32" else "")
        # the pointer the signature has beyond the values and control: the bf16 copy
        extra = [n for n, t in kernel.args if t.endswith("*") and n not in values
                 and n != "control"]
        first = values[kernel.args[0][0]]
        if copy is not None and (not extra or tuple(copy.shape) != tuple(first.shape)):
            raise EulerError(f"{op.name}.step: copy= wants the weight's shape "
                             f"{tuple(first.shape)}, got {tuple(copy.shape)} for {kernel.name}",
                             file=op.spec, key="copy")
        n = first.size
        values = {**values, **params, "control": control, "n": n,
                  **{e: NULL if copy is None else copy for e in extra}}
        if n:
            cuda.launcher(op).launch(kernel, kernel.geometry.launch(n), values)


def dtype_of(op, args: tuple) -> str:
    """The kernels' dtype: their grads' storage ('f32' without grads)."""
    grads = [a for o, a in zip(op.inputs, args) if o.role == "grad"]
    return storage_dtype_name(grads[0]) if grads else "f32"


KIND = Update()
