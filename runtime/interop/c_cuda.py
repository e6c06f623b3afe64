"""kernels.cu of `eulergen export-c`'s CUDA build: for each op function model.c calls (ops.h),
a host function of the same signature that launches the op's generated float32 kernel,
with the launch its runtime kind plans (OpKind.export_launch) for each call model.c makes.
Every launch is planned here, at one token: model.c calls an op with the same sizes every
step (pos0 aside, which no launch depends on)."""
from __future__ import annotations

from eulergen.errors import EulerError
from eulergen.runtime.engine.registry import kind_of
from eulergen.runtime.interop.c_model import Call, wrapped

STATIC_SMEM = 48 << 10   # dynamic shared memory past this needs the kernel's opt-in


def kernels_source(calls: list[Call], keys: int) -> str:
    """The file for model.c's `calls` (c_model.sources), `keys` the KV cache's rows.
    EulerError where an op has no kernel for a call (a head dim the flash kernels lack)."""
    functions: dict[tuple, list[Call]] = {}
    for c in calls:
        functions.setdefault((c.op.name, c.fn.name), []).append(c)
    kernels, bodies = {}, []
    for group in functions.values():
        fn = group[0].fn
        cases = {}
        for c in group:
            sizes = _Read({n: v for n, v in c.values.items() if isinstance(v, int)})
            sizes["keys"] = keys
            kernel, at, extra = kind_of(c.op).export_launch(c.op, fn, sizes)
            kernels[kernel.name] = kernel
            read = tuple((n, sizes[n]) for n in sorted(sizes.read) if n in dict(fn.args))
            cases.setdefault(read, (read, kernel, at, extra))
        bodies += _wrapper(group[0].op, fn, list(cases.values()))
    declarations = [line for k in kernels.values()
                    for line in wrapped(f'extern "C" __global__ void {k.name}',
                                        [f"{t} {n}" for n, t in k.args], "")]
    return "\n".join([
        "// kernels.cu: written by `eulergen export-c`: the op functions of ops.h for the CUDA",
        "// build, each launching its op's generated kernel (<op>.cu) with the launch planned",
        "// for the calls model.c makes; on the default stream, in order.",
        "#include <cstdio>", "", '#include "error.h"', '#include "ops.h"', "",
        "// the generated kernels (<op>.cu) these launch",
        *declarations, "",
        "static void launched(const char* what) {",
        "  const cudaError_t err = cudaGetLastError();",
        '  if (err != cudaSuccess) eg_fail("cuda: %s: %s", what, cudaGetErrorString(err));',
        "}", "", *bodies])


class _Read(dict):
    """A call's sizes, keeping the names a kind's export_launch read: the arguments its
    launch depends on, which the wrapper tests."""

    def __init__(self, *args):
        super().__init__(*args)
        self.read: set[str] = set()

    def __getitem__(self, name):
        self.read.add(name)
        return super().__getitem__(name)


def _wrapper(op, fn, cases) -> list[str]:
    """The host function `fn` of `op`: the launch of each case (the sizes its launch was
    planned for, its kernel, launch and extra arguments), or one line for other sizes."""
    head = wrapped(f'extern "C" void {fn.name}', [f"{t} {n}" for n, t in fn.args], "")
    head[-1] = head[-1].rstrip(";") + " {"
    lines = []
    for n, (constants, kernel, at, extra) in enumerate(cases):
        given = dict(fn.args)
        args = []
        for name, ctype in kernel.args:
            if name not in given and name not in extra:
                raise EulerError(f"kernel {kernel.name} takes {name!r}, which C function "
                                 f"{fn.name} does not give", file=str(op.manifest),
                                 key=f"ops.{op.name}.kernels.{kernel.name}")
            if name not in given:
                args.append(extra[name])
            elif given[name].startswith("const ") and not ctype.startswith("const "):
                # a kernel that may write it (decode's caches, given new rows): here it is
                # given none, so the C function's const holds
                args.append(f"const_cast<{ctype}>({name})")
            else:
                args.append(name)
        test = " && ".join(f"{name} == {value}" for name, value in constants)
        lines.append(f"  {'} else ' if n else ''}if ({test}) {{")
        if at.shared_mem > STATIC_SMEM:
            lines.append(f"    cudaFuncSetAttribute({kernel.name}, "
                         f"cudaFuncAttributeMaxDynamicSharedMemorySize, {at.shared_mem});")
        grid, block = (", ".join(map(str, d)) for d in (at.grid, at.block))
        lines += wrapped(f"{kernel.name}<<<dim3({grid}), dim3({block}), {at.shared_mem}>>>",
                         args, "    ")
    lines += ["  } else {",
              f'    eg_fail("{fn.name}: called with sizes model.c was not exported with");', "  }",
              f'  launched("{fn.name}");', "}", ""]
    return head + lines
