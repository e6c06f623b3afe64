"""What every op kind is to the generator: the interface the stages ask (spec.load_spec,
derive, check, plan_ops, render, numpy_module, build), with its defaults.

A kind is one instance of a subclass, listed in generator/registry.py. A kind written as
YAML specs (`spec`) reads the keys it allows, derives, checks, plans and renders its ops
and prints their numpy modules; a kind without (`spec` False, the embedding) is one op named
after it, planned and rendered from its templates alone (`render_alone`), with its operands
written out (`inputs`, `outputs`) and no numpy module.
"""
from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from eulergen import TEMPLATES_DIR
from eulergen.generator import ir
from eulergen.generator.emit import file_label, render_template


class OpKind:
    name: ClassVar[str]
    template: ClassVar[str]          # the file (in `folder`) its CUDA renders through
    templates: ClassVar[str]         # a glob (in `folder`) of every file rendering reads
    folder: Path = TEMPLATES_DIR            # a kind outside the package may set its own
    spec: ClassVar[bool] = True      # written as YAML specs (else: from templates alone)
    keys: ClassVar[frozenset[str]] = frozenset()   # spec keys besides spec.COMMON
    required: ClassVar[tuple[str, ...]] = ()
    symbols: ClassVar[tuple[str, ...]] = ()        # names every formula may use undeclared
    inputs: ClassVar[tuple[ir.Operand, ...]] = ()  # a kind without specs: its op's operands
    outputs: ClassVar[tuple[ir.Operand, ...]] = ()

    @property
    def template_label(self) -> str:
        """Its template as headers and the manifest name it: templates/<file>."""
        return file_label(self.folder / self.template)

    def template_files(self) -> list[Path]:
        """The files its rendering reads, besides common.cuh.j2 (what its build key hashes)."""
        return sorted(self.folder.glob(self.templates))

    def render_template(self, **ctx) -> str:
        return render_template(self.template, self.folder, **ctx)

    # ---- the stages' questions ----------------------------------------------------------
    # A kind of specs answers derive, check, plan, render and numpy_source, and those below
    # where their defaults do not serve it; a kind without, render_alone. Either may print
    # C (c_source, c_alone) and the C of training (c_train_source, c_train_alone).

    def derive(self, spec, temps) -> tuple:
        """(body, inputs, outputs: ir.Operands) of an OpSpec's DerivedOp
        (generator/derive.py), CSE temporaries drawn from `temps` (differentiate.Temps)."""
        raise NotImplementedError(f"{self.name} ops are not derived")

    def check(self, spec, derived: ir.DerivedOp, mod) -> list:
        """`eulergen check`'s rows (generator/gradcheck.Row) of the op, whose generated
        numpy module is `mod`."""
        raise NotImplementedError(f"{self.name} ops are not checked")

    def plan(self, op: ir.DerivedOp):
        """Every choice of the op's kernels, as a frozen plan whose kernels are KernelSigs."""
        raise NotImplementedError(f"{self.name} ops are not planned")

    def render(self, op: ir.DerivedOp, plan, header: str) -> ir.RenderedCuda:
        """The .cu text of the op, printed from its plan, and the plan's signatures."""
        raise NotImplementedError(f"{self.name} ops are not rendered from a spec")

    def numpy_source(self, op: ir.DerivedOp) -> str:
        """The text of the op's numpy module (most through generator/numpy_text.py)."""
        raise NotImplementedError(f"{self.name} ops have no numpy module")

    def render_alone(self, header: str) -> ir.RenderedCuda:
        """A kind without specs: its op's .cu text and signatures, from its templates."""
        raise NotImplementedError(f"{self.name} ops are rendered from specs")

    def c_source(self, op: ir.DerivedOp, header: str) -> ir.RenderedC | None:
        """The op's forward as C functions (generator/c_text.py), printed from its derived
        expressions, for `eulergen export-c`'s CPU build; None: the kind has no C printer,
        and export-c refuses a model that runs its ops."""
        return None

    def c_alone(self, header: str) -> ir.RenderedC | None:
        """A kind without specs: its op's C functions (None: none)."""
        return None

    def c_train_source(self, op: ir.DerivedOp, header: str) -> ir.RenderedC | None:
        """The C functions of the calls only training makes (the backward, attention's
        forward over whole sequences), printed from the same derived expressions, for
        `eulergen export-c --train` (generated/c/<op>.train.c); None: the kind has none,
        and export-c --train refuses a model that trains its ops."""
        return None

    def c_train_alone(self, header: str) -> ir.RenderedC | None:
        """A kind without specs: its op's C functions of training (None: none)."""
        return None

    def read_operands(self, doc, data: dict, names) -> dict:
        """OpSpec fields read before the params and lets: its inputs (and index)."""
        return {}

    def read_formulas(self, doc, data: dict, names, fields: dict) -> dict:
        """OpSpec fields read after them: its formulas (`fields`: the operands read)."""
        return {}

    def fusions(self, op: ir.DerivedOp) -> dict[str, tuple[ir.DerivedOp, ir.DerivedOp]]:
        """Its fused variants by name: the op whose forward is each one's forward, and the
        op whose backward is its backward (generator/fuse.py)."""
        return {}

    def manifest_outputs(self, op: ir.DerivedOp) -> tuple[ir.Operand, ...]:
        """The outputs its manifest entry lists: what a forward call returns."""
        return op.outputs

    def manifest(self, op: ir.DerivedOp) -> dict:
        """What its manifest entry has besides what every op's has (build.py)."""
        return {}
