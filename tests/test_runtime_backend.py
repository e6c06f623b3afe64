"""Backend selection: numpy always works; 'auto' falls back with one line; 'cuda' without
CuPy or a GPU is a clear error naming the extra to install."""
from __future__ import annotations

import builtins

import numpy as np
import pytest

from eulergen.errors import EulerError
from eulergen.runtime.engine import backend as backend_mod
from eulergen.runtime.engine.backend import get_backend


@pytest.fixture
def no_cupy(monkeypatch):
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "cupy" or name.startswith("cupy."):
            raise ImportError("No module named 'cupy'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)


def test_numpy_backend_is_numpy_on_the_cpu():
    b = get_backend("numpy")
    assert (b.name, b.xp, b.is_gpu) == ("numpy", np, False)
    b.synchronize()  # a no-op that must not fail
    assert b.asnumpy(b.asarray([1, 2], dtype=np.float32)).dtype == np.float32


def test_cuda_without_cupy_names_the_extra_to_install(no_cupy):
    with pytest.raises(EulerError, match=r"eulergen\[cuda13\].*eulergen\[cuda12\]"):
        get_backend("cuda")


def test_auto_without_cupy_falls_back_to_numpy_with_one_line(no_cupy):
    lines = []
    b = get_backend("auto", notice=lines.append)
    assert b.name == "numpy"
    assert len(lines) == 1 and "\n" not in lines[0] and "running on numpy" in lines[0]


def test_auto_prints_the_notice_to_stderr_by_default(no_cupy, capsys):
    get_backend("auto")
    assert "running on numpy" in capsys.readouterr().err


def test_an_unknown_backend_name_is_an_error():
    with pytest.raises(EulerError, match="unknown backend 'gpu'"):
        get_backend("gpu")


def test_backends_are_frozen():
    with pytest.raises(AttributeError):
        backend_mod.NUMPY.name = "x"
