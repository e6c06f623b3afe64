"""Op specs: YAML with line numbers → a validated, frozen OpSpec; and the ops search path.

Every error names the spec file, the YAML line of the key at fault and the key path, on one
line. Formulas are parsed by generator/formula.py (a whitelist `ast` walk); `let` names are
expanded inline, so derivation sees through them.
"""
from __future__ import annotations

import hashlib
import keyword
import re
from dataclasses import dataclass
from pathlib import Path

import sympy as sp

from eulergen.errors import EulerError, Where, suggest
from eulergen.generator import formula
from eulergen.generator.ir import Location, Param
from eulergen.generator.ops_path import find_ops
from eulergen.generator.yaml_doc import YamlDoc
from eulergen.kinds import SPEC_KINDS as KINDS
_COMMON = {"name", "kind", "doc", "params", "let", "domain", "tolerance", "override", "fast_math"}
KEYS = {
    "pointwise": _COMMON | {"inputs", "outputs", "kink", "backward"},
    "row": _COMMON | {"inputs", "reduce", "stabilizers", "outputs", "kink"},
    "pair": _COMMON | {"inputs", "index", "outputs", "kink"},
    "update": _COMMON | {"inputs", "update"},
    "attention": _COMMON | {"score", "mask", "kink"},
}
REQUIRED = {
    "pointwise": ("inputs", "outputs"),
    "row": ("inputs", "outputs"),
    "pair": ("inputs", "index", "outputs"),
    "update": ("inputs", "update"),
    "attention": ("score",),
}
ROLES = {
    "row": ("row", "weight", "index"),
    "pair": ("pair",),
    "update": ("state", "grad"),
}
INDEX_ROLES = ("position", "pair", "head_dim", "head")
ATTENTION_SYMBOLS = ("s", "i", "j", "h", "n_heads", "scale")
ROW_SYMBOLS = ("i", "N")
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
    name: str
    kind: str
    doc: str
    inputs: tuple[Input, ...]
    params: tuple[Param, ...]
    outputs: tuple[Formula, ...]        # pair ops: y0, y1 for each output y
    reductions: tuple[Reduction, ...]   # row ops, in order
    stabilizers: tuple[str, ...]        # row ops
    index: tuple[tuple[str, str], ...]  # pair ops: (symbol, role)
    update: tuple[Formula, ...]         # update ops, sequential
    score: Formula | None               # attention
    mask: Formula | None                # attention; None: no mask
    backward: tuple[Formula, ...]       # explicit overrides, named d<input>
    domain: tuple[tuple[str, tuple[float, float]], ...]
    tolerance: float
    kink: float | None
    override: bool
    fast_math: bool                     # opt in to --use_fast_math for this op's kernels
    where: Location
    sha256: str

    def domain_of(self, name: str) -> tuple[float, float]:
        return dict(self.domain).get(name, DEFAULT_DOMAIN)


# Field readers ---------------------------------------------------------------------------------

def _identifier(doc: YamlDoc, name, *path) -> str:
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


class _Names:
    """Declared names → symbols (or `let` expressions), refusing duplicates and names that
    would collide with generated gradient names."""

    def __init__(self, doc: YamlDoc):
        self.doc = doc
        self.table: dict[str, sp.Basic] = {}

    def add(self, name: str, value: sp.Basic | None, *path) -> sp.Basic:
        _identifier(self.doc, name, *path)
        if name in self.table:
            raise self.doc.error(f"'{name}' is declared twice", *path)
        for other in self.table:
            if name == "d" + other or other == "d" + name:
                raise self.doc.error(f"'{name}' and '{other}' collide: gradients are named "
                                     "d<name>", *path)
        self.table[name] = symbol(name) if value is None else value
        return self.table[name]


def _check_keys(doc: YamlDoc, data: dict, kind: str) -> None:
    allowed = KEYS[kind]
    for key in data:
        if key not in allowed:
            hint = suggest(str(key), allowed)
            other = [k for k in KINDS if key in KEYS[k]]
            if not hint and other:
                hint = f" (allowed for kind {', '.join(other)})"
            raise doc.error(f"unknown key for a {kind} op{hint}", str(key))
    for key in REQUIRED[kind]:
        if key not in data:
            raise doc.error(f"missing required key '{key}' for a {kind} op", key)


def _params(doc: YamlDoc, data: dict, names: _Names) -> tuple[Param, ...]:
    out = []
    for name, value in doc.mapping(data.get("params"), "params").items():
        names.add(name, None, "params", name)
        if value == "runtime":
            out.append(Param(name, None))
        else:
            out.append(Param(name, doc.number(value, "params", name)))
    return tuple(out)


def _lets(doc: YamlDoc, data: dict, names: _Names) -> None:
    for name, text in doc.mapping(data.get("let"), "let").items():
        expr = formula.parse(text, names.table, doc.where("let", name))
        names.add(name, expr, "let", name)


