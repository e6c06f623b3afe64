"""Planning and rendering attention ops: the plan's kernels, signatures and geometry (no
Jinja), mask classification, per-head constants, spec errors, and (where nvcc is installed)
the CUDA compiling for sm_90."""
from __future__ import annotations

import re
import shutil
import subprocess

import jinja2
import pytest
import sympy as sp

from eulergen import TEMPLATES_DIR
from eulergen.errors import EulerError
from eulergen.generator import ir
from eulergen.generator.plan_attention import (HEAD_DIMS, I, J, ROLES, TilePlan,
                                               check_symbols, mask_mode, plan_attention,
                                               plan_tiles)
from eulergen.generator.render_attention import render_attention
from eulergen.launch import AttentionDecode, AttentionRowdot, AttentionTiles

import attention_ops

H200_SMEM = 227 * 1024  # the most dynamic shared memory one block may opt in to


def _render(derived: ir.DerivedOp) -> ir.RenderedCuda:
    return render_attention(derived, plan_attention(derived))


def _signature(source: str, kernel: str) -> list[str]:
    """Argument names of an extern "C" kernel, as the .cu declares them."""
    m = re.search(rf"void __launch_bounds__\(\d+\) {kernel}\((.*?)\) {{", source, re.S)
    assert m, f"kernel {kernel} not in the source"
    return [a.split()[-1] for a in m.group(1).replace("\n", " ").split(",")]


@pytest.mark.parametrize("name", attention_ops.SHIPPED)
def test_every_kernel_is_defined_with_the_recorded_arguments(name):
    rendered = _render(attention_ops.load(name))
    names = {k.name for k in rendered.kernels}
    for dt in ("f32", "bf16"):
        assert f"{name}_backward_rowdot_{dt}" in names
        for d in HEAD_DIMS:
            for role in ("forward", "backward_dkv", "backward_dq"):
                assert f"{name}_{role}_d{d}_{dt}" in names
    for k in rendered.kernels:
        assert _signature(rendered.source, k.name) == [a for a, _ in k.args], k.name
        smem = 0 if isinstance(k.geometry, AttentionRowdot) else k.geometry.smem_bytes
        assert smem <= H200_SMEM, f"{k.name}: {smem} bytes"


def test_softcap_kernels_take_cap_and_default_it():
    derived = attention_ops.load("softcap_attention")
    rendered = _render(derived)
    fwd = next(k for k in rendered.kernels if k.name == "softcap_attention_forward_d64_bf16")
    assert fwd.args[-1] == ("cap", "float")
    assert [(p.name, p.default) for p in derived.params] == [("cap", 50.0)]   # the manifest's


def test_the_plan_holds_every_kernel_in_order_with_its_geometry():
    plan = plan_attention(attention_ops.load("causal_attention"))
    roles = ("forward", "backward_dkv", "backward_dq", "decode")
    wgmma = ("backward_dkv_wgmma", "backward_dq_wgmma")   # bf16's sm_90a backward
    per_dtype = lambda dt: [  # noqa: E731  (its head dims' kernels, then rowdot)
        f"causal_attention_{role}_d{d}_{dt}" for d in HEAD_DIMS
        for role in roles + (wgmma if dt == "bf16" else ())] + [
        f"causal_attention_backward_rowdot_{dt}"]
    assert [k.sig.name for k in plan.kernels] == per_dtype("f32") + per_dtype("bf16")
    assert plan.sigs == tuple(k.sig for k in plan.kernels)
    for k in plan.kernels:
        g = k.sig.geometry
        assert k.role == g.role and (k.sig.stage, k.sig.part) == (
            (k.role, "") if k.role in ("forward", "decode") else
            ("backward", k.role.removeprefix("backward_")))
        assert isinstance(g, {"decode": AttentionDecode, "rowdot": AttentionRowdot}.get(
            k.role, AttentionTiles))
        assert k.call == tuple(a for a, _ in k.sig.args)   # causal attention has no params
        if k.role != "rowdot":
            assert g.mask == plan.mask == "causal" and g.threads == 32 * k.warps


