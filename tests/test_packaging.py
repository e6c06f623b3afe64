"""What a wheel carries: every folder of the package's Python modules is one of
pyproject.toml's `packages` (setuptools installs only those it names: a sub-package left out
imports from a checkout but not from an installed wheel)."""
from __future__ import annotations

import tomllib

from eulergen import PACKAGE_DIR

NOT_SHIPPED = {"tests", "benchmarks", "generated", "docs", "build"}


def test_every_module_folder_is_a_listed_package():
    listed = set(tomllib.loads((PACKAGE_DIR / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {p.parent.relative_to(PACKAGE_DIR) for p in PACKAGE_DIR.rglob("*.py")}
    shipped = {f for f in folders if not f.parts or (f.parts[0] not in NOT_SHIPPED
                                                     and not f.parts[0].startswith("."))}
    names = {".".join(("eulergen",) + f.parts) for f in shipped}
    assert names - listed == set(), f"module folders pyproject.toml does not ship: {sorted(names - listed)}"
    assert listed - names == set(), f"pyproject.toml lists packages with no modules: {sorted(listed - names)}"
