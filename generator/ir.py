"""The derived form of an operator: what derive.py produces and the printers consume.

Every value here is frozen and built once from an OpSpec. Expressions are sympy
expressions over real Symbols named exactly as in the spec (inputs, params, reductions,
index symbols); gradients are named `d<name>`; CSE temporaries are `t0, t1, …`.
Templates never see sympy: printers turn `Code` into lines of CUDA, numpy or C.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from eulergen.signature import CFunction, KernelSig

if TYPE_CHECKING:   # sympy costs 0.5-3 s to import: a run whose ops are built never needs it
    import sympy as sp


@dataclass(frozen=True)
class Location:
    file: str
    line: int


@dataclass(frozen=True)
class Assign:
    name: str
    expr: sp.Expr


@dataclass(frozen=True)
class Code:
    """Straight-line code: CSE temporaries first, then the named results, in order.

    For `update` ops the results are sequential: a later result may read an earlier
    one's new value under the same name (m, then v, then p)."""
    temps: tuple[Assign, ...]
    results: tuple[Assign, ...]

    def result(self, name: str) -> sp.Expr:
        return next(a.expr for a in self.results if a.name == name)

    def only(self, names) -> "Code":
        """The results in `names` and just the temporaries they read."""
        results = tuple(a for a in self.results if a.name in names)
        needed = {s.name for a in results for s in a.expr.free_symbols}
        temps = []
        for a in reversed(self.temps):
            if a.name in needed:
                temps.append(a)
                needed |= {s.name for s in a.expr.free_symbols}
        return Code(tuple(reversed(temps)), results)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.results)

    @property
    def uses(self) -> frozenset[str]:
        """The free names the code reads: none of its temporaries, nor a result it
        reads after computing it."""
        import sympy as sp
        defined = {a.name for a in self.temps}
        uses: set[str] = set()
        for a in self.temps + self.results:
            uses |= {s.name for s in a.expr.free_symbols if isinstance(s, sp.Symbol)} - defined
            defined.add(a.name)
        return frozenset(uses)


@dataclass(frozen=True)
class Param:
    """A scalar known at launch (eps, base, lr). `runtime` params change between calls
    (lr, step) and never trigger a rebuild; the others have a default from the spec."""
    name: str
    default: float | None


@dataclass(frozen=True)
class Operand:
    """An input or output tensor of an op.

    role, by kind:
      pointwise: 'elem'
      row:       'row' (per element of the row), 'weight' (shared across rows, length N),
                 'index' (one integer per row, e.g. a target id), outputs 'row' or 'scalar'
                 (one value per row)
      pair:      'pair' (element k pairs with k + D/2 along the last axis)
      update:    'state' (read and written in place), 'grad' (read only), 'work' (a
                 matrix step's operand: written, then read, never kept)
      attention: 'q', 'k', 'v', outputs 'o'
    """
    name: str
    role: str
    differentiable: bool = True


@dataclass(frozen=True)
class Pass:
    """One sweep over a row that forms one or more reductions at once.

    `body` computes, per element, the term each reduction accumulates; its results are
    named after the reductions. `ops[name]` is 'sum', 'mean' (sum then ÷ N) or 'max'."""
    ops: tuple[tuple[str, str], ...]
    body: Code


# The two symbols an Online.factor reads: the running max before and after it grew.
RESCALE_FROM, RESCALE_TO = "from_", "to_"


@dataclass(frozen=True)
class Online:
    """A sum (or mean) whose per-element term reads a stabilizer max and rescales when the
    max moves: term(max = b) = term(max = a)·factor(a, b), factor free of the element
    symbols (for exp(x - m): exp(a - b)). So it may be accumulated in the max's own pass
    against the running max (the CUDA block-per-row kernels do; warp-per-row kernels and
    the numpy modules keep the plain passes).
    Derive also checks that the term vanishes as the max's argument goes to -inf, so that
    elements of -inf add nothing while the running max is still -inf."""
    name: str      # the reduction
    op: str        # 'sum' | 'mean'
    max: str       # the stabilizer it reads
    term: Code     # one result named `name`: the per-element term, reading `max`
    factor: sp.Expr  # over Symbols RESCALE_FROM (a) and RESCALE_TO (b), params, N, row scalars


@dataclass(frozen=True)
class Pick:
    """A sum of where(i == s, e, 0) over a row, s a per-row index input (a target id): e at
    column s, or 0 when s is outside the row. CUDA row kernels read that one column instead
    of testing every element (the numpy modules keep the plain passes)."""
    name: str      # the reduction
    index: str     # the index input s
    value: Code    # one result named `name`: e, reading row operands, weights and i at s


