"""Attention ops → their plan (`AttentionPlan`): every per-kernel choice of the flash
kernels, made before anything is rendered (generator/render_attention.py only prints it).

Kernels per op, for each storage dtype and head dim D ∈ HEAD_DIMS:
  <op>_forward_d<D>_<dt>       q, k, v → o, lse           grid (query tiles, H, B)
  <op>_backward_dkv_d<D>_<dt>  → dk, dv                    grid (key tiles, KVH, B)
  <op>_backward_dq_d<D>_<dt>   → dq                        grid (query tiles, H, B)
and one <op>_backward_rowdot_<dt> (delta = rowsum(dO ∘ O), any D) run before the other two;
  <op>_decode_d<D>_<dt>        q, k/v cache → o            grid (row chunks · splits, KVH, B)
for new queries at positions pos0 … against a KV cache (split-K over the cache, merged by
the last block of each chunk: templates/attention_decode.cu.j2).
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from eulergen import launch
from eulergen.errors import EulerError
from eulergen.generator import ir
from eulergen.generator.plan import CTYPE, DTYPES
from eulergen.signature import KernelSig

HEAD_DIMS = (64, 128)

# The symbols an attention formula may use besides its declared params.
S, I, J, H, N_HEADS, SCALE = sp.symbols("s i j h n_heads scale", real=True)
SCORE_SYMBOLS = frozenset({S, I, J, H, N_HEADS, SCALE})
MASK_SYMBOLS = frozenset({I, J, H, N_HEADS})
# What is fixed for a whole (head, launch): such subexpressions are computed once per head.
_HEAD_SYMBOLS = frozenset({H, N_HEADS, SCALE})

ROWDOT_WARPS = 8  # rows per block of the rowdot kernel (one warp a row)
ROLES = ("forward", "backward_dkv", "backward_dq", "rowdot", "decode")
# Each role's kernel as the runtime finds it: the op's call (its signature's stage) and part.
_CALL = {"forward": ("forward", ""), "backward_dkv": ("backward", "dkv"),
         "backward_dq": ("backward", "dq"), "rowdot": ("backward", "rowdot"),
         "decode": ("decode", "")}


@dataclass(frozen=True)
class TilePlan:
    """Tiles for one (head dim, dtype). Warps own 16 rows each; `*_tile` is the other side.

    forward: a block is 16·fwd_warps queries, streaming fwd_block_n keys at a time.
    decode:  a block is dec_rows query rows of one kv head, streaming dec_tile keys a step.
    dkv:     a block is 16·dkv_warps keys, streaming dkv_block_m queries at a time;
             dkv_paired computes Sᵀ with dPᵀ, then dV with dK, in shared loops (two
             independent mma chains each), else one product after another.
    dq:      a block is 16·dq_warps queries, streaming dq_block_n keys at a time.
    fp32 storage splits every operand in two bf16 planes and loads synchronously (one
    stage); bf16 double-buffers its streamed tiles with cp.async.
    wgmma:   bf16 also has backward kernels for sm_90a (attention_bwd_wgmma.cu.j2), a
             warpgroup per 64 rows: dkv blocks of 16·wg_dkv_warps keys streaming
             wg_dkv_block_m queries, dq blocks of 16·wg_dq_warps queries streaming
             wg_dq_block_n keys; the runtime takes them on a Hopper GPU."""
    head_dim: int
    dtype: str
    fwd_warps: int
    fwd_block_n: int
    dkv_warps: int
    dkv_block_m: int
    dq_warps: int
    dq_block_n: int
    fwd_mtiles: int = 1   # 16-row slabs a warp owns (2: each K/V fragment feeds two mma)
    dq_mtiles: int = 1
    dkv_paired: bool = False
    dec_warps: int = 4    # decode: threads 32·dec_warps, D/16 lanes a key
    dec_rows: int = 1     # query rows (t, head of the kv head's group) a decode block owns
    dec_tile: int = 64    # keys a decode block loads at once
    wgmma: bool = False
    wg_dkv_warps: int = 4
    wg_dkv_block_m: int = 64
    wg_dq_warps: int = 4
    wg_dq_block_n: int = 64

    def __post_init__(self):
        if self.head_dim not in HEAD_DIMS:
            raise EulerError(f"head dim {self.head_dim} is not supported (expected one of "
                             f"{HEAD_DIMS})", key="head_dim")
        for name in ("fwd_warps", "dkv_warps", "dq_warps"):
            if getattr(self, name) not in (1, 2, 4, 8):
                raise EulerError(f"{name} = {getattr(self, name)}: expected 1, 2, 4 or 8",
                                 key=name)
        for name in ("fwd_mtiles", "dq_mtiles"):
            if getattr(self, name) not in (1, 2):
                raise EulerError(f"{name} = {getattr(self, name)}: expected 1 or 2", key=name)
        key_slots = 32 * self.dec_warps // (self.head_dim // 16)   # keys a decode block reads a step
        if not (self.dec_warps in (1, 2, 4, 8) and 1 <= self.dec_rows <= min(
                self.dec_warps, self.head_dim // 16) and self.dec_tile % max(key_slots, 32) == 0):
            raise EulerError(f"decode plan warps {self.dec_warps}, rows {self.dec_rows}, tile "
                             f"{self.dec_tile}: want rows <= warps and <= D/16, and a tile of "
                             f"whole steps of {key_slots} keys and of 32", key="dec_tile")
        if self.wgmma:
            if self.dtype != "bf16":
                raise EulerError("wgmma kernels are bf16 only", key="wgmma")
            for name in ("wg_dkv_warps", "wg_dq_warps"):
                if getattr(self, name) not in (4, 8):
                    raise EulerError(f"{name} = {getattr(self, name)}: expected 4 or 8 "
                                     f"(whole warpgroups)", key=name)
            for name in ("wg_dkv_block_m", "wg_dq_block_n"):
                if getattr(self, name) not in (32, 64, 128):
                    raise EulerError(f"{name} = {getattr(self, name)}: expected 32, 64 or 128 "
                                     f"(a wgmma N)", key=name)
        for name in ("fwd_block_n", "dkv_block_m", "dq_block_n"):
            if getattr(self, name) not in (16, 32, 64, 128):
                raise EulerError(f"{name} = {getattr(self, name)}: expected 16, 32, 64 or 128",
                                 key=name)

    @property
    def planes(self) -> int:
        return 2 if self.dtype == "f32" else 1

    @property
    def stages(self) -> int:
        return 1 if self.dtype == "f32" else 2

    def _tile_bytes(self, rows: int) -> int:
        return rows * (self.head_dim + 8) * 2 * self.planes  # bf16 rows padded by 8 (16 bytes)

    def smem_bytes(self, role: str, isa: str = "mma") -> int:
        """Dynamic shared memory of each kernel; must match the carving in the templates."""
        if isa == "wgmma":  # unpadded core-matrix tiles, the streamed ones double-buffered
            tile = 2 * self.head_dim
            if role == "backward_dkv":
                bn, bm = 16 * self.wg_dkv_warps, self.wg_dkv_block_m
                return 2 * bn * tile + 4 * bm * tile + 4 * bm * 4
            if role == "backward_dq":
                return (2 * 16 * self.wg_dq_warps + 4 * self.wg_dq_block_n) * tile
            raise ValueError(role)
        if role == "forward":
            bm, bn = 16 * self.fwd_warps * self.fwd_mtiles, self.fwd_block_n
            return self._tile_bytes(bm) + 2 * self.stages * self._tile_bytes(bn)
        if role == "backward_dkv":
            bn, bm = 16 * self.dkv_warps, self.dkv_block_m
            return (2 * self._tile_bytes(bn) + 2 * self.stages * self._tile_bytes(bm)
                    + 2 * self.stages * bm * 4)
        if role == "backward_dq":
            bm, bn = 16 * self.dq_warps * self.dq_mtiles, self.dq_block_n
            return 2 * self._tile_bytes(bm) + 2 * self.stages * self._tile_bytes(bn)
        if role == "decode":  # scores [rows][tile], 4 per-row values, per-warp sums [warps][rows][D]
            rows = self.dec_rows
            return 4 * (rows * self.dec_tile + 4 * rows + self.dec_warps * rows * self.head_dim)
        raise ValueError(role)


def plan_tiles(head_dim: int, dtype: str) -> TilePlan:
    """Tile sizes: 64-row blocks of 4 warps, except where registers run short: dkv streams
    32 queries at D = 128, dQ 32 keys; bf16 at D = 64 gives a forward warp two slabs and
    pairs dkv's products; decode blocks own one query row and load 64 keys a step; the
    wgmma backward runs two warpgroups a block (the measurements: benchmarks/RESULTS.md,
    "plan_tiles' tiles")."""
    if head_dim not in HEAD_DIMS:
        raise EulerError(f"head dim {head_dim} is not supported (expected one of {HEAD_DIMS})",
                         key="head_dim")
    if dtype not in CTYPE:
        raise EulerError(f"unknown storage dtype {dtype!r} (expected one of {sorted(CTYPE)})")
    return TilePlan(head_dim, dtype, fwd_warps=4, fwd_block_n=64, dkv_warps=4,
                    dkv_block_m=64 if head_dim == 64 else 32, dq_warps=4, dq_block_n=32,
                    fwd_mtiles=2 if (head_dim, dtype) == (64, "bf16") else 1,
                    dkv_paired=(head_dim, dtype) == (64, "bf16"),
                    dec_warps=4 if head_dim == 64 else 8,
                    wgmma=dtype == "bf16", wg_dkv_warps=8, wg_dkv_block_m=64 if head_dim == 64
                    else 32, wg_dq_warps=8)


def mask_mode(mask: sp.Basic | None) -> str:
    """'causal' only for the predicate j <= i (tiles above the diagonal are skipped);
    any other predicate is evaluated per element ('generic'); None is 'none'."""
    if mask is None or mask is sp.true:
        return "none"
    if isinstance(mask, sp.LessThan):
        gap = mask.rhs - mask.lhs
    elif isinstance(mask, sp.GreaterThan):
        gap = mask.lhs - mask.rhs
    else:
        return "generic"
    return "causal" if sp.expand(gap - (I - J)) == 0 else "generic"


def check_symbols(derived: ir.DerivedOp) -> None:
    """Score and mask may use only s, i, j, h, n_heads, scale (mask: no s, no scale) and
    the op's params; anything else is a spec error, reported before any CUDA is written."""
    body = derived.body
    params = {sp.Symbol(p.name, real=True) for p in derived.params}
    where = derived.where
    for key, expr, allowed in (("score", body.score, SCORE_SYMBOLS),
                               ("mask", body.mask, MASK_SYMBOLS)):
        if expr is None:
            continue
        unknown = sorted(str(x) for x in expr.free_symbols - allowed - params)
        if unknown:
            names = ", ".join(sorted(str(x) for x in allowed | params))
            raise EulerError(f"unknown symbol {unknown[0]!r} (an attention {key} may use {names})",
                             file=where.file, line=where.line, key=key)


