"""Op specs: YAML with line numbers → a validated, frozen OpSpec (generator/opspec.py).

The keys every kind has are read here; the kind (generator/kinds/, through the registry)
says which others it allows and requires, and reads them. Every error names the spec file,
the YAML line of the key at fault and the key path, on one line. `let` names are expanded
inline, so derivation sees through them.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from eulergen.errors import EulerError, suggest
from eulergen.generator import formula, registry
from eulergen.generator.ir import Location, Param
from eulergen.generator.kinds.base import OpKind
from eulergen.generator.opspec import DEFAULT_TOLERANCE, Formula, Names, OpSpec, identifier
from eulergen.generator.ops_path import find_ops
from eulergen.generator.yaml_doc import YamlDoc

COMMON = {"name", "kind", "doc", "params", "let", "domain", "tolerance", "override", "fast_math"}


def _check_keys(doc: YamlDoc, data: dict, kind: OpKind) -> None:
    allowed = COMMON | kind.keys
    for key in data:
        if key not in allowed:
            hint = suggest(str(key), allowed)
            other = [k.name for k in registry.spec_kinds() if key in k.keys]
            if not hint and other:
                hint = f" (allowed for kind {', '.join(other)})"
            raise doc.error(f"unknown key for a {kind.name} op{hint}", str(key))
    for key in kind.required:
        if key not in data:
            raise doc.error(f"missing required key '{key}' for a {kind.name} op", key)


def _params(doc: YamlDoc, data: dict, names: Names) -> tuple[Param, ...]:
    out = []
    for name, value in doc.mapping(data.get("params"), "params").items():
        names.add(name, None, "params", name)
        if value == "runtime":
            out.append(Param(name, None))
        else:
            out.append(Param(name, doc.number(value, "params", name)))
    return tuple(out)


def _lets(doc: YamlDoc, data: dict, names: Names) -> None:
    for name, text in doc.mapping(data.get("let"), "let").items():
        expr = formula.parse(text, names.table, doc.where("let", name))
        names.add(name, expr, "let", name)


def _domain(doc: YamlDoc, data: dict, inputs) -> tuple:
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


def _kind(doc: YamlDoc, data: dict) -> OpKind:
    name = data["kind"]
    if isinstance(name, str) and name in registry.names() and (found := registry.kind(name)).spec:
        return found   # only this kind imported
    kinds = [k.name for k in registry.spec_kinds()]
    raise doc.error(f"unknown kind {name!r} (expected one of {', '.join(kinds)})"
                    f"{suggest(str(name), kinds)}", "kind")


def load_spec(path: Path | str, data: bytes | None = None) -> OpSpec:
    """The spec at `path`; `data`: its bytes, where the caller has read them already."""
    path = Path(path)
    doc = YamlDoc(path, data)
    data = doc.data
    for key in ("name", "kind"):
        if key not in data:
            raise doc.error(f"missing required key '{key}'", key)
    name = data["name"]
    if name != path.stem:
        raise doc.error(f"name {name!r} must equal the file name {path.stem!r}", "name")
    identifier(doc, name, "name")
    kind = _kind(doc, data)
    _check_keys(doc, data, kind)
    doc_text = data.get("doc", "")
    if not isinstance(doc_text, str):
        raise doc.error("expected a line of text", "doc")

    names = Names(doc)
    for s in kind.symbols:
        names.add(s, None, "kind")  # implicit symbols; a declaration of the same name is an error
    fields = kind.read_operands(doc, data, names)
    params = _params(doc, data, names)
    _lets(doc, data, names)
    fields |= kind.read_formulas(doc, data, names, fields)
    outputs: tuple[Formula, ...] = fields.get("outputs", ())
    for out in outputs:  # outputs are not usable in formulas, but their names must be unique
        names.add(out.name, None, *out.where.key.split("."))

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
        name=name, kind=kind.name, doc=doc_text, params=params,
        domain=_domain(doc, data, fields.get("inputs", ())), tolerance=tolerance, kink=kink,
        override=override, fast_math=fast_math, where=Location(doc.file, 1),
        sha256=hashlib.sha256(doc.bytes).hexdigest(), **fields)


def load_op(name: str, ops_dirs=()) -> OpSpec:
    ops = find_ops(ops_dirs)
    if name not in ops:
        raise EulerError(f"unknown op '{name}'{suggest(name, ops)}")
    return load_spec(ops[name])
