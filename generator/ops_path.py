"""Where ops are found: built-in ops/, then EULERGEN_OPS_PATH, then --ops folders, each op
a `<name>.yaml`. Kept apart from the spec loader (generator/spec.py) because a run whose
ops are all built only looks them up, and must not pay for importing sympy."""
from __future__ import annotations

from pathlib import Path

from eulergen import OPS_DIR, env
from eulergen.errors import EulerError
from eulergen.generator.yaml_doc import YamlDoc


def ops_path(ops_dirs=()) -> list[Path]:
    """Built-in ops/, then EULERGEN_OPS_PATH entries, then --ops directories."""
    return [OPS_DIR, *env.get("EULERGEN_OPS_PATH"), *(Path(d) for d in ops_dirs)]


def find_ops(ops_dirs=()) -> dict[str, Path]:
    """Every op on the search path by name. A user op may replace a built-in one only
    when it says `override: true`; two user ops with one name is always an error."""
    found: dict[str, Path] = {}
    for n, folder in enumerate(ops_path(ops_dirs)):
        if n > 0 and not folder.is_dir():
            raise EulerError("not a folder of op specs" if folder.exists() else
                             "ops directory does not exist", file=str(folder))
        for path in sorted(folder.glob("*.yaml")):
            name = path.stem
            if name in found:
                first = found[name]
                builtin = first.parent.resolve() == OPS_DIR.resolve()
                if not (builtin and _says_override(path)):
                    raise EulerError(
                        f"op '{name}' is already defined in {first}"
                        + ("; add `override: true` to replace the built-in op" if builtin else ""),
                        file=str(path), line=1, key="name")
            found[name] = path
    return found


def _says_override(path: Path) -> bool:
    data = YamlDoc(path).data
    return data.get("override") is True
