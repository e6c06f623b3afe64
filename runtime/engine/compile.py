"""Compiling generated `.cu` files to loaded CuPy modules, cached in memory and on disk.

A generated file starts with `#include "eulergen_common.cuh"`; that header (from the
same folder) is inlined here with `#line` markers, so NVRTC's error lines still point
into the file a reader opens. NVRTC makes a cubin for the device's arch; the cubin is
kept in `$EULERGEN_CACHE/kernels` (default ~/.cache/eulergen/kernels) under
sha256(source, options, arch, NVRTC version), written to a temp file and renamed, so
two processes compiling the same kernel at once each write a whole file and the last
rename wins with identical bytes. CuPy is imported inside functions: this module
imports, and its source handling is tested, on machines without CuPy.

A cold cache costs one NVRTC compile per file, seconds each (an attention or row op's file
holds a kernel per layout, dtype and head dim). `prefetch` starts those a run needs at once,
on threads, before the first step, and `compile_file` waits for the one it is asked for:
cupy_backends' nvrtc.compileProgram releases the GIL (`with nogil`) and NVRTC may be called
from several threads at once, so the files compile side by side while the run starts.
"""
from __future__ import annotations

import hashlib
import os
import queue
import re
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from eulergen import GENERATED_DIR, cache_dir, env
from eulergen.errors import EulerError
from eulergen.files import write_atomic

COMMON_HEADER = "eulergen_common.cuh"
BASE_OPTIONS = ("-std=c++17",)
_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')
_DIAG_RE = re.compile(r"^(?P<file>[^\s()]+)\((?P<line>\d+)\): (?P<kind>(?:catastrophic )?error): "
                      r"(?P<msg>.*)$")


def kernel_cache_dir() -> Path:
    return cache_dir() / "kernels"


@dataclass(frozen=True)
class Source:
    """A .cu file with its local includes inlined: what NVRTC compiles."""
    path: Path
    text: str
    files: tuple[tuple[str, str], ...]   # (name as in #line, original text) for error display
    template: str = ""                   # the template it was rendered from, where known

    def original(self, name: str) -> str | None:
        return next((t for n, t in self.files if n == name), None)