def _formulas(doc: YamlDoc, data: dict, key: str, names: _Names) -> tuple[Formula, ...]:
    items = doc.mapping(data.get(key), key)
    if not items:
        raise doc.error("at least one entry is required", key)
    return tuple(Formula(name, formula.parse(text, names.table, doc.where(key, name)),
                         doc.where(key, name))
                 for name, text in items.items())


def _domain(doc: YamlDoc, data: dict, inputs: tuple[Input, ...]) -> tuple:
    out = []
    known = {i.name for i in inputs}
    for name, bounds in doc.mapping(data.get("domain"), "domain").items():
        if name not in known:
            raise doc.error(f"not an input{suggest(str(name), known)}", "domain", name)
        if not isinstance(bounds, list) or len(bounds) != 2:
            raise doc.error("expected [low, high]", "domain", name)
        lo, hi = (doc.number(b, "domain", name, n) for n, b in enumerate(bounds))
        if not lo < hi:
            raise doc.error(f"low {lo} must be below high {hi}", "domain", name)
        out.append((name, (lo, hi)))
    return tuple(out)


def _inputs(doc: YamlDoc, data: dict, kind: str, names: _Names) -> tuple[Input, ...]:
    raw = data.get("inputs")
    if kind == "pointwise":
        if not isinstance(raw, list) or not raw:
            raise doc.error("a pointwise op lists its inputs: inputs: [x] or [a, b]", "inputs")
        for n, name in enumerate(raw):
            names.add(name, None, "inputs", n)
        return tuple(Input(name, "elem") for name in raw)
    items = doc.mapping(raw, "inputs")
    if not items:
        raise doc.error(f"a {kind} op maps inputs to roles: inputs: {{x: {ROLES[kind][0]}}}", "inputs")
    out = []
    for name, role in items.items():
        if role not in ROLES[kind]:
            raise doc.error(f"unknown role {role!r} for a {kind} op (expected one of "
                            f"{', '.join(ROLES[kind])}){suggest(str(role), ROLES[kind])}",
                            "inputs", name)
        if kind == "pair":
            _identifier(doc, name, "inputs", name)
            names.add(name + "0", None, "inputs", name)
            names.add(name + "1", None, "inputs", name)
        else:
            names.add(name, None, "inputs", name)
        out.append(Input(name, role))
    return tuple(out)


# The spec ---------------------------------------------------------------------------------

def load_spec(path: Path | str) -> OpSpec:
    path = Path(path)
    doc = YamlDoc(path)
    data = doc.data
    for key in ("name", "kind"):
        if key not in data:
            raise doc.error(f"missing required key '{key}'", key)
    name = data["name"]
    if name != path.stem:
        raise doc.error(f"name {name!r} must equal the file name {path.stem!r}", "name")
    _identifier(doc, name, "name")
    kind = data["kind"]
    if kind not in KINDS:
        raise doc.error(f"unknown kind {kind!r} (expected one of {', '.join(KINDS)})"
                        f"{suggest(str(kind), KINDS)}", "kind")
    _check_keys(doc, data, kind)
    doc_text = data.get("doc", "")
    if not isinstance(doc_text, str):
        raise doc.error("expected a line of text", "doc")

    names = _Names(doc)
    for s in {"row": ROW_SYMBOLS, "attention": ATTENTION_SYMBOLS}.get(kind, ()):
        names.add(s, None, "kind")  # implicit symbols; a declaration of the same name is an error
    inputs: tuple[Input, ...] = ()
    if kind != "attention":
        inputs = _inputs(doc, data, kind, names)
    index: tuple[tuple[str, str], ...] = ()
    if kind == "pair":
        index = _index(doc, data, names)
    params = _params(doc, data, names)
    _lets(doc, data, names)

    reductions: tuple[Reduction, ...] = ()
    stabilizers: tuple[str, ...] = ()
    if kind == "row":
        reductions, stabilizers = _reductions(doc, data, names)
    outputs = update = backward = ()
    score = mask = None
    if kind in ("pointwise", "row"):
        outputs = _formulas(doc, data, "outputs", names)
    elif kind == "pair":
        outputs = _pair_outputs(doc, data, names)
    elif kind == "update":
        update = _update(doc, data, inputs, names)
    else:
        score = Formula("score", formula.parse(data["score"], names.table, doc.where("score")),
                        doc.where("score"))
        if data.get("mask") is not None:
            mask = Formula("mask", formula.parse(data["mask"], names.table, doc.where("mask"),
                                                 condition=True), doc.where("mask"))
            free = {s.name for s in mask.expr.free_symbols} - {"i", "j", "h"}
            if free:
                raise doc.error(f"a mask may use only i, j and h, not {', '.join(sorted(free))}",
                                "mask")
    for out in outputs:  # outputs are not usable in formulas, but their names must be unique
        names.add(out.name, None, *out.where.key.split("."))
    if "backward" in data:
        backward = _backward(doc, data, inputs, outputs, names)

    tolerance = DEFAULT_TOLERANCE
    if "tolerance" in data:
        tolerance = doc.number(data["tolerance"], "tolerance")
        if not 0 < tolerance < 1:
            raise doc.error("expected a small positive number such as 1.0e-4", "tolerance")
    kink = doc.number(data["kink"], "kink") if "kink" in data else None
    override, fast_math = (data.get(k, False) for k in ("override", "fast_math"))
    for key, value in (("override", override), ("fast_math", fast_math)):
        if not isinstance(value, bool):
            raise doc.error("expected true or false", key)

    return OpSpec(
        name=name, kind=kind, doc=doc_text, inputs=inputs, params=params, outputs=outputs,
        reductions=reductions, stabilizers=stabilizers, index=index, update=update,
        score=score, mask=mask, backward=backward, domain=_domain(doc, data, inputs),
        tolerance=tolerance, kink=kink, override=override, fast_math=fast_math,
        where=Location(doc.file, 1),
        sha256=hashlib.sha256(doc.bytes).hexdigest())


