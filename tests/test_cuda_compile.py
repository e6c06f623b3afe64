"""Every generated .cu compiles for sm_90 and sm_80, and no fp32 kernel holds a double-
precision instruction. Compilers: NVRTC (what the runtime uses, and stricter than nvcc),
from the `nvidia-cuda-nvrtc` wheel or a CUDA toolkit, with headers from the
`nvidia-cuda-runtime` wheel or the toolkit; and nvcc when it is on PATH. No GPU needed.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import pytest

from eulergen import GENERATED_DIR

CUDA_DIR = GENERATED_DIR / "cuda"
SOURCES = sorted(CUDA_DIR.glob("*.cu"))
ARCHS = ("sm_90", "sm_80")
INCLUDE = '#include "eulergen_common.cuh"'


def _nvidia_dirs() -> list[Path]:
    spec = importlib.util.find_spec("nvidia")
    return [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []


def _toolkit_dirs() -> list[Path]:
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(str(Path(nvcc).resolve().parent.parent))
    return [Path(r) for r in roots if r]


@lru_cache(maxsize=1)
def nvrtc_library() -> ctypes.CDLL | None:
    candidates = [p for d in _nvidia_dirs() for p in sorted(d.glob("*/lib/libnvrtc.so*"))
                  if "builtins" not in p.name]
    candidates += [p for r in _toolkit_dirs() for p in sorted((r / "lib64").glob("libnvrtc.so*"))
                   if "builtins" not in p.name]
    for path in candidates:
        try:
            return ctypes.CDLL(str(path))
        except OSError:
            continue
    return None


@lru_cache(maxsize=1)
def cuda_include_dir() -> Path | None:
    """A folder holding cuda_bf16.h (and what it includes)."""
    dirs = [sub / "include" for base in _nvidia_dirs() if base.is_dir()
            for sub in sorted(base.iterdir()) if sub.is_dir()]
    for d in dirs + [r / "include" for r in _toolkit_dirs()]:
        if (d / "cuda_bf16.h").exists():
            return d
    return None


def inlined(path: Path) -> str:
    """The source as the runtime compiles it: the common header pasted in."""
    common = (CUDA_DIR / "eulergen_common.cuh").read_text()
    text = path.read_text()
    assert INCLUDE in text, f"{path.name} does not include the common header"
    return text.replace(INCLUDE, common, 1)


def nvrtc_ptx(source: str, name: str, arch: str) -> str:
    lib = nvrtc_library()
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0,
                                  None, None) == 0
    opts = [f"--gpu-architecture=compute_{arch[3:]}", "-std=c++17",
            f"-I{cuda_include_dir()}"]
    arr = (ctypes.c_char_p * len(opts))(*(o.encode() for o in opts))
    try:
        status = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        if status != 0:
            raise AssertionError(f"NVRTC ({arch}) rejected {name}:\n{log.value.decode()[:4000]}")
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetPTX(prog, ptx)
        return ptx.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def nvcc_ptx(source: str, name: str, arch: str, tmp: Path) -> str:
    src = tmp / name
    src.write_text(source)
    out = src.with_suffix(f".{arch}.ptx")
    done = subprocess.run(["nvcc", f"-arch={arch}", "-std=c++17", "--ptx", str(src), "-o", str(out)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise AssertionError(f"nvcc ({arch}) rejected {name}:\n{done.stderr[:4000]}")
    return out.read_text()


def compiler() -> str:
    """NVRTC when it can be loaded (the runtime's compiler, the stricter one), else nvcc."""
    if nvrtc_library() is not None and cuda_include_dir() is not None:
        return "nvrtc"
    if shutil.which("nvcc"):
        return "nvcc"
    pytest.skip("no CUDA compiler: pip install nvidia-cuda-nvrtc nvidia-cuda-runtime "
                "(or install a CUDA toolkit)")


@pytest.fixture(scope="session")
def ptx_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ptx")


@pytest.fixture(scope="session")
def all_ptx(ptx_dir) -> dict:
    """(file, arch) -> PTX text or the compiler's complaint, compiled two at a time (NVRTC
    and nvcc both run outside the GIL)."""
    which = compiler()

    def one(job):
        path, arch = job
        try:
            source = inlined(path)
            if which == "nvrtc":
                return job, nvrtc_ptx(source, path.name, arch)
            return job, nvcc_ptx(source, path.name, arch, ptx_dir)
        except AssertionError as err:
            return job, err

    jobs = [(p, a) for p in SOURCES for a in ARCHS]
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        return dict(pool.map(one, jobs))


def f64_kernels(ptx: str) -> list[str]:
    """Names of the `_f32` entry points (and any non-inlined functions) whose PTX uses
    double precision: an f64 instruction or an f64 register."""
    bad = []
    for m in re.finditer(r"\.(entry|func)\s+(?:\([^)]*\)\s*)?(\w+)\s*\((.*?)(?=\.(?:visible\s+)?"
                         r"(?:entry|func)\s|\Z)", ptx, re.S):
        kind, name, body = m.groups()
        if (kind == "func" or name.endswith("_f32")) and re.search(r"\.f64\b|%fd\d", body):
            bad.append(name)
    return bad


def split_stores(ptx: str) -> list[str]:
    """Names of the entry points that store 16 bytes as four 4-byte stores at consecutive
    offsets from one register (a split 16-byte store: a warp then writes each of its sectors
    four times). The `_unaligned` row kernels do, by design, on their scalar path."""
    bad = []
    for m in re.finditer(r"\.entry\s+(\w+)\s*\((.*?)(?=\.visible\s+\.entry\s|\Z)", ptx, re.S):
        name, body = m.groups()
        offsets: dict[str, set[int]] = {}
        for st in re.finditer(r"st\.global(?:\.wb)?\.(?:u32|b32|f32)\s+\[(%rd\d+)(?:\+(\d+))?\]",
                              body):
            offsets.setdefault(st.group(1), set()).add(int(st.group(2) or 0))
        if any(all(o + k in offs for k in (4, 8, 12)) for offs in offsets.values()
               for o in offs if o % 16 == 0):
            bad.append(name)
    return bad


needs_sources = pytest.mark.skipif(not SOURCES, reason="generated/cuda is empty: run `eulergen build`")


def _ptx(all_ptx, path, arch) -> str:
    got = all_ptx[(path, arch)]
    if isinstance(got, AssertionError):
        raise got
    return got


@needs_sources
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.stem)
def test_generated_cuda_compiles(path, arch, all_ptx):
    assert ".entry" in _ptx(all_ptx, path, arch), f"{path.name}: no kernel in the PTX"