def test_the_plan_takes_its_tiles_from_plan_tiles():
    plan = plan_attention(attention_ops.load("causal_attention"))
    by_name = {k.sig.name: k for k in plan.kernels}
    for d in HEAD_DIMS:
        tiles = plan_tiles(d, "bf16")
        fwd = by_name[f"causal_attention_forward_d{d}_bf16"]
        assert (fwd.warps, fwd.targ, fwd.sig.geometry.tile) == (
            tiles.fwd_warps, tiles.fwd_mtiles, tiles.fwd_block_n)
        assert fwd.sig.geometry.block_rows == 16 * tiles.fwd_warps * tiles.fwd_mtiles
        dkv = by_name[f"causal_attention_backward_dkv_d{d}_bf16"]
        assert (dkv.targ, dkv.rows, dkv.sig.geometry.tile) == (
            int(tiles.dkv_paired), "key", tiles.dkv_block_m)
        dec = by_name[f"causal_attention_decode_d{d}_bf16"]
        assert (dec.targ, dec.sig.geometry.block_rows) == (tiles.dec_rows, tiles.dec_rows)
        for k in (fwd, dkv, dec):
            assert k.sig.geometry.smem_bytes == tiles.smem_bytes(k.role)
            assert getattr(k.sig.geometry, "isa", "mma") == "mma"
        wg_dkv = by_name[f"causal_attention_backward_dkv_wgmma_d{d}_bf16"].sig.geometry
        wg_dq = by_name[f"causal_attention_backward_dq_wgmma_d{d}_bf16"].sig.geometry
        assert (wg_dkv.isa, wg_dkv.threads, wg_dkv.block_rows, wg_dkv.tile) == (
            "wgmma", 32 * tiles.wg_dkv_warps, 16 * tiles.wg_dkv_warps, tiles.wg_dkv_block_m)
        assert (wg_dq.isa, wg_dq.threads, wg_dq.tile) == (
            "wgmma", 32 * tiles.wg_dq_warps, tiles.wg_dq_block_n)
        for g, role in ((wg_dkv, "backward_dkv"), (wg_dq, "backward_dq")):
            assert g.smem_bytes == tiles.smem_bytes(role, "wgmma")
    assert not any(k.sig.name.endswith("_f32") and "wgmma" in k.sig.name for k in plan.kernels)


def test_tiles_configs_and_roles_narrow_the_plan():
    derived = attention_ops.load("causal_attention")
    odd = TilePlan(64, "f32", fwd_warps=8, fwd_block_n=32, dkv_warps=2, dkv_block_m=16,
                   dq_warps=1, dq_block_n=128)
    plan = plan_attention(derived, tiles={(64, "f32"): odd}, configs=((64, "f32"),),
                          roles=("forward", "rowdot"))
    assert [k.sig.name for k in plan.kernels] == ["causal_attention_forward_d64_f32",
                                                   "causal_attention_backward_rowdot_f32"]
    assert plan.kernels[0].sig.geometry.threads == 256 and plan.kernels[0].sig.geometry.tile == 32
    assert set(ROLES) == {k.role for k in plan_attention(derived).kernels}


def test_params_are_arguments_but_not_passed_on():
    plan = plan_attention(attention_ops.load("softcap_attention"))
    assert plan.params == ("cap",)
    for k in plan.kernels:
        assert "cap" not in k.call
        assert (("cap", "float") in k.sig.args) == (k.role != "rowdot")


def test_the_plan_names_the_per_head_constants():
    plan = plan_attention(attention_ops.load("alibi_attention"))
    names = [n for n, _ in plan.head_consts]
    assert names == [f"hc{i}" for i in range(len(names))] and names
    assert plan.score2.free_symbols & {sp.Symbol(n, real=True) for n in names}
    assert any(e.has(sp.Pow) for _, e in plan.head_consts)   # the slope 2^(-8h/H)