class _HeadConstants:
    """Replaces every subexpression that depends only on per-head symbols and params by a
    named constant (hc0, hc1, …), which the kernel computes once per head."""

    def __init__(self, fixed: frozenset):
        self.fixed = fixed
        self.consts: dict[sp.Expr, sp.Symbol] = {}

    def __call__(self, e: sp.Basic) -> sp.Basic:
        if e.is_Atom or e.is_number:
            return e
        if self._fixed(e):
            return self._name(e)
        if isinstance(e, (sp.Add, sp.Mul)):
            fixed = [a for a in e.args if self._fixed(a)]
            rest = [self(a) for a in e.args if not self._fixed(a)]
            if len(fixed) > 1 or (fixed and not fixed[0].is_Atom and not fixed[0].is_number):
                fixed = [self._name(e.func(*fixed))]  # scale·log2(e) → one constant
            return e.func(*fixed, *rest, evaluate=False)
        if e.args:
            return e.func(*(self(a) for a in e.args))
        return e

    def _fixed(self, e: sp.Basic) -> bool:
        return e.free_symbols <= self.fixed

    def _name(self, e: sp.Expr) -> sp.Symbol:
        if e not in self.consts:
            self.consts[e] = sp.Symbol(f"hc{len(self.consts)}", real=True)
        return self.consts[e]


