"""Who imports whom (DESIGN.md): no cycle inside generator/, runtime/ or cli/, counting the imports
inside functions too; the generator never imports the runtime, nor the runtime the generator;
runtime/'s sub-packages import only those below them (runtime.LAYERS); the leaves both share
(eulergen/launch.py, signature.py, step_record.py, errors.py) import neither."""
from __future__ import annotations

import ast

import pytest

from eulergen import PACKAGE_DIR
from eulergen.runtime import LAYERS


def _imports(path) -> set[str]:
    """The eulergen modules a file imports, anywhere in it, as dotted names."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("eulergen")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("eulergen"):
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}   # `from pkg import mod`
    return found


def _modules(package: str) -> dict[str, object]:
    """Dotted name below `package` (`engine.ops`) -> file, sub-packages included."""
    root = PACKAGE_DIR / package
    return {".".join(p.relative_to(root).with_suffix("").parts): p
            for p in sorted(root.rglob("*.py")) if p.stem != "__init__"}


def _graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports."""
    modules = _modules(package)
    prefix = f"eulergen.{package}."
    graph = {}
    for name, path in modules.items():
        found = {m[len(prefix):] for m in _imports(path) if m.startswith(prefix)}
        graph[name] = {m for m in modules if m in found or any(f.startswith(m + ".") for f in found)} - {name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of the graph, or [] if it has none."""
    state: dict[str, int] = {}           # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return []
    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("package", ["generator", "runtime", "cli"])
def test_no_import_cycle_inside_a_package(package):
    graph = _graph(package)
    assert graph, f"no modules found in {package}/"
    assert _cycle(graph) == [], f"{package}/ imports in a cycle: {' -> '.join(_cycle(graph))}"


@pytest.mark.parametrize("package,other", [("generator", "runtime"), ("runtime", "generator")])
def test_generator_and_runtime_do_not_import_each_other(package, other):
    for name, path in _modules(package).items():
        bad = sorted(m for m in _imports(path) if m.startswith(f"eulergen.{other}"))
        assert not bad, f"{package}/{name} imports {bad[0]}"


def test_every_runtime_module_lives_in_a_layer_and_each_layer_says_what_it_owns():
    assert set(_modules("runtime")) == {n for n in _modules("runtime") if n.split(".")[0] in LAYERS}, \
        f"runtime/ modules outside {LAYERS}: {sorted(n for n in _modules('runtime') if '.' not in n)}"
    for layer in LAYERS:
        init = PACKAGE_DIR / "runtime" / layer / "__init__.py"
        assert ast.get_docstring(ast.parse(init.read_text())), f"runtime/{layer}/__init__.py has no docstring"


def test_runtime_layers_import_only_the_layers_below_them():
    for name, deps in _graph("runtime").items():
        layer = LAYERS.index(name.split(".")[0])
        for dep in deps:
            assert LAYERS.index(dep.split(".")[0]) <= layer, \
                f"runtime/{name.replace('.', '/')}.py imports runtime/{dep.replace('.', '/')}.py, a layer above it"


@pytest.mark.parametrize("leaf,allowed", [("launch.py", ()), ("errors.py", ()),
                                          ("step_record.py", ()),
                                          ("progress.py", ()),
                                          ("signature.py", ("eulergen.launch",))])
def test_the_shared_leaves_import_at_most_launch(leaf, allowed):
    """The leaves both sides share import nothing of eulergen, but signature.py launch.py."""
    found = {m for m in _imports(PACKAGE_DIR / leaf)
             if not any(m == a or m.startswith(a + ".") for a in allowed)}
    assert not found, f"{leaf} imports {sorted(found)}"


def test_suggest_is_imported_from_errors_only():
    """One "did you mean": every module takes `suggest` from eulergen.errors, not through
    another module that happens to import it."""
    for path in sorted(PACKAGE_DIR.glob("*/*.py")) + sorted(PACKAGE_DIR.glob("*/*/*.py")) + sorted(PACKAGE_DIR.glob("*.py")):
        via = sorted(m[:-len(".suggest")] for m in _imports(path) if m.endswith(".suggest"))
        assert via in ([], ["eulergen.errors"]), f"{path.name} imports suggest from {via}"