def test_mask_modes():
    assert mask_mode(sp.LessThan(J, I)) == "causal"
    assert mask_mode(sp.GreaterThan(I, J)) == "causal"
    assert mask_mode(None) == "none"
    assert mask_mode(sp.StrictLessThan(J, I)) == "generic"
    assert mask_mode(sp.LessThan(J, I + 4)) == "generic"
    assert mask_mode(sp.And(sp.LessThan(J, I), sp.LessThan(I - J, 128))) == "generic"


def test_causal_kernels_skip_tiles_and_generic_masks_evaluate_the_predicate(tmp_path):
    causal = _render(attention_ops.load("causal_attention")).source
    strict = _render(attention_ops.load("strict_attention", tmp_path)).source
    assert "eg_attn::MASK_CAUSAL>" in causal and "MASK_GENERIC>" not in causal
    assert "eg_attn::MASK_GENERIC>" in strict
    assert re.search(r"bool mask\(float i, float j\) const \{\s*return j < i;", strict)


def test_alibi_slope_is_computed_once_per_head_not_per_element():
    src = _render(attention_ops.load("alibi_attention")).source
    set_head = re.search(r"void set_head\(int head\) \{(.*?)\n  \}", src, re.S).group(1)
    score2 = re.search(r"float score2\(.*?\{(.*?)\n  \}", src, re.S).group(1)
    assert "powf(2.0f" in set_head
    assert "powf" not in score2 and "hc0*(j - i)" in score2


def test_unknown_symbol_in_score_or_mask_is_an_error_naming_file_and_key():
    good = attention_ops.load("causal_attention")
    t = sp.Symbol("t", real=True)
    for key, body in (("score", ir.AttentionDerived(score=t * sp.Symbol("s", real=True),
                                                    dscore=t, mask=None)),
                      ("mask", ir.AttentionDerived(score=good.body.score, dscore=good.body.dscore,
                                                   mask=sp.LessThan(J, t)))):
        op = ir.DerivedOp(good.name, good.kind, good.inputs, good.outputs, good.params, body,
                          good.where, good.spec_sha256)
        with pytest.raises(EulerError) as err:
            check_symbols(op)
        assert err.value.key == key and "'t'" in str(err.value)
        assert str(err.value).startswith(good.where.file)


def test_unknown_symbol_in_a_spec_is_refused_when_loading(tmp_path):
    path = tmp_path / "bad_attention.yaml"
    path.write_text("name: bad_attention\nkind: attention\nscore: s * scale * temp\n"
                    "mask: j <= i\n")
    from eulergen.generator import spec
    with pytest.raises(EulerError) as err:
        spec.load_spec(path)
    assert "bad_attention.yaml" in str(err.value) and "temp" in str(err.value)


@pytest.mark.parametrize("head_dim", [32, 96, 256])
def test_unsupported_head_dim_is_an_error(head_dim):
    with pytest.raises(EulerError, match=f"head dim {head_dim} is not supported"):
        plan_tiles(head_dim, "bf16")


def _prelude() -> str:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES_DIR)))
    return env.get_template("common.cuh.j2").render(header="test prelude")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("name", ["softcap_attention", "strict_attention", "full_attention"])
def test_kernels_compile_for_sm90_without_double_math(name, tmp_path):
    (tmp_path / "eulergen_common.cuh").write_text(_prelude())
    cu = tmp_path / f"{name}.cu"
    cu.write_text(_render(attention_ops.load(name, tmp_path)).source)
    ptx = tmp_path / f"{name}.ptx"
    run = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "--ptx", "-I", str(tmp_path),
                          "-o", str(ptx), str(cu)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "error" not in run.stderr
    text = ptx.read_text()
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in text
    assert not re.search(r"\.f64\b|%fd", text), "double-precision math in the PTX"
