"""Whether two revisions' generated CUDA compiles to the same machine code: every .cu in
generated/cuda/ of both, compiled with nvcc for sm_90 (the runtime's options: -std=c++17, fast
math where the manifest's op opts in), each kernel's .text section compared byte for byte.
A kernel only the newer revision has is counted, not compared. Needs nvcc, not a GPU.

    python benchmarks/same_cubins.py 7eb8ce9          # against the working tree
    python benchmarks/same_cubins.py 7eb8ce9 main
"""
from __future__ import annotations

import argparse
import json
import struct
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def kernels(cubin: bytes) -> dict[str, bytes]:
    """Each kernel's code: the ELF64 sections named .text.<kernel>."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize)
               for i in range(shnum)]
    names = headers[shstrndx][4]
    out = {}
    for name_at, _, _, _, offset, size, *_ in headers:
        name = cubin[names + name_at: cubin.index(b"\0", names + name_at)].decode()
        if name.startswith(".text."):
            out[name[len(".text."):]] = cubin[offset: offset + size]
    return out


def fast_math_ops(tree: Path) -> set[str]:
    ops = json.loads((tree / "generated" / "manifest.json").read_text())["ops"]
    return {name for name, op in ops.items() if op.get("fast_math")}


def compile_all(tree: Path, names: list[str], out: Path) -> dict[str, dict[str, bytes]]:
    fast = fast_math_ops(tree)

    def one(name: str):
        cubin = out / f"{name}.cubin"
        cmd = ["nvcc", "-cubin", "-arch=sm_90", "-std=c++17", f"-I{tree}/generated/cuda",
               "-o", str(cubin), str(tree / "generated" / "cuda" / f"{name}.cu")]
        done = subprocess.run(cmd + (["--use_fast_math"] if name in fast else []),
                              capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"nvcc rejected {tree}/generated/cuda/{name}.cu:\n{done.stderr[-2000:]}")
        return name, kernels(cubin.read_bytes())

    with ThreadPoolExecutor(2) as pool:
        return dict(pool.map(one, names))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", help="the earlier revision")
    ap.add_argument("new", nargs="?", help="the later revision (default: the working tree)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trees = []
        for i, rev in enumerate((args.old, args.new)):
            if rev is None:
                trees.append(ROOT)
                continue
            tree = Path(tmp) / f"tree{i}"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-f", "--detach",
                            str(tree), rev], check=True, capture_output=True)
            trees.append(tree)
        try:
            old, new = trees
            names = sorted(p.stem for p in (old / "generated" / "cuda").glob("*.cu")
                           if (new / "generated" / "cuda" / p.name).exists())
            built = []
            for i, tree in enumerate(trees):
                (Path(tmp) / f"out{i}").mkdir()
                built.append(compile_all(tree, names, Path(tmp) / f"out{i}"))
        finally:
            for tree in trees:
                if tree != ROOT:
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                    str(tree)], capture_output=True)
    same = added = 0
    different, missing = [], []
    for name in names:
        a, b = built[0][name], built[1][name]
        for kernel, code in a.items():
            if kernel not in b:
                missing.append(f"{name}: {kernel}")
            elif b[kernel] == code:
                same += 1
            else:
                different.append(f"{name}: {kernel}")
        added += len(set(b) - set(a))
        print(f"{name:20} {len(a):4} kernels, {len(b):4} now", flush=True)
    for line in different:
        print("different:", line)
    for line in missing:
        print("gone:", line)
    print(f"{len(names)} files: {same} kernels the same machine code, {len(different)} "
          f"different, {len(missing)} gone, {added} new")
    sys.exit(1 if different or missing else 0)


if __name__ == "__main__":
    main()