def _strides(*tensors: str) -> list[tuple[str, str]]:
    return [(f"{t}_{s}", "long long") for t in tensors for s in ("sb", "st", "sh")]


def kernel_args(role: str, dtype: str, params: tuple[str, ...]) -> list[tuple[str, str]]:
    """(name, C type) of each kernel argument in launch order. Strides are in elements:
    sb (batch), st (sequence), sh (head); the head dim is contiguous."""
    t = CTYPE[dtype]
    src, dst, flt = f"const {t}*", f"{t}*", [(p, "float") for p in params]
    sizes = [("n", "int"), ("n_heads", "int"), ("n_kv_heads", "int")]
    if role == "forward":
        return ([("q", src), ("k", src), ("v", src), ("o", dst), ("lse", "float*")] + sizes
                + _strides("q", "k", "v", "o") + flt)
    if role == "decode":
        return ([("q", src), ("k", dst), ("v", dst), ("kn", src), ("vn", src), ("o", dst),
                 ("part", "float*"), ("counts", "int*"), ("tq", "int"), ("pos0", "int"),
                 ("n_heads", "int"), ("n_kv_heads", "int"), ("splits", "int"),
                 ("split_keys", "int")]
                + _strides("q", "k", "v", "kn", "vn", "o") + flt)
    if role == "rowdot":
        return ([("o", src), ("dout", src), ("delta", "float*"), ("batch", "int"), ("n", "int"),
                 ("n_heads", "int"), ("head_dim", "int")] + _strides("o", "do"))
    inputs = [("q", src), ("k", src), ("v", src), ("dout", src), ("lse", "const float*"),
              ("delta", "const float*")]
    if role == "backward_dkv":
        return (inputs + [("dk", dst), ("dv", dst)] + sizes
                + _strides("q", "k", "v", "do", "dk", "dv") + flt)
    if role == "backward_dq":
        return inputs + [("dq", dst)] + sizes + _strides("q", "k", "v", "do", "dq") + flt
    raise ValueError(role)


