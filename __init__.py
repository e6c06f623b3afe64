"""eulergen: CUDA kernels generated from declarative op specs.

The repository root is this package; the folders DESIGN.md names sit beside this file
both in a checkout and in an installed wheel.
"""
from pathlib import Path

__version__ = "0.1.0"

PACKAGE_DIR = Path(__file__).resolve().parent
OPS_DIR = PACKAGE_DIR / "ops"
TEMPLATES_DIR = PACKAGE_DIR / "templates"
GENERATED_DIR = PACKAGE_DIR / "generated"
CONFIG_DIR = PACKAGE_DIR / "config"


def cache_dir() -> Path:
    """Per-user cache: compiled kernels, user-op builds, tokenized built-in data."""
    from eulergen import env
    return env.get("EULERGEN_CACHE") or Path.home() / ".cache" / "eulergen"
