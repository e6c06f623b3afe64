"""An update op's matrix step (Muon's orthogonalisation), on either backend: the op's
`normalize` phase, then Newton-Schulz iterations as GEMMs, between its `step` and `apply`
phases (their kernels or numpy functions: generated from the spec).

The iteration is hand-written math, not derived from a spec (the spec gives its steps and
coefficients): for X [rows, cols] with rows <= cols, A = XXᵀ, B = bA + cA², X ← aX + BX
(modded-nanogpt's quintic); with more rows than columns the same on Xᵀ, which is A = XᵀX and
X ← aX + XB, with no transpose made. Each step is three GEMMs of the caller's GEMM
(runtime/engine/gemm.py: alpha and beta fold the coefficients in) and two copies, over a
workspace of ‖X‖², a second X and A and B (`workspace_elements`), so that on the GPU the
step allocates nothing and can be captured; the result lands in X's buffer or the second,
alternately, and `apply` reads it where it lies. `half` (a bf16 run on the GPU, as
modded-nanogpt iterates): the normalised X is rounded to bf16 and iterated there, on bf16
GEMMs summing in float32 (twice the tensor-core rate of TF32's, half the bytes), in the
same workspace's bytes (two bf16 X, A and B take no more than a float32 X, A and B), and
the result widened back into X's buffer for `apply`.
"""
from __future__ import annotations

import numpy as np

from eulergen.runtime.engine import bf16
from eulergen.runtime.engine.launch_args import aligned, elements


def shapes(rows: int, cols: int) -> tuple[tuple[int, int], ...]:
    """The workspace's views: ‖X‖² [1, 1], the second X [rows, cols], A and B [s, s] with
    s = min(rows, cols)."""
    s = min(rows, cols)
    return (1, 1), (rows, cols), (s, s), (s, s)


def flops(rows: int, cols: int) -> int:
    """The GEMM FLOPs of one Newton-Schulz iteration over a [rows, cols] matrix, s and l the
    smaller and the larger side: A (2·s²·l), A² (2·s³) and BX (2·s²·l)."""
    s, l = min(rows, cols), max(rows, cols)
    return 4 * s * s * l + 2 * s ** 3


def workspace_elements(rows: int, cols: int) -> int:
    """The float32 elements the matrix step of a [rows, cols] parameter works in, in
    float32 or in bf16 (`half`)."""
    return max(elements(shapes(rows, cols)), _half_elements(rows, cols))


def views(workspace, rows: int, cols: int) -> list:
    """`shapes(rows, cols)` as consecutive views of a flat float32 workspace (either backend)."""
    out, at = [], 0
    for shape in shapes(rows, cols):
        n = shape[0] * shape[1]
        out.append(workspace[at:at + n].reshape(shape))
        at += aligned(n)
    if at > workspace.size:
        raise ValueError(f"matrix step workspace of {workspace.size} elements, a [{rows}, "
                         f"{cols}] parameter needs {at}")
    return out


def _half_shapes(rows: int, cols: int) -> tuple[tuple[int, int], ...]:
    s = min(rows, cols)
    return (rows, cols), (rows, cols), (s, s), (s, s)


def _half_elements(rows: int, cols: int) -> int:
    """The float32 elements of `half_views`: ‖X‖², then each bf16 view in whole pairs."""
    return aligned(1) + sum(aligned(-(-r * c // 2)) for r, c in _half_shapes(rows, cols))


def half_views(workspace, rows: int, cols: int) -> list:
    """`half`'s views of the same workspace: ‖X‖² [1, 1] (float32), then, as bf16 bits
    (uint16) in the bytes after it, X and a second X [rows, cols], A and B [s, s]."""
    if _half_elements(rows, cols) > workspace.size:
        raise ValueError(f"matrix step workspace of {workspace.size} elements, a [{rows}, "
                         f"{cols}] parameter needs {_half_elements(rows, cols)} in bf16")
    out, at = [workspace[:1].reshape(1, 1)], aligned(1)
    for r, c in _half_shapes(rows, cols):
        n = aligned(-(-r * c // 2))
        out.append(workspace[at:at + n].view(np.uint16)[:r * c].reshape(r, c))
        at += n
    return out


def step(matrix, arrays: dict, phase, gemm, workspace, xp, half: bool = False) -> None:
    """One matrix op's step over a parameter: `arrays` its operands by name, each [rows,
    cols]; `phase(part, values)` runs a phase ('' the step, 'normalize', 'apply') over the
    arrays named in `values`; `matrix` the op's manifest.MatrixStep; `half`: iterate in
    bf16 (GPU only)."""
    wide_x = x = arrays[matrix.orthogonalize]
    rows, cols = x.shape
    if half:
        sumsq, x, y, a, b = half_views(workspace, rows, cols)
    else:
        sumsq, y, a, b = views(workspace, rows, cols)
    phase("", arrays)
    flat = wide_x.reshape(1, -1)
    gemm(flat, flat, sumsq, tb=True)
    phase("normalize", {matrix.orthogonalize: wide_x, "_sumsq": sumsq.reshape(1)})
    if half:
        bf16.to_bf16(wide_x, out=x)
    ca, cb, cc = matrix.coefficients
    wide = rows <= cols
    for _ in range(matrix.steps):
        gemm(x, x, a, ta=not wide, tb=wide)        # A = XXᵀ (wide) or XᵀX
        xp.copyto(b, a)
        gemm(a, a, b, alpha=cc, beta=cb)           # B = bA + cA²
        xp.copyto(y, x)
        if wide:
            gemm(b, x, y, beta=ca)                 # aX + BX
        else:
            gemm(x, b, y, beta=ca)                 # aX + XB
        x, y = y, x
    if half:
        x = bf16.from_bf16(x, out=wide_x)
    phase("apply", {**arrays, matrix.orthogonalize: x})