@needs_sources
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.stem)
def test_fp32_kernels_have_no_double_precision(path, arch, all_ptx):
    bad = f64_kernels(_ptx(all_ptx, path, arch))
    assert not bad, f"{path.name} ({arch}): double precision in {bad}"


@needs_sources
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.stem)
def test_kernels_store_16_bytes_in_one_store(path, arch, all_ptx):
    """NVVM split a plain uint4 assignment into four stores in the row kernels; the templates
    store through __stwb / __stcs (templates/common.cuh.j2, eg_store_vec)."""
    bad = [k for k in split_stores(_ptx(all_ptx, path, arch)) if "_unaligned_" not in k]
    assert not bad, f"{path.name} ({arch}): 16-byte stores split in {bad}"


def _snippet_ptx(ptx_dir: Path, name: str, source: str) -> str:
    """sm_90 PTX of a few lines of CUDA, by the compiler the generated files take."""
    (ptx_dir / name).write_text(source)
    if compiler() == "nvrtc":
        return nvrtc_ptx(source, name, "sm_90")
    return nvcc_ptx(source, name, "sm_90", ptx_dir)


def test_split_store_detector_finds_four_4_byte_stores(ptx_dir):
    ptx = _snippet_ptx(ptx_dir, "split.cu", (
        'extern "C" __global__ void split(unsigned* p, uint4 v) {\n'
        '  p[4] = v.x; p[5] = v.y; p[6] = v.z; p[7] = v.w; }\n'
        'extern "C" __global__ void whole(uint4* p, uint4 v) { __stwb(p + 1, v); }\n'))
    assert split_stores(ptx) == ["split"]


def test_f64_detector_finds_double_math_in_an_f32_kernel(ptx_dir):
    ptx = _snippet_ptx(ptx_dir, "double.cu", (
        'extern "C" __global__ void k_f32(float* x) { x[0] = (float)(x[1] * 0.1); }\n'
        'extern "C" __global__ void k_bf16(float* x) { x[0] = (float)(x[1] * 0.1); }\n'))
    assert f64_kernels(ptx) == ["k_f32"]


def test_every_kernel_in_the_manifest_is_defined_in_its_file():
    import json
    manifest = GENERATED_DIR / "manifest.json"
    if not manifest.exists():
        pytest.skip("no generated/manifest.json: run `eulergen build`")
    for name, op in json.loads(manifest.read_text())["ops"].items():
        text = (GENERATED_DIR / op["cuda"]).read_text()
        for kernel in op["kernels"]:
            assert re.search(rf'extern "C" __global__ void (__launch_bounds__\([^)]*\) )?{kernel}\(',
                             text), f"{name}: {kernel} is in the manifest but not in {op['cuda']}"


def _entries(ptx: str) -> dict[str, str]:
    return {m.group(1): m.group(2) for m in re.finditer(
        r"\.entry\s+(\w+)\s*\((.*?)(?=\.visible\s+\.entry\s|\Z)", ptx, re.S)}


@needs_sources
def test_wgmma_kernels_hold_wgmma_for_sm_90a_and_nothing_for_sm_90(ptx_dir, all_ptx):
    """The attention backward's Hopper kernels are built for the arch-specific target the
    runtime compiles for on sm_90 (compile.device_arch: 90a); for any other target their
    bodies are empty, and the runtime takes the mma.sync kernels there."""
    path = CUDA_DIR / "causal_attention.cu"
    source = inlined(path)
    ptx = (nvrtc_ptx(source, path.name, "sm_90a") if compiler() == "nvrtc"
           else nvcc_ptx(source, path.name, "compute_90a", ptx_dir))
    entries = _entries(ptx)
    hopper = [n for n in entries if "_wgmma_" in n]
    assert hopper and all("wgmma.mma_async" in entries[n] for n in hopper)
    assert not any("wgmma." in body for n, body in entries.items() if n not in hopper)
    plain = _entries(_ptx(all_ptx, path, "sm_90"))
    assert all("wgmma." not in plain[n] for n in hopper)
