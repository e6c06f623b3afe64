"""What the kinds of the runtime's own kernels share: a kind without a spec whose one op holds
kernels the runtime launches itself, outside any op call (runtime/engine/kinds/support.py):
the step's scalars, the sampler's draw, the bf16 steps, the decoder's row moves. Each says its
signatures (`sigs`, each one's stage the runtime's call) and what its template takes besides
(`context`); the template gets the kernels by stage, as `sigs` where they are of one dtype and
per dtype as `dtypes` (each with its name, C type and `sigs`)."""
from __future__ import annotations

from eulergen.generator import ir
from eulergen.generator.emit import dtype_values
from eulergen.generator.kinds.base import OpKind
from eulergen.signature import DTYPES, KernelSig


class Support(OpKind):
    spec = False

    def sigs(self) -> tuple[KernelSig, ...]:
        raise NotImplementedError(f"{self.name}: no kernels")

    def context(self) -> dict:
        """What its template takes besides the header and the kernels."""
        return {}

    def render_alone(self, header):
        sigs = self.sigs()
        dtypes = [dict(d, sigs={k.stage: k for k in sigs if k.dtype == d["name"]})
                  for d in dtype_values(DTYPES) if any(k.dtype == d["name"] for k in sigs)]
        one = dtypes[0]["sigs"] if len(dtypes) == 1 else None
        source = self.render_template(header=header, sigs=one, dtypes=dtypes, **self.context())
        return ir.RenderedCuda(source, sigs)
