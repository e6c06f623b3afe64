"""What every op kind is to the runtime: the interface ops.OpLibrary asks, with defaults.

On numpy a call runs the op's generated module (`module`); on a GPU the kind launches its
kernels (`forward`, `backward`, `fused`; an update's `step`, attention's `decode`) on the
device state of a cuda_ops.CudaOps (`cuda`: compiled kernels, workspaces). Each call
checks its arrays' shapes against one another (dtypes, contiguity and devices are checked
in kernels.bind), allocates the outputs it was not given in the storage type the kernel
writes, and launches the kernels with their geometry (eulergen/launch.py).
"""
from __future__ import annotations

from typing import ClassVar

from eulergen.errors import EulerError
from eulergen.launch import Launch
from eulergen.runtime.engine.manifest import OpEntry, load_numpy_module
from eulergen.signature import KernelSig


class OpKind:
    name: ClassVar[str]
    calls: ClassVar[tuple[str, ...]] = ("forward", "backward", "fused")
    accumulates: ClassVar[bool] = False   # its backward may add into out= (accumulate=)
    # the precision variants (signature.PRECISIONS) its forward and backward take, as
    # `precision=` (and the backward a bf16 `copy=` of its input gradient), and its
    # workspace_elements as `precision=`
    precisions: ClassVar[tuple[str, ...]] = ()

    def keywords(self, params: dict) -> dict:
        """Takes out of a call's keywords those that are no spec parameter (a pair op's
        `pos0`); they go on to the numpy module and the kernels."""
        return {}

    def precision_keywords(self, op: OpEntry, precision: str) -> dict:
        """`precision=` as a call's keyword where the kind takes it (none for ''); one
        line naming the kind's precisions where it does not."""
        if not precision:
            return {}
        if precision not in self.precisions:
            raise EulerError(f"op {op.name!r} is a {self.name} op: it has no {precision!r} "
                             f"precision (its kind's: {', '.join(self.precisions) or 'none'})",
                             file=op.spec, key="precision")
        return {"precision": precision}

    def module(self, op: OpEntry):
        """What runs its calls on numpy: the op's generated module."""
        return load_numpy_module(op)

    def backward_names(self, op: OpEntry, side) -> list[str]:
        """The arrays a backward takes, of the op or its fused variant's operands `side`:
        its inputs, then the gradients of its outputs."""
        return [o.name for o in side.inputs] + [f"d{o.name}" for o in side.outputs]

    # ---- on a GPU -------------------------------------------------------------------------

    def forward(self, cuda, op: OpEntry, inputs: tuple, out, params: dict, fusion: str = "",
                **keywords) -> tuple:
        raise NotImplementedError(f"{self.name} ops have no CUDA forward")

    def backward(self, cuda, op: OpEntry, args: tuple, out, params: dict, workspace=None,
                 accumulate: tuple = (), fusion: str = "", **keywords) -> tuple:
        """`workspace`: a float32 buffer of workspace_elements(op, 'backward', …) elements
        for the kernels' temporaries (a planned buffer); None: `cuda`'s own. `accumulate`:
        per gradient, add into `out` rather than overwrite (where the kind accumulates)."""
        raise NotImplementedError(f"{self.name} ops have no CUDA backward")

    def fused(self, cuda, op: OpEntry, args: tuple, out, params: dict) -> tuple:
        """Forward then backward into fresh buffers, so that a gradient `out` may alias an
        input the backward still reads (a kind with a one-pass kernel launches that)."""
        n_in, n_out = len(op.inputs), len(op.outputs)
        outs = self.forward(cuda, op, args[:n_in], None if out is None else tuple(out[:n_out]),
                            params)
        grads = self.backward(cuda, op, args, None, params)
        if out is not None:
            for dst, src in zip(out[n_out:], grads):
                dst[...] = src
            grads = tuple(out[n_out:])
        return tuple(outs) + tuple(grads)

    def workspace_elements(self, op: OpEntry, stage: str, shape, dtype: str, *,
                           table_rows: int = 0, fusion: str = "") -> int:
        """The float32 elements a `stage` call needs from a caller's `workspace` (0: none)
        for inputs of `shape` (cuda_ops.workspace_elements says which shape)."""
        return 0

    # ---- `eulergen export-c`'s CUDA build ----------------------------------------------

    def export_launch(self, op: OpEntry, fn, sizes: dict) -> tuple[KernelSig, Launch, dict]:
        """What the CUDA build of `eulergen export-c` launches for a call of the op's C
        function `fn` (a signature.CFunction) with `sizes` (its integer arguments by name, and
        `keys`, the KV cache's rows), every pointer on a 16-byte boundary: the float32
        kernel, its launch, and the C values of the kernel's arguments that `fn` has not."""
        raise EulerError(f"{self.name} ops have no CUDA launch for export-c",
                         file=str(op.manifest), key=f"ops.{op.name}")

