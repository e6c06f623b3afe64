"""An attention op's plan (generator/plan_attention.py) → one .cu file of flash-attention
kernels. This module prints: the score, its derivative ∂score/∂s and the mask as CUDA, and
each kernel's entry point, whose parameter list is its KernelSig's."""
from __future__ import annotations

from functools import lru_cache

import jinja2
import sympy as sp

from eulergen import TEMPLATES_DIR
from eulergen.generator import ir
from eulergen.generator.emit import header, new_environment, spec_label, wrap_lines
from eulergen.generator.plan import CTYPE
from eulergen.generator.plan_attention import AttentionKernel, AttentionPlan
from eulergen.generator.printer import cuda_expr


def _kernel(k: AttentionKernel) -> dict:
    """One entry point's template values."""
    ctx = {"role": k.role, "name": k.sig.name, "ctype": CTYPE[k.sig.dtype],
           "threads": k.sig.geometry.threads, "args": wrap_lines(k.sig.c_params),
           "call": list(k.call)}
    if k.role == "rowdot":
        return dict(ctx, comment="delta = rowsum(dO ∘ O), one warp per (batch, head, row)")
    g = k.sig.geometry
    mask = f"eg_attn::MASK_{g.mask.upper()}"
    wgmma = getattr(g, "isa", "mma") == "wgmma"
    targs = [ctx["ctype"], g.head_dim, k.warps, *([] if wgmma else [k.targ]), g.tile, mask]
    return dict(ctx, function=f"attention_{k.role}{'_wgmma' if wgmma else ''}",
                targs=[str(a) for a in targs], scale=cuda_expr(1 / sp.sqrt(g.head_dim)),
                comment=f"{k.role}{' (wgmma, sm_90a)' if wgmma else ''}, D = {g.head_dim}: "
                        f"{g.block_rows} {k.rows} rows a block, tiles of {g.tile}")


@lru_cache(maxsize=4)   # one Environment a loader: its compiled templates are reused
def _env(override: jinja2.BaseLoader | None) -> jinja2.Environment:
    loader = jinja2.FileSystemLoader(str(TEMPLATES_DIR))
    if override is not None:
        loader = jinja2.ChoiceLoader([override, loader])
    return new_environment(loader, undefined=jinja2.StrictUndefined, trim_blocks=True,
                           lstrip_blocks=True, keep_trailing_newline=True)


def render_attention(derived: ir.DerivedOp, plan: AttentionPlan, *,
                     templates: jinja2.BaseLoader | None = None) -> ir.RenderedCuda:
    """The .cu text of one attention op's planned kernels. `templates` may override template
    files by name (the CPU emulation tests replace attention_ptx.cuh.j2)."""
    body: ir.AttentionDerived = derived.body
    # The same header as every other generated kernel file, with the spec path relative to
    # the package, so that generated/ is byte-identical on every machine.
    label = spec_label(derived)
    source = _env(templates).get_template("attention.cu.j2").render(
        header=header(label, derived.spec_sha256), op=plan.op, spec=label,
        doc=f"{plan.op}: flash attention, forward and backward",
        score_text=str(body.score),
        mask_text=cuda_expr(body.mask) if plan.mask != "none" else "", params=plan.params,
        head_consts=[{"name": n, "text": cuda_expr(e)} for n, e in plan.head_consts],
        score2_text=cuda_expr(plan.score2), dscore_text=cuda_expr(plan.dscore),
        kernels=[_kernel(k) for k in plan.kernels])
    return ir.RenderedCuda(source=source, kernels=plan.sigs)