def _index(doc: YamlDoc, data: dict, names: _Names) -> tuple[tuple[str, str], ...]:
    out = []
    items = doc.mapping(data.get("index"), "index")
    for name, role in items.items():
        if role not in INDEX_ROLES:
            raise doc.error(f"unknown index role {role!r} (expected one of "
                            f"{', '.join(INDEX_ROLES)}){suggest(str(role), INDEX_ROLES)}",
                            "index", name)
        names.add(name, None, "index", name)
        out.append((name, role))
    roles = [r for _, r in out]
    for needed in ("pair", "head_dim"):
        if needed not in roles:
            raise doc.error(f"a pair op needs an index symbol with role '{needed}'", "index")
    if len(set(roles)) != len(roles):
        raise doc.error("each index role may be given once", "index")
    return tuple(out)


def _reductions(doc: YamlDoc, data: dict, names: _Names):
    out = []
    for name, text in doc.mapping(data.get("reduce"), "reduce").items():
        where = doc.where("reduce", name)
        op, expr = formula.parse_reduction(text, names.table, where)
        names.add(name, None, "reduce", name)
        out.append(Reduction(name, op, expr, where))
    declared = {r.name: r for r in out}
    raw = data.get("stabilizers") or []
    if not isinstance(raw, list):
        raise doc.error("expected a list of reduction names: [m]", "stabilizers")
    for n, name in enumerate(raw):
        if name not in declared:
            raise doc.error(f"not a reduction{suggest(str(name), declared)}", "stabilizers", n)
        if declared[name].op != "max":
            raise doc.error(f"'{name}' is a {declared[name].op}(); only max() reductions can "
                            "be stabilizers", "stabilizers", n)
    for r in out:
        if r.op == "max" and r.name not in raw:
            raise r.where.error("a max() reduction that is not a stabilizer is not supported "
                                "(its gradient would go to the arg-max); list it under "
                                "`stabilizers:` if it only stabilises")
    return tuple(out), tuple(raw)


def _pair_outputs(doc: YamlDoc, data: dict, names: _Names) -> tuple[Formula, ...]:
    out = []
    for name, pair in doc.mapping(data.get("outputs"), "outputs").items():
        _identifier(doc, name, "outputs", name)
        if not isinstance(pair, list) or len(pair) != 2:
            raise doc.error("a pair output is [first, second]: the values at k and k + D/2",
                            "outputs", name)
        for n, text in enumerate(pair):
            where = doc.where("outputs", name, n)
            out.append(Formula(f"{name}{n}", formula.parse(text, names.table, where), where))
    return tuple(out)


def _update(doc: YamlDoc, data: dict, inputs: tuple[Input, ...], names: _Names):
    states = {i.name for i in inputs if i.role == "state"}
    out = []
    for name, text in doc.mapping(data.get("update"), "update").items():
        if name not in states:
            raise doc.error(f"only state inputs can be updated{suggest(str(name), states)}",
                            "update", name)
        where = doc.where("update", name)
        out.append(Formula(name, formula.parse(text, names.table, where), where))
    if not out:
        raise doc.error("at least one entry is required", "update")
    return tuple(out)


def _backward(doc: YamlDoc, data: dict, inputs, outputs, names: _Names):
    """Explicit gradients (pointwise ops): formulas over the inputs, params and d<output>."""
    # The backward recomputes from the inputs: output values are not among its arguments.
    table = {k: v for k, v in names.table.items() if k not in {o.name for o in outputs}}
    for out in outputs:
        table["d" + out.name] = symbol("d" + out.name)
    known = {i.name for i in inputs}
    result = []
    for name, text in doc.mapping(data["backward"], "backward").items():
        if name not in known:
            raise doc.error(f"not an input{suggest(str(name), known)}", "backward", name)
        where = doc.where("backward", name)
        result.append(Formula("d" + name, formula.parse(text, table, where), where))
    return tuple(result)


def load_op(name: str, ops_dirs=()) -> OpSpec:
    ops = find_ops(ops_dirs)
    if name not in ops:
        raise EulerError(f"unknown op '{name}'{suggest(name, ops)}")
    return load_spec(ops[name])
