"""The checked, frozen form of an op spec (OpSpec and its parts), and the readers of the
fields that every kind's spec may share: names, formulas, inputs mapped to roles.

generator/spec.py loads a spec through these and its kind (generator/kinds/); every error
names the spec file, the YAML line of the key at fault and the key path, on one line.
Formulas are parsed by generator/formula.py (a whitelist `ast` walk).
"""
from __future__ import annotations

import keyword
import re
from dataclasses import dataclass

import sympy as sp

from eulergen.errors import Where, suggest
from eulergen.generator import formula
from eulergen.generator.ir import Location, MatrixStep, Param
from eulergen.generator.yaml_doc import YamlDoc

DEFAULT_DOMAIN = (-3.0, 3.0)
DEFAULT_TOLERANCE = 1e-4
_TEMP_NAME = re.compile(r"^t\d+$")
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def symbol(name: str) -> sp.Symbol:
    """Every symbol of every formula: real, named as in the spec."""
    return sp.Symbol(name, real=True)


@dataclass(frozen=True)
class Input:
    name: str
    role: str           # 'elem' for pointwise; otherwise as declared (row, weight, index…)


@dataclass(frozen=True)
class Formula:
    name: str           # the result it defines (an output, reduction, update target…)
    expr: sp.Basic
    where: Where


@dataclass(frozen=True)
class Reduction:
    name: str
    op: str             # 'sum' | 'mean' | 'max'
    expr: sp.Expr       # the per-element term
    where: Where


@dataclass(frozen=True)
class OpSpec:
    """A spec as its kind read it: the fields every kind has, then those of some kinds."""
    name: str
    kind: str
    doc: str
    params: tuple[Param, ...]
    domain: tuple[tuple[str, tuple[float, float]], ...]
    tolerance: float
    kink: float | None
    override: bool
    fast_math: bool                          # opt in to --use_fast_math for this op's kernels
    where: Location
    sha256: str
    inputs: tuple[Input, ...] = ()
    outputs: tuple[Formula, ...] = ()        # pair ops: y0, y1 for each output y
    backward: tuple[Formula, ...] = ()       # pointwise: explicit overrides, named d<input>
    reductions: tuple[Reduction, ...] = ()   # row ops, in order
    stabilizers: tuple[str, ...] = ()        # row ops
    index: tuple[tuple[str, str], ...] = ()  # pair ops: (symbol, role)
    update: tuple[Formula, ...] = ()         # update ops, sequential
    matrix: MatrixStep | None = None         # update ops: the step between update and apply
    apply: tuple[Formula, ...] = ()          # update ops with a matrix step, sequential
    rest: str | None = None                  # update ops: the op of the non-Linear parameters
    score: Formula | None = None             # attention
    mask: Formula | None = None              # attention; None: no mask

    def domain_of(self, name: str) -> tuple[float, float]:
        return dict(self.domain).get(name, DEFAULT_DOMAIN)


def identifier(doc: YamlDoc, name, *path) -> str:
    """The one rule for every name a spec declares (op, inputs, outputs, params, lets,
    reductions, index symbols): ASCII, as C, NVRTC and the config's op keys take them."""
    if not isinstance(name, str) or not IDENTIFIER.match(name) or keyword.iskeyword(name):
        raise doc.error(f"{name!r} is not a valid name (names are ASCII: letters, digits and _, "
                        "not starting with a digit)", *path)
    if name in formula.FUNCTIONS or name in formula.REDUCTIONS or name in formula.CONSTANTS:
        raise doc.error(f"'{name}' is a built-in function or constant; choose another name", *path)
    if name.startswith("_"):
        raise doc.error(f"'{name}': names starting with _ are reserved for generated code", *path)
    if _TEMP_NAME.match(name):
        raise doc.error(f"'{name}' is reserved for generated temporaries; choose another name", *path)
    return name


class Names:
    """Declared names → symbols (or `let` expressions), refusing duplicates and names that
    would collide with generated gradient names."""

    def __init__(self, doc: YamlDoc):
        self.doc = doc
        self.table: dict[str, sp.Basic] = {}

    def add(self, name: str, value: sp.Basic | None, *path) -> sp.Basic:
        identifier(self.doc, name, *path)
        if name in self.table:
            raise self.doc.error(f"'{name}' is declared twice", *path)
        for other in self.table:
            if name == "d" + other or other == "d" + name:
                raise self.doc.error(f"'{name}' and '{other}' collide: gradients are named "
                                     "d<name>", *path)
        self.table[name] = symbol(name) if value is None else value
        return self.table[name]


def formulas(doc: YamlDoc, data: dict, key: str, names: Names) -> tuple[Formula, ...]:
    """The formulas of a mapping `key: {result: formula}`, at least one."""
    items = doc.mapping(data.get(key), key)
    if not items:
        raise doc.error("at least one entry is required", key)
    return tuple(Formula(name, formula.parse(text, names.table, doc.where(key, name)),
                         doc.where(key, name))
                 for name, text in items.items())


def role_inputs(doc: YamlDoc, data: dict, kind: str, roles: tuple[str, ...],
                names: Names, declare=None) -> tuple[Input, ...]:
    """`inputs: {name: role}`, each role one of `roles`; `declare(name)` adds the names
    the input declares (default: its own)."""
    items = doc.mapping(data.get("inputs"), "inputs")
    if not items:
        raise doc.error(f"a {kind} op maps inputs to roles: inputs: {{x: {roles[0]}}}", "inputs")
    out = []
    for name, role in items.items():
        if role not in roles:
            raise doc.error(f"unknown role {role!r} for a {kind} op (expected one of "
                            f"{', '.join(roles)}){suggest(str(role), roles)}", "inputs", name)
        if declare is None:
            names.add(name, None, "inputs", name)
        else:
            declare(name)
        out.append(Input(name, role))
    return tuple(out)