@dataclass(frozen=True)
class PointwiseDerived:
    forward: Code   # results: the outputs
    backward: Code  # results: d<input> for each differentiable input; reads d<output>


@dataclass(frozen=True)
class RowDerived:
    """Row ops (map → reduce → map over the last axis). Symbols inside row code:
    an input's own name is its value at element i; `i` is the element index and `N` the
    row length (both usable in formulas); index inputs and reductions are per-row scalars.
    Per-element output grads are `d<y>`; per-row (scalar) output grads `d<loss>`."""
    passes: tuple[Pass, ...]       # forward reductions, level by level
    stabilizers: tuple[str, ...]   # max reductions that only stabilise (no gradient)
    elem_outputs: Code             # outputs with role 'row'
    row_outputs: Code              # outputs with role 'scalar'
    adjoint_pass: Pass | None      # backward: the row sums the reduction adjoints need
    adjoints: Code                 # backward: per-row d<reduction> from the adjoint sums
    elem_grads: Code               # backward: d<row input>, and d<weight> per element of
                                   # one row (the caller sums those over rows)
    online: tuple[Online, ...] = ()  # sums of later passes that may join their max's pass
    picks: tuple[Pick, ...] = ()     # sums that are one column's value


@dataclass(frozen=True)
class PairDerived:
    """Indexed pointwise over pairs (RoPE). Pair input x gives symbols x0 = x[..., k] and
    x1 = x[..., k + D/2]; outputs y0, y1 likewise. Index symbols and their roles
    ('position', 'pair', 'head_dim', 'head') are in `index`."""
    index: tuple[tuple[str, str], ...]
    forward: Code   # results: y0, y1 for each pair output y
    backward: Code  # results: dx0, dx1 for each pair input x; reads dy0, dy1


@dataclass(frozen=True)
class MatrixStep:
    """An update op's step between its two pointwise phases (`matrix:` in its spec): the
    work input `orthogonalize` of each 2-D parameter, scaled to a Frobenius norm of about 1
    (x / (‖x‖ + eps)), then `steps` Newton-Schulz iterations X ← aX + (bA + cA²)X, A = XXᵀ
    (XᵀX and X(bA + cA²) where the matrix has more rows than columns), as GEMMs on the
    runtime's side. The parameters it does not take (the embeddings, the head, the 1-D
    ones) are its op's `rest` op's (UpdateDerived.rest)."""
    orthogonalize: str
    steps: int
    coefficients: tuple[float, float, float]
    eps: float


@dataclass(frozen=True)
class UpdateDerived:
    """In-place update (optimizer step), no backward. `step.results` are sequential. With a
    matrix step: `normalize` (the work input over its norm), then the runtime's GEMMs,
    then `apply` (sequential too). `rest`: the update op of the parameters that are no
    Linear weight (the embeddings, the tied head, the 1-D ones); None: this op steps them
    too (required with a matrix step)."""
    step: Code
    matrix: MatrixStep | None = None
    normalize: Code | None = None
    apply: Code | None = None
    rest: str | None = None


@dataclass(frozen=True)
class AttentionDerived:
    """Score f(s, i, j, h, params) with s = q·k; scale = 1/sqrt(head_dim) and
    n_heads are available as symbols. mask is a sympy relational/boolean over i, j (and h),
    or None for no mask. dscore is ∂f/∂s."""
    score: sp.Expr
    dscore: sp.Expr
    mask: sp.Basic | None


@dataclass(frozen=True)
class DerivedOp:
    name: str
    kind: str                      # its kind's name (generator/registry.py)
    inputs: tuple[Operand, ...]
    outputs: tuple[Operand, ...]
    params: tuple[Param, ...]
    body: PointwiseDerived | RowDerived | PairDerived | UpdateDerived | AttentionDerived
    where: Location
    spec_sha256: str               # hash of the spec file's bytes, for headers and caches
    fast_math: bool = False


@dataclass(frozen=True)
class RenderedCuda:
    """The CUDA of one op: the .cu text and the kernels it defines."""
    source: str
    kernels: tuple[KernelSig, ...]


@dataclass(frozen=True)
class RenderedC:
    """The C of one op (`eulergen export-c`'s CPU build): the .c text and its functions."""
    source: str
    functions: tuple[CFunction, ...]