def read_source(path: str | Path, template: str = "") -> Source:
    """Read a .cu file and inline each `#include "x"` that names a file beside it.

    System includes (<cuda_bf16.h>) are left to NVRTC. Each local header is included
    once (the generated ones are `#pragma once`), and `#line` directives return error
    positions to the file they came from."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise EulerError("CUDA source not found (run `eulergen build`)", file=str(path)) from None
    files = [(path.name, text)]
    out = []
    for n, line in enumerate(text.splitlines(), start=1):
        m = _INCLUDE_RE.match(line)
        if not m:
            out.append(line)
            continue
        header = path.parent / m.group(1)
        if not header.is_file():
            raise EulerError(f'#include "{m.group(1)}": no such file beside the source '
                             "(run `eulergen build`)", file=str(path), line=n)
        if all(name != header.name for name, _ in files):
            htext = header.read_text()
            files.append((header.name, htext))
            out += [f'#line 1 "{header.name}"', htext.rstrip("\n"),
                    f'#line {n + 1} "{path.name}"']
        else:
            out.append(f'#line {n + 1} "{path.name}"')
    return Source(path, "\n".join(out) + "\n", tuple(files), template)


def cache_key(source: str, options: tuple[str, ...], arch: str, nvrtc_version: tuple) -> str:
    h = hashlib.sha256()
    for part in (source, "\0".join(options), arch, ".".join(map(str, nvrtc_version))):
        h.update(part.encode())
        h.update(b"\x01")   # a separator, so moving text between parts changes the key
    return h.hexdigest()


def _origin(src: Source) -> str:
    """The spec and template a generated file came from: its header comment names them
    (an op's spec, or the template itself for template-only kernels); the manifest may
    name the template too."""
    head = "\n".join(src.files[0][1].splitlines()[:12])
    spec = re.search(r"[\w./-]+\.ya?ml", head)
    template = src.template or (lambda m: m.group(0) if m else "")(
        re.search(r"[\w./-]+\.cuh?\.j2", head))
    parts = ([f"spec {spec.group(0)}"] if spec else []) + (
        [f"template {template}"] if template else [])
    return ", ".join(parts) or "origin not named in its header"


def compile_error(src: Source, log: str) -> EulerError:
    """An NVRTC log as an EulerError at the first error: the line with 2 lines of context
    from the file it is in, and the template and spec the kernel came from."""
    for raw in log.splitlines():
        m = _DIAG_RE.match(raw.strip())
        if not m:
            continue
        name, line = Path(m.group("file")).name, int(m.group("line"))
        text = src.original(name)
        shown = ""
        if text is not None:
            lines = text.splitlines()
            lo, hi = max(1, line - 2), min(len(lines), line + 2)
            shown = "".join(f"\n  {'>' if k == line else ' '} {k:5d} | {lines[k - 1]}"
                            for k in range(lo, hi + 1))
        where = src.path.parent / name if text is not None else Path(m.group("file"))
        return EulerError(f"NVRTC {m.group('kind')}: {m.group('msg')} ({_origin(src)}){shown}",
                          file=str(where), line=line)
    first = log.strip().splitlines()[0] if log.strip() else "no log"
    return EulerError(f"NVRTC failed: {first} ({_origin(src)})", file=str(src.path))


@lru_cache(maxsize=1)
def _include_dirs() -> tuple[str, ...]:
    """The include folders for NVRTC: CuPy's own (its headers, the CCCL it bundles, and the
    CUDA headers it found), plus a folder holding cuda_bf16.h, which NVRTC does not carry
    built in, if CuPy's list lacks one (CUDA_PATH, CUDA_HOME, /usr/local/cuda, the nvidia
    pip wheels)."""
    dirs: list[str] = []
    try:
        from cupy._core.core import assemble_cupy_compiler_options
        dirs = [o[2:] for o in assemble_cupy_compiler_options(()) if o.startswith("-I")]
    except Exception:   # CuPy absent or unable to locate a toolkit: try the others
        pass
    if any((Path(d) / "cuda_bf16.h").is_file() for d in dirs):
        return tuple(dirs)
    candidates = [env.get(v) / "include" for v in ("CUDA_PATH", "CUDA_HOME")
                  if env.get(v)] + [Path("/usr/local/cuda/include")]
    try:
        import nvidia
        candidates += [Path(p) / sub / "include" for p in nvidia.__path__
                       for sub in ("cu13", "cu12", "cuda_runtime")]
    except ImportError:
        pass
    found = next((str(c) for c in candidates if (c / "cuda_bf16.h").is_file()), None)
    if found is None:
        raise EulerError("cuda_bf16.h not found (looked in " + ", ".join(dirs + [str(c) for c in candidates])
                         + "); install the CUDA headers: pip install 'cupy-cuda13x[ctk]', or set "
                         "CUDA_PATH to a CUDA toolkit", key="compile")
    return tuple(dirs) + (found,)


def nvrtc_version() -> tuple[int, int]:
    from cupy_backends.cuda.libs import nvrtc
    return tuple(nvrtc.getVersion())


def device_arch() -> str:
    """The current device's compute capability, clamped to what this NVRTC can target; a
    Hopper GPU gets the arch-specific sm_90a, whose wgmma the attention backward uses (its
    cubins run on sm_90 only, which is the device they are built for)."""
    import cupy
    from cupy_backends.cuda.libs import nvrtc
    cc = int(cupy.cuda.Device().compute_capability)
    supported = [a for a in nvrtc.getSupportedArchs() if a <= cc]
    best = max(supported) if supported else cc
    return "90a" if best == cc == 90 else str(best)


def compile_cubin(src: Source, arch: str, options: tuple[str, ...] = ()) -> bytes:
    """NVRTC: source → cubin for sm_<arch>. Needs NVRTC, not a GPU."""
    from cupy_backends.cuda.libs import nvrtc
    opts = BASE_OPTIONS + tuple(options) + (f"-arch=sm_{arch}",) + tuple(
        f"-I{d}" for d in _include_dirs())
    prog = nvrtc.createProgram(src.text, src.path.name, (), ())
    try:
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError:
            raise compile_error(src, nvrtc.getProgramLog(prog)) from None
        return nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)


_MODULES: dict[str, object] = {}
_PENDING: dict[str, Future] = {}   # cache key -> its compile on a prefetch thread


@dataclass(frozen=True)
class Compiled:
    module: object        # cupy.RawModule
    key: str
    cubin: Path
    from_cache: str       # 'memory' | 'disk' | 'compiled'

    def function(self, name: str):
        try:
            return self.module.get_function(name)
        except Exception as err:   # CUDA_ERROR_NOT_FOUND: the manifest and .cu disagree
            raise EulerError(f"kernel {name!r} is not in the compiled module ({err}); "
                             "rebuild with `eulergen build`", key=name) from None


def compile_file(path: str | Path, options: tuple[str, ...] = (), template: str = "") -> Compiled:
    """The loaded module for a .cu file on the current device, compiling only when neither
    this process nor the disk cache has it. `template` names its template in errors."""
    import cupy
    src = read_source(path, template)
    arch = device_arch()
    key, cubin = cubin_path(src, options, arch)
    if key in _MODULES:
        return Compiled(_MODULES[key], key, cubin, "memory")
    how = "disk"
    pending = _PENDING.pop(key, None)
    if pending is not None:
        pending.result()   # its NVRTC error, if any, raises here as it would below
        how = "compiled"
    elif not cubin.is_file():
        write_atomic(cubin, compile_cubin(src, arch, options))
        how = "compiled"
    try:
        module = cupy.RawModule(path=str(cubin))
        module.module   # load now: a damaged file shows here, not at the first launch
    except Exception:
        if how == "compiled":
            raise
        # A cache file that does not load (another toolkit wrote it, a disk fault):
        # compile again and replace it.
        write_atomic(cubin, compile_cubin(src, arch, options))
        module = cupy.RawModule(path=str(cubin))
        how = "compiled"
    _MODULES[key] = module
    return Compiled(module, key, cubin, how)


def cubin_path(src: Source, options: tuple[str, ...], arch: str) -> tuple[str, Path]:
    """(cache key, cached cubin) of a source compiled with these options for sm_<arch>."""
    key = cache_key(src.text, BASE_OPTIONS + tuple(options), arch, nvrtc_version())
    return key, kernel_cache_dir() / f"{src.path.stem}-sm{arch}-{key[:32]}.cubin"


def prefetch(ops, *, arch: str | None = None, workers: int | None = None) -> int:
    """Start compiling, on background threads, the .cu of each op (manifest entries) that
    neither this process nor the disk cache has; returns how many files. A user's ops go
    first (the one just edited: what its author waits for), then the largest (they bound
    the wait). A compile_file of one of them waits for it; the threads are daemons, so a
    run that stops before its first launch does not wait for them."""
    arch = arch or device_arch()
    jobs, order = {}, {}
    for op in ops:
        if op.cuda is None:
            continue
        src = read_source(op.cuda, op.template)
        options = op_options(op)
        key, cubin = cubin_path(src, options, arch)
        if key not in _MODULES and key not in _PENDING and not cubin.is_file():
            jobs[key] = (src, options, cubin)
            order[key] = (Path(op.manifest).parent == GENERATED_DIR, -len(src.text))
    if not jobs:
        return 0
    _include_dirs()   # found (or refused) once, here, before any compile_file may wait
    todo = queue.SimpleQueue()
    for key in sorted(jobs, key=order.get):
        _PENDING[key] = Future()
        todo.put((*jobs[key], _PENDING[key]))

    def work():
        while True:
            try:
                src, options, cubin, done = todo.get_nowait()
            except queue.Empty:
                return
            try:
                write_atomic(cubin, compile_cubin(src, arch, options))
                done.set_result(cubin)
            except BaseException as err:   # handed to the compile_file that waits for it
                done.set_exception(err)

    for _ in range(min(len(jobs), workers or len(os.sched_getaffinity(0)))):
        threading.Thread(target=work, name="eulergen-nvrtc", daemon=True).start()
    return len(jobs)


def op_options(op) -> tuple[str, ...]:
    """NVRTC options an op's manifest entry asks for: fast math only where its spec opted in
    (DESIGN.md: fast-math is off unless an op opts in)."""
    return ("--use_fast_math",) if op.fast_math else ()


def compile_manifest(path: str | Path, progress=None) -> list[tuple[str, str]]:
    """Warm the cache for every op with CUDA in a manifest: [(op, 'memory'|'disk'|'compiled')]."""
    from eulergen.runtime.engine.manifest import load_manifest
    ops = sorted(load_manifest(path).ops.items())
    prefetch(op for _, op in ops)
    done = []
    for name, op in ops:
        if op.cuda is None:
            continue
        how = compile_file(op.cuda, op_options(op), op.template).from_cache
        done.append((name, how))
        if progress:
            progress(f"{name}: {how}")
    return done
