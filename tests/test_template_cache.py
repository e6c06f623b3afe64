"""Compiled templates kept on disk (generator/emit.py, new_environment): a second process
renders from them without compiling, and never from what other options, or another text of
the template, compiled."""
from __future__ import annotations

import shutil

import jinja2
import pytest

from eulergen.generator import emit

TEMPLATE = "{% for x in xs %}\n  {{ x }}\n{% endfor %}\n"


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("EULERGEN_CACHE", str(tmp_path / "cache"))
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "t.j2").write_text(TEMPLATE)
    return tmp_path / "templates"


def _render(folder, compiles=True, **options) -> str:
    """t.j2 rendered by a new environment (as a new process has); `compiles=False`: one
    that fails if it has to compile the template."""
    env = emit.new_environment(jinja2.FileSystemLoader(str(folder)), **options)
    if not compiles:
        def refuse(*args, **kwargs):
            raise AssertionError("compiled again, not read from the cache")
        env.compile = refuse
    return env.get_template("t.j2").render(xs=[1, 2])


def _uncached(folder, **options) -> str:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(folder)), **options) \
        .get_template("t.j2").render(xs=[1, 2])


def test_a_second_environment_renders_from_the_cache_without_compiling(folder):
    first = _render(folder, trim_blocks=True)
    assert _render(folder, compiles=False, trim_blocks=True) == first
    assert first == _uncached(folder, trim_blocks=True) == "  1\n  2\n"


def test_other_options_and_an_edited_template_compile_afresh(folder):
    _render(folder, trim_blocks=True)
    # trim_blocks changes the compiled code: the other options' bytecode is never read
    assert _render(folder) == _uncached(folder) != _uncached(folder, trim_blocks=True)
    (folder / "t.j2").write_text(TEMPLATE.replace("{{ x }}", "<{{ x }}>"))
    assert _render(folder, trim_blocks=True) == "  <1>\n  <2>\n"


def test_a_cache_folder_that_cannot_be_used_costs_a_compile_not_the_render(folder, tmp_path,
                                                                           monkeypatch):
    _render(folder, trim_blocks=True)
    shutil.rmtree(tmp_path / "cache")   # removed under a running build: made again
    assert _render(folder, trim_blocks=True) == _uncached(folder, trim_blocks=True)
    assert _render(folder, compiles=False, trim_blocks=True) == _uncached(folder, trim_blocks=True)
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("EULERGEN_CACHE", str(tmp_path / "a_file"))   # no folder can be in it
    assert _render(folder, trim_blocks=True) == _uncached(folder, trim_blocks=True)
