"""What the tests of the runtime's own kernels over the CUDA emulator share
(tests/test_gemv_emulated.py, test_moves_emulated.py): one generated .cu compiled by g++ with
host runners around its kernels, a block's threads as the emulator's fibers."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

from eulergen import GENERATED_DIR

EMULATOR = Path(__file__).resolve().parent / "cudagen_emulator"


def runner(name: str, params: str, grid: str, threads: int, call: str) -> str:
    """The C of `extern "C" void run_<name>(params)` launching `call` on `grid` blocks of
    `threads`."""
    return (f'extern "C" void run_{name}({params}) {{\n'
            f"  emu_launch(dim3({grid}), dim3({threads}), [&] {{ {call}; }});\n}}")


def emulated_library(folder: Path, cu: str, runners: list[str],
                     source: Path = GENERATED_DIR / "cuda") -> ctypes.CDLL:
    """`source`/`cu` (generated/cuda's, or a user build's) with `runners` after it, built in
    `folder` and loaded."""
    for name in ("eulergen_common.cuh", cu):
        shutil.copy(source / name, folder / name)
    stem = Path(cu).stem
    (folder / f"{stem}.cpp").write_text("\n".join([f'#include "{cu}"', *runners]) + "\n")
    subprocess.run(["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-I", str(EMULATOR), "-o",
                    str(folder / f"{stem}.so"), str(folder / f"{stem}.cpp")], check=True)
    return ctypes.CDLL(str(folder / f"{stem}.so"))
