"""The generated flash-attention kernels, run on the CPU: the .cu is compiled by g++ against
tests/attention_emulator/ (CUDA threads as fibers; ldmatrix and mma.sync emulated from
the PTX ISA tables) and checked against the generated numpy reference. q, k, v and dq, dk,
dv are views of one [B, T, H + 2·KVH, D] buffer each, as training lays them out. This catches
indexing, tiling, masking and fragment-layout mistakes without a GPU; speed and the real
PTX are for tests/gpu/test_attention.py."""
from __future__ import annotations

import functools
import shutil
import subprocess
import tempfile
import types
from pathlib import Path

import jinja2
import numpy as np
import pytest

from eulergen import TEMPLATES_DIR
from eulergen.generator.numpy_attention import render_attention_module
from eulergen.generator.plan_attention import HEAD_DIMS, TilePlan, plan_attention
from eulergen.generator.render_attention import render_attention
from eulergen.runtime.engine.bf16 import from_bf16, to_bf16

import attention_ops

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")]

EMULATOR = Path(__file__).resolve().parent / "attention_emulator"
_FOLDER = Path(tempfile.mkdtemp(prefix="eg-attn-emu-"))

_RUN = """\
static void run_{key}(int B, int T, int H, int KVH, const float* params) {{
  typedef {ctype} S;
  const int D = {d};
  const long long W = (long long)(H + 2 * KVH) * D;  // q, k, v: views of one fused buffer
  std::vector<S> qkv_v = load<S>("qkv.bin", (size_t)B * T * W);
  std::vector<S> do_v = load<S>("do.bin", (size_t)B * T * H * D);
  std::vector<S> o_v((size_t)B * T * H * D), dqkv_v(qkv_v.size());  // dq, dk, dv: views too
  std::vector<float> lse_v((size_t)B * H * T), delta_v(lse_v.size());
  const S* q = qkv_v.data();
  const S* k = q + (long long)H * D;
  const S* v = k + (long long)KVH * D;
  const S* dout = do_v.data();
  S* o = o_v.data();
  S* dq = dqkv_v.data();
  S* dk = dq + (long long)H * D;
  S* dv = dk + (long long)KVH * D;
  float* lse = lse_v.data();
  float* delta = delta_v.data();
  const int n = T, n_heads = H, n_kv_heads = KVH, batch = B, head_dim = D;
  const long long q_sb = T * W, q_st = W, q_sh = D, k_sb = T * W, k_st = W, k_sh = D;
  const long long v_sb = T * W, v_st = W, v_sh = D;
  const long long o_sb = (long long)T * H * D, o_st = (long long)H * D, o_sh = D;
  const long long do_sb = o_sb, do_st = o_st, do_sh = D, dq_sb = T * W, dq_st = W, dq_sh = D;
  const long long dk_sb = T * W, dk_st = W, dk_sh = D, dv_sb = T * W, dv_st = W, dv_sh = D;
{params}
  emu_launch(dim3(cdiv(T, {fwd_rows}), H, B), dim3({fwd_threads}), [&] {{ {fwd}({fwd_args}); }});
  emu_launch(dim3(cdiv(B * H * T, {rd_rows})), dim3({rd_threads}), [&] {{ {rd}({rd_args}); }});
  emu_launch(dim3(cdiv(T, {dkv_rows}), KVH, B), dim3({dkv_threads}), [&] {{ {dkv}({dkv_args}); }});
  emu_launch(dim3(cdiv(T, {dq_rows}), H, B), dim3({dq_threads}), [&] {{ {dq}({dq_args}); }});
  save("o.bin", o_v); save("lse.bin", lse_v); save("dqkv.bin", dqkv_v);
}}
"""

_MAIN = """\
#include "{op}.cu"
#include <string>
namespace eg_attn {{ alignas(16) unsigned char eg_smem[232448]; }}

static int cdiv(long long a, int b) {{ return (int)((a + b - 1) / b); }}
template <typename T> static std::vector<T> load(const char* path, size_t n) {{
  std::vector<T> v(n);
  FILE* f = std::fopen(path, "rb");
  if (!f || std::fread(v.data(), sizeof(T), n, f) != n) {{ std::fprintf(stderr, "%s\\n", path); std::exit(2); }}
  std::fclose(f);
  return v;
}}
template <typename T> static void save(const char* path, const std::vector<T>& v) {{
  FILE* f = std::fopen(path, "wb");
  std::fwrite(v.data(), sizeof(T), v.size(), f);
  std::fclose(f);
}}

{runs}
int main(int argc, char** argv) {{
  // usage: run KEY B T H KVH [params...], in a folder holding qkv.bin and do.bin
  const std::string key = argv[1];
  const int B = std::atoi(argv[2]), T = std::atoi(argv[3]), H = std::atoi(argv[4]), KVH = std::atoi(argv[5]);
  std::vector<float> params;
  for (int a = 6; a < argc; ++a) params.push_back((float)std::atof(argv[a]));
{dispatch}
  return 3;
}}
"""


