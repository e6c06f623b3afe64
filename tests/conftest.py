"""Fixtures shared by the CPU and GPU tests."""
from pathlib import Path

import numpy as np
import pytest

from eulergen import PACKAGE_DIR
from eulergen.runtime.data.loader import write_shard


@pytest.fixture(scope="module")
def shard(tmp_path_factory) -> Path:
    """Byte-level text the tests own: this package's runtime source, as one llm.c shard."""
    text = b"".join(p.read_bytes() for p in sorted((PACKAGE_DIR / "runtime").rglob("*.py")))
    path = tmp_path_factory.mktemp("data") / "text_train.bin"
    write_shard(path, np.frombuffer(text, dtype=np.uint8))
    return path
