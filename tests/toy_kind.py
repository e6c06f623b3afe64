"""A toy op kind, `map`: y = f(x) elementwise, forward only, added as every kind is
(docs/internals.md, "Adding an op kind: a walk"): a generator module (`Map`: its spec keys,
derivation, plan, rendering and numpy module), a runtime module (`MapCalls`: the calls its
ops take) and its template (TEMPLATE, written where the test says). A spec of it:

    name: softsq
    kind: map
    inputs: [x]
    map: x*x/(1 + x*x)

tests/test_new_kind.py registers it on both sides and builds, reads back and runs such an
op; tests/gpu/test_new_kind_gpu.py launches its kernels."""
from __future__ import annotations

from pathlib import Path

from eulergen import launch
from eulergen.generator import formula, ir, numpy_text
from eulergen.generator.emit import block
from eulergen.generator.kinds.base import OpKind
from eulergen.generator.opspec import Formula, Input
from eulergen.generator.plan import CTYPE, DTYPES
from eulergen.runtime.engine.kernels import storage_dtype_name
from eulergen.runtime.engine.kinds import base as runtime
from eulergen.runtime.engine.launch_args import outputs
from eulergen.signature import KernelSig

TEMPLATE = """\
// {{ header }}
#include "eulergen_common.cuh"

__device__ __forceinline__ float {{ op }}_map(float {{ x }}) {
{% for line in lines %}  {{ line }}
{% endfor %}  return y;
}
{% for sig in sigs %}

extern "C" __global__ void __launch_bounds__({{ sig.geometry.threads }}) {{ sig.name }}({{ sig.c_params | wrap }}) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x)
    eg_store(y, i, {{ op }}_map(eg_load({{ x }}, i)));
}
{% endfor %}
"""


class Map(OpKind):
    """The generator's side: what a `map` op means to each stage."""
    name = "map"
    template = templates = "map.cu.j2"
    keys = frozenset({"inputs", "map"})
    required = ("inputs", "map")

    def __init__(self, folder: Path):
        self.folder = folder                # where its template is (the package's: templates/)

    def read_operands(self, doc, data, names):
        raw = data.get("inputs")
        if not isinstance(raw, list) or len(raw) != 1:
            raise doc.error("a map op has one input: inputs: [x]", "inputs")
        names.add(raw[0], None, "inputs", 0)
        return {"inputs": (Input(raw[0], "elem"),)}

    def read_formulas(self, doc, data, names, fields):
        where = doc.where("map")
        return {"outputs": (Formula("y", formula.parse(data["map"], names.table, where), where),)}

    def derive(self, spec, temps):
        (x,) = spec.inputs
        code = temps.code([("y", spec.outputs[0].expr)])
        return code, (ir.Operand(x.name, "elem", False),), (ir.Operand("y", "elem", False),)

    def check(self, spec, derived, mod):
        return []                           # no backward to check

    def plan(self, op) -> tuple[KernelSig, ...]:
        (x,) = op.inputs
        return tuple(KernelSig(f"{op.name}_forward_{dt}",
                               ((x.name, f"const {CTYPE[dt]}*"), ("y", f"{CTYPE[dt]}*"),
                                ("n", "long long")),
                               dt, "forward", launch.Update(threads=256, vec=1, grid_max=None))
                     for dt in DTYPES)

    def render(self, op, plan, header):
        source = self.render_template(header=header, op=op.name, x=op.inputs[0].name,
                                      lines=block(op.body).lines, sigs=plan)
        return ir.RenderedCuda(source, plan)

    def numpy_source(self, op):
        (x,) = (o.name for o in op.inputs)
        forward = [numpy_text.signature("forward", [x], op.params, ("_out=None",)),
                   f"    {x} = np.asarray({x})", *numpy_text.code(op.body),
                   numpy_text.returns([f"_fresh(y, {x}.shape, _dtype({x}), _out)"])]
        return numpy_text.module(op, forward, grads=False)


class MapCalls(runtime.OpKind):
    """The runtime's side: a map op takes forward only; on numpy its generated module runs
    it (the default), on a GPU its kernel over the flat operands."""
    name = "map"
    calls = ("forward",)

    def forward(self, cuda, op, inputs, out, params, fusion="", **keywords):
        (x,) = inputs
        kernel = op.kernel("forward", storage_dtype_name(x))
        (y,) = outputs(kernel, ["y"], [x.shape], out, op, "forward")
        if x.size:
            cuda.launcher(op).launch(kernel, kernel.geometry.launch(x.size),
                                     {op.inputs[0].name: x, "y": y, "n": x.size})
        return (y,)