def _prelude() -> str:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES_DIR)))
    return env.get_template("common.cuh.j2").render(header="prelude (CPU emulation)")


# Other tilings than the planner's (D = 64): 8 and 1 warps a block, two 16-row slabs a
# warp, tiles of 16 to 128, so that every loop bound and causal skip is exercised off the
# 64 x 64 default; dK/dV unpaired (the planner pairs bf16 at D = 64), so both orders run.
# The wgmma kernels (bf16): two warpgroups a block, 32 queries a dkv step, 128 keys a dq step.
ODD_PLANS = {(64, dt): TilePlan(64, dt, fwd_warps=8, fwd_block_n=32, dkv_warps=2,
                                dkv_block_m=16, dq_warps=1, dq_block_n=128,
                                fwd_mtiles=2, dq_mtiles=2, wgmma=dt == "bf16", wg_dkv_warps=8,
                                wg_dkv_block_m=32, wg_dq_warps=8, wg_dq_block_n=128)
             for dt in ("f32", "bf16")}


@functools.lru_cache(maxsize=None)
def _build(name: str, odd: bool = False):
    """(binary, numpy module, params) for one op, built once per session."""
    folder = _FOLDER / (name + ("_odd" if odd else ""))
    folder.mkdir(parents=True, exist_ok=True)
    derived = attention_ops.load(name, folder)
    rendered = render_attention(derived, plan_attention(derived, tiles=ODD_PLANS if odd else None),
                                templates=jinja2.FileSystemLoader(str(EMULATOR)))
    (folder / "eulergen_common.cuh").write_text(_prelude())
    (folder / f"{name}.cu").write_text(rendered.source)
    sigs = {k.name: k for k in rendered.kernels}
    pnames = [p.name for p in derived.params]
    runs, dispatch = [], []
    for dt, ctype, isa in (("f32", "float", ""), ("bf16", "__nv_bfloat16", ""),
                           ("bf16", "__nv_bfloat16", "_wgmma")):
        for d in HEAD_DIMS:
            key = f"d{d}_{dt}{isa}"
            names = {"fwd": f"{name}_forward_d{d}_{dt}",
                     "dkv": f"{name}_backward_dkv{isa}_d{d}_{dt}",
                     "dq": f"{name}_backward_dq{isa}_d{d}_{dt}", "rd": f"{name}_backward_rowdot_{dt}"}
            fields = {"key": key, "ctype": ctype, "d": d, "params": "\n".join(
                f"  const float {p} = params[{n}];" for n, p in enumerate(pnames))}
            for role, kname in names.items():
                g = sigs[kname].geometry
                fields[role] = kname
                fields[f"{role}_args"] = ", ".join(a for a, _ in sigs[kname].args)
                fields[f"{role}_rows"] = g.rows_per_block if role == "rd" else g.block_rows
                fields[f"{role}_threads"] = g.threads
            runs.append(_RUN.format(**fields))
            dispatch.append(f'  if (key == "{key}") {{ run_{key}(B, T, H, KVH, params.data()); '
                            "return 0; }")
    (folder / "main.cpp").write_text(_MAIN.format(op=name, runs="\n".join(runs),
                                                  dispatch="\n".join(dispatch)))
    binary = folder / "run"
    build = subprocess.run(["g++", "-std=c++17", "-O1", "-w", "-I", str(EMULATOR), "-I",
                            str(folder), "main.cpp", "-o", str(binary)],
                           cwd=folder, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    mod = types.ModuleType(name)
    exec(compile(render_attention_module(derived), f"{name}.py", "exec"), mod.__dict__)
    return binary, mod, {p.name: p.default for p in derived.params}


def _rel(ours, ref) -> float:
    """Max abs error over max abs value, floored at 0.1 (inputs are standard normal)."""
    assert np.all(np.isfinite(ours)), "non-finite values"
    return float(np.max(np.abs(ours - ref)) / max(np.max(np.abs(ref)), 0.1))


def _emulate(name, dtype, D, B, T, H, KVH, seed=0, odd=False, isa="mma", **params):
    binary, mod, defaults = _build(name, odd)
    params = {**defaults, **params}
    rng = np.random.default_rng(seed)
    qkv = rng.standard_normal((B, T, (H + 2 * KVH) * D)).astype(np.float32)
    do = rng.standard_normal((B, T, H, D)).astype(np.float32)
    if dtype == "bf16":
        qkv, do = from_bf16(to_bf16(qkv)), from_bf16(to_bf16(do))
    folder = Path(tempfile.mkdtemp(dir=_FOLDER))
    store = (lambda a: to_bf16(a)) if dtype == "bf16" else (lambda a: a)
    store(qkv).tofile(folder / "qkv.bin")
    store(do).tofile(folder / "do.bin")
    key = f"d{D}_{dtype}" + ("_wgmma" if isa == "wgmma" else "")
    run = subprocess.run([str(binary), key, str(B), str(T), str(H), str(KVH),
                          *(repr(float(v)) for v in params.values())],
                         cwd=folder, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]

    def read(file, shape, stored=True):
        raw = np.fromfile(folder / file, np.uint16 if stored and dtype == "bf16" else np.float32)
        return (from_bf16(raw) if stored and dtype == "bf16" else raw).reshape(shape)
    def split(buf):
        return (buf[:, :, :H], buf[:, :, H:H + KVH], buf[:, :, H + KVH:])
    dqkv = read("dqkv.bin", (B, T, H + 2 * KVH, D))
    ours = {"o": read("o.bin", (B, T, H, D)), "lse": read("lse.bin", (B, H, T), stored=False),
            **dict(zip(("dq", "dk", "dv"), split(dqkv)))}
    q, k, v = split(qkv.reshape(B, T, H + 2 * KVH, D).astype(np.float64))
    o, lse = mod.forward(q, k, v, **params)
    dq, dk, dv = mod.backward(q, k, v, o, lse, do.astype(np.float64), **params)
    ref = {"o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    # fp32: split-bf16 products keep ~16 bits; bf16: P and dS are rounded to bf16 for the mma.
    tol = {"f32": 1e-3, "bf16": 3e-2}[dtype]
    for n in ref:
        err = _rel(ours[n], ref[n])
        assert err < (1e-4 if n == "lse" else tol), \
            f"{name} D={D} {dtype} {isa} T={T} {n}: {err:.2e}"
    return ours


# (dtype, isa): the mma.sync kernels in both storage dtypes, the wgmma ones (bf16 only).
KERNELS = [("f32", "mma"), ("bf16", "mma"), ("bf16", "wgmma")]


@pytest.mark.parametrize("dtype,isa", KERNELS)
@pytest.mark.parametrize("D", [64, 128])
def test_causal_two_partial_tiles_with_gqa(D, dtype, isa):
    _emulate("causal_attention", dtype, D, B=1, T=70, H=2, KVH=1, isa=isa)


def test_causal_single_row():
    _emulate("causal_attention", "bf16", 64, B=2, T=1, H=2, KVH=2)


@pytest.mark.parametrize("isa", ["mma", "wgmma"])
def test_causal_many_tiles_batches_and_groups(isa):
    _emulate("causal_attention", "bf16", 64, B=2, T=150, H=4, KVH=2, seed=1, isa=isa)


@pytest.mark.parametrize("dtype,isa", [("f32", "mma"), ("bf16", "wgmma")])
def test_generic_mask_with_an_empty_row(dtype, isa):
    ours = _emulate("strict_attention", dtype, 64, B=1, T=40, H=2, KVH=1, isa=isa)
    assert np.all(ours["o"][:, 0] == 0) and np.all(ours["dq"][:, 0] == 0)


@pytest.mark.parametrize("isa", ["mma", "wgmma"])
def test_no_mask(isa):
    _emulate("full_attention", "bf16", 128, B=1, T=70, H=2, KVH=2, isa=isa)


def test_softcap_with_a_small_cap():
    _emulate("softcap_attention", "f32", 64, B=1, T=50, H=2, KVH=1, cap=2.0)


@pytest.mark.parametrize("isa", ["mma", "wgmma"])
def test_alibi_slopes_per_head(isa):
    _emulate("alibi_attention", "bf16", 64, B=1, T=70, H=4, KVH=2, isa=isa)


@pytest.mark.parametrize("dtype,isa", KERNELS)
def test_other_tilings(dtype, isa):
    _emulate("causal_attention", dtype, 64, B=1, T=300, H=2, KVH=1, odd=True, isa=isa)


@pytest.mark.parametrize("isa", ["mma", "wgmma"])
def test_other_tilings_with_a_generic_mask(isa):
    _emulate("strict_attention", "bf16", 64, B=1, T=100, H=2, KVH=2, odd=True, isa=isa)