@dataclass(frozen=True)
class AttentionKernel:
    """One extern "C" kernel: its signature (with its launch geometry, which holds the head
    dim, threads, rows a block owns, streamed tile, shared memory and mask mode) and what
    else the template instantiates it with."""
    sig: KernelSig
    call: tuple[str, ...]         # the arguments passed on to the device function (no params)
    targ: int = 0                 # after the warps: slabs a warp (forward, dq), pairing (dkv),
                                  # rows (decode); rowdot has none
    rows: str = ""                # what a block's rows are: 'query' | 'key' (rowdot: '')

    @property
    def role(self) -> str:
        """One of ROLES, as the geometry records it."""
        return self.sig.geometry.role

    @property
    def warps(self) -> int:
        return self.sig.geometry.threads // 32


@dataclass(frozen=True)
class AttentionPlan:
    """Every choice of one attention op's kernels. The score (times 1/ln 2, for exp2) and its
    derivative have their per-head subexpressions replaced by the named head constants."""
    op: str
    params: tuple[str, ...]
    mask: str                                   # mask_mode: 'causal' | 'generic' | 'none'
    score2: sp.Expr
    dscore: sp.Expr
    head_consts: tuple[tuple[str, sp.Expr], ...]  # (hc0, its expression), … in order
    kernels: tuple[AttentionKernel, ...]        # per dtype: per head dim its roles, then rowdot

    @property
    def sigs(self) -> tuple[KernelSig, ...]:
        return tuple(k.sig for k in self.kernels)


def _kernel(op: str, role: str, dtype: str, t: TilePlan | None, mode: str,
            params: tuple[str, ...], isa: str = "mma") -> AttentionKernel:
    """`t`: the tiles of the kernel's (head dim, dtype); rowdot, which takes any D, has none.
    isa 'wgmma': the sm_90a variant of a backward role."""
    args = kernel_args(role, dtype, params)
    call = tuple(a for a, _ in args if a not in params)
    stage, part = _CALL[role]
    if role == "rowdot":
        sig = KernelSig(f"{op}_backward_rowdot_{dtype}", tuple(args), dtype, stage,
                        launch.AttentionRowdot(32 * ROWDOT_WARPS, ROWDOT_WARPS), part=part)
        return AttentionKernel(sig, call)
    warps, block_rows, targ, tile, rows = {
        "forward": (t.fwd_warps, 16 * t.fwd_warps * t.fwd_mtiles, t.fwd_mtiles, t.fwd_block_n,
                    "query"),
        "backward_dkv": (t.dkv_warps, 16 * t.dkv_warps, int(t.dkv_paired), t.dkv_block_m,
                         "key"),
        "backward_dq": (t.dq_warps, 16 * t.dq_warps * t.dq_mtiles, t.dq_mtiles, t.dq_block_n,
                        "query"),
        "decode": (t.dec_warps, t.dec_rows, t.dec_rows, t.dec_tile, "query"),
    }[role] if isa == "mma" else {
        "backward_dkv": (t.wg_dkv_warps, 16 * t.wg_dkv_warps, 0, t.wg_dkv_block_m, "key"),
        "backward_dq": (t.wg_dq_warps, 16 * t.wg_dq_warps, 0, t.wg_dq_block_n, "query"),
    }[role]
    flash = dict(head_dim=t.head_dim, threads=32 * warps, block_rows=block_rows, tile=tile,
                 smem_bytes=t.smem_bytes(role, isa), mask=mode)
    if role == "decode":
        geometry = launch.AttentionDecode(**flash)
    else:
        geometry = launch.AttentionTiles(**flash, role=role, isa=isa)
    name = f"{op}_{role}{'_wgmma' if isa == 'wgmma' else ''}_d{t.head_dim}_{dtype}"
    sig = KernelSig(name, tuple(args), dtype, stage, geometry, part=part)
    return AttentionKernel(sig, call, targ, rows)


def plan_attention(derived: ir.DerivedOp, *,
                   tiles: dict[tuple[int, str], TilePlan] | None = None,
                   configs: tuple[tuple[int, str], ...] | None = None,
                   roles: tuple[str, ...] = ROLES) -> AttentionPlan:
    """The plan of one attention op: both dtypes, every head dim. `tiles` may replace
    plan_tiles' for some (head_dim, dtype), and `configs` limit the op to some (head_dim,
    dtype) (both for the emulation tests and `benchmarks/attention.py --sweep`); `roles` to
    some kernels (decode alone compiles in a fraction of the time: its tests and sweep)."""
    check_symbols(derived)
    body: ir.AttentionDerived = derived.body
    params = tuple(p.name for p in derived.params)
    hoist = _HeadConstants(_HEAD_SYMBOLS | {sp.Symbol(p, real=True) for p in params})
    score2 = hoist(body.score / sp.log(2))
    dscore = hoist(body.dscore)
    mode = mask_mode(body.mask)
    kernels = []
    for dtype in DTYPES:
        dims = [d for d in HEAD_DIMS if configs is None or (d, dtype) in configs]
        if not dims:
            continue
        for d in dims:
            dim_tiles = (tiles or {}).get((d, dtype)) or plan_tiles(d, dtype)
            kernels += [_kernel(derived.name, role, dtype, dim_tiles, mode, params)
                        for role in ("forward", "backward_dkv", "backward_dq", "decode")
                        if role in roles]
            if dim_tiles.wgmma:
                kernels += [_kernel(derived.name, role, dtype, dim_tiles, mode, params, "wgmma")
                            for role in ("backward_dkv", "backward_dq") if role in roles]
        if "rowdot" in roles:
            kernels.append(_kernel(derived.name, "rowdot", dtype, None, mode, params))
    return AttentionPlan(derived.name, params, mode, score2, dscore,
                         tuple((s.name, e) for e, s in hoist.consts.items()), tuple(kernels))
