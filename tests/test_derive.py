"""Derivation: the shape of the DerivedOp each kind produces, conventions at kinks, and the
time budget for deriving every shipped op."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import sympy as sp

from eulergen.errors import EulerError
from eulergen.generator import derive as derive_module
from eulergen.generator.check import check_op
from eulergen.generator import ir
from eulergen.generator.derive import derive
from eulergen.generator.printer import print_cuda
from eulergen.generator.ops_path import find_ops
from eulergen.generator.spec import load_spec


def op(name):
    return derive(load_spec(find_ops()[name]))


def codes(derived: ir.DerivedOp) -> list[ir.Code]:
    b = derived.body
    if isinstance(b, ir.RowDerived):
        passes = list(b.passes) + ([b.adjoint_pass] if b.adjoint_pass else [])
        return [p.body for p in passes] + [b.elem_outputs, b.row_outputs, b.adjoints, b.elem_grads]
    if isinstance(b, ir.UpdateDerived):
        return [b.step]
    return [b.forward, b.backward]


def test_deriving_every_shipped_op_takes_under_ten_seconds():
    # A fresh interpreter: no sympy cache, no lru_cache, imports included.
    script = textwrap.dedent("""
        import time
        t = time.perf_counter()
        from eulergen.generator.derive import derive
        from eulergen.generator.numpy_module import render_numpy_module
        from eulergen.generator.ops_path import find_ops
        from eulergen.generator.spec import load_spec
        for name, path in sorted(find_ops().items()):
            d = derive(load_spec(path))
            if d.kind != "attention":
                render_numpy_module(d)
        print(time.perf_counter() - t)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    seconds = float(out.stdout.strip().splitlines()[-1])
    assert seconds < 10.0, f"deriving all shipped ops took {seconds:.1f} s"


def test_generated_text_does_not_depend_on_python_hash_seed():
    # generated/ is committed and `eulergen build --check` compares bytes: set iteration
    # order inside sympy must not leak into the output.
    script = textwrap.dedent("""
        from eulergen.generator.derive import derive
        from eulergen.generator.numpy_module import render_numpy_module
        from eulergen.generator.printer import cuda_expr
        from eulergen.generator.ops_path import find_ops
        from eulergen.generator.spec import load_spec
        for name, path in sorted(find_ops().items()):
            d = derive(load_spec(path))
            if d.kind == "attention":
                print(cuda_expr(d.body.score), cuda_expr(d.body.dscore))
            else:
                print(render_numpy_module(d))
    """)
    outputs = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              check=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout
               for seed in ("1", "2", "3")}
    assert len(outputs) == 1


def test_temporaries_are_numbered_in_order_and_unique_across_the_op():
    for name in find_ops():
        derived = op(name)
        if derived.kind == "attention":
            continue
        temps = [a.name for c in codes(derived) for a in c.temps]
        assert temps == [f"t{n}" for n in range(len(temps))], f"{name}: {temps}"


def test_derivation_is_deterministic():
    first = [print_cuda(c) for c in codes(op("layernorm"))]
    derive_module._derive.cache_clear()
    assert [print_cuda(c) for c in codes(op("layernorm"))] == first


def test_relu_kink_follows_the_declared_convention():
    grad = op("relu").body.backward.result("dx")
    assert grad.has(sp.Heaviside) and all(h.args[1] == 0 for h in grad.atoms(sp.Heaviside))


def test_max_without_kink_is_an_error_at_its_formula(tmp_path):
    (tmp_path / "r.yaml").write_text("name: r\nkind: pointwise\ninputs: [x]\noutputs:\n  y: max(x, 0)\n")
    with pytest.raises(EulerError) as info:
        derive(load_spec(tmp_path / "r.yaml"))
    assert str(info.value).startswith(f"{tmp_path / 'r.yaml'}:5: outputs.y: max/min/abs have a kink")


def test_layernorm_reductions_come_in_dependency_levels():
    body = op("layernorm").body
    assert [p.ops for p in body.passes] == [(("mu", "mean"),), (("var", "mean"),)]
    assert body.adjoints.names == ("dmu", "dvar")
    assert body.elem_grads.names == ("dx", "dw", "db")


def test_layernorms_sum_of_dvar_by_dmu_is_closed_form_zero_not_a_pass():
    # Σ ∂(x - mu)²/∂mu = -2(Σx - N·mu) = 0, as mu = mean(x)
    assert op("layernorm").body.adjoint_pass.ops == (("sum_dvar", "sum"), ("sum_dmu", "sum"))


@pytest.mark.parametrize("name,term", [("log_softmax", "dy"), ("rmsnorm", "dy*w*x")])
def test_a_sums_row_constant_factor_is_taken_out_of_it(name, term):
    """Σ dy·(-1/z) is -Σdy/z: the sum reads no reduction, and costs one multiply a row."""
    body = op(name).body
    (result,) = body.adjoint_pass.body.results
    assert sp.simplify(result.expr - sp.sympify(term, locals={s.name: s for s in result.expr.free_symbols})) == 0
    assert not {s.name for s in result.expr.free_symbols} & {"z", "m", "ms"}


def test_an_affine_chain_sum_reads_the_forward_reduction_of_its_element(tmp_path):
    # q = Σ x·s: ∂q/∂s sums x over the row, which is s itself; x² has no closed form
    derived = _row_spec(tmp_path, "affine", """\
        reduce:
          s: sum(x)
          q: sum(x*s)
          r: sum(x**2*q)
        outputs:
          y: x + r
        """)
    sums = [n for n, _ in derived.body.adjoint_pass.ops]
    assert "sum_q_ds" not in sums and "sum_r_dq" in sums
    rows = check_op(load_spec(tmp_path / "affine.yaml"))
    assert rows and all(r.ok for r in rows), rows


def test_cross_entropy_stabilizer_gets_no_gradient_and_loss_is_per_row():
    derived = op("cross_entropy")
    body = derived.body
    assert [p.ops for p in body.passes] == [(("m", "max"), ("picked", "sum")), (("z", "sum"),)]
    assert body.stabilizers == ("m",) and "dm" not in body.adjoints.names
    assert [(o.name, o.role) for o in derived.outputs] == [("loss", "scalar")]
    assert [(o.name, o.differentiable) for o in derived.inputs] == [("x", True), ("target", False)]


def test_adamw_step_is_sequential_and_temps_never_read_updated_state():
    step = op("adamw").body.step
    assert step.names == ("m", "v", "p")
    for t in step.temps:
        assert not {s.name for s in t.expr.free_symbols} & {"m", "v", "p"}, t
    assert {s.name for s in step.result("p").free_symbols} >= {"m", "v"}


def test_softcap_dscore_is_the_derivative_of_the_score():
    body = op("softcap_attention").body
    s = sp.Symbol("s", real=True)
    assert sp.simplify(body.dscore - sp.diff(body.score, s)) == 0


def test_pair_op_derives_both_halves():
    derived = op("rope")
    assert derived.body.forward.names == ("y0", "y1")
    assert derived.body.backward.names == ("dx0", "dx1")
    assert dict(derived.body.index) == {"pos": "position", "k": "pair", "D": "head_dim"}


def test_declared_name_equal_to_a_generated_row_sum_is_refused(tmp_path):
    (tmp_path / "clash.yaml").write_text(textwrap.dedent("""\
        name: clash
        kind: row
        inputs: {x: row}
        reduce:
          z: sum(exp(x))
          sum_dz: sum(x)
        outputs:
          y: exp(x)/z + sum_dz
        """))
    with pytest.raises(EulerError, match="'sum_dz' is the name of a generated row sum"):
        derive(load_spec(tmp_path / "clash.yaml"))


def _row_spec(tmp_path, name: str, body: str) -> ir.DerivedOp:
    (tmp_path / f"{name}.yaml").write_text(f"name: {name}\nkind: row\ninputs: {{x: row}}\n"
                                           + textwrap.dedent(body))
    return derive(load_spec(tmp_path / f"{name}.yaml"))


@pytest.mark.parametrize("name", ["softmax", "log_softmax", "cross_entropy"])
def test_the_sum_of_exponentials_joins_its_stabilizers_pass_with_factor_exp_a_minus_b(name):
    (online,) = op(name).body.online
    a, b = sp.Symbol(ir.RESCALE_FROM, real=True), sp.Symbol(ir.RESCALE_TO, real=True)
    assert (online.name, online.op, online.max) == ("z", "sum", "m")
    assert sp.simplify(online.factor - sp.exp(a - b)) == 0
    assert online.term.names == ("z",)


def test_norms_have_no_online_sums():
    assert op("layernorm").body.online == () and op("rmsnorm").body.online == ()


def test_sums_that_read_the_max_without_rescaling_by_a_factor_stay_in_their_pass(tmp_path):
    # layernorm about a stabilizer: d and q shift with m, they do not scale with it
    derived = _row_spec(tmp_path, "shifted_norm", """\
        reduce:
          m: max(x)
          d: sum(x - m)
          q: sum((x - m)**2)
        stabilizers: [m]
        outputs:
          y: (x - m - d/N) / sqrt(q/N - (d/N)**2 + 1.0e-5)
        """)
    assert derived.body.online == ()
    assert [p.ops for p in derived.body.passes] == [(("m", "max"),), (("d", "sum"), ("q", "sum"))]


def test_a_term_that_grows_as_x_falls_to_minus_infinity_does_not_join(tmp_path):
    # exp(m - x) rescales by exp(b - a), but a masked element (-inf) would add +inf to it
    derived = _row_spec(tmp_path, "upside_down", """\
        reduce:
          m: max(x)
          z: sum(exp(m - x))
        stabilizers: [m]
        outputs:
          y: exp(x - m) * z
        """)
    assert derived.body.online == ()


def test_a_tempered_mean_joins_with_its_parameter_in_the_factor(tmp_path):
    derived = _row_spec(tmp_path, "tempered", """\
        params: {t: 2.0}
        reduce:
          m: max(x)
          z: mean(exp((x - m) / t))
        stabilizers: [m]
        outputs:
          y: exp((x - m) / t) / (N * z)
        """)
    (online,) = derived.body.online
    a, b, t = (sp.Symbol(n, real=True) for n in (ir.RESCALE_FROM, ir.RESCALE_TO, "t"))
    assert (online.name, online.op) == ("z", "mean")
    assert sp.simplify(online.factor - sp.exp((a - b) / t)) == 0


def test_the_target_logit_is_a_pick_of_one_column():
    (pick,) = op("cross_entropy").body.picks
    assert (pick.name, pick.index) == ("picked", "target")
    assert pick.value.result("picked") == sp.Symbol("x", real=True)


def test_a_term_that_is_not_zero_off_the_target_is_no_pick(tmp_path):
    (tmp_path / "offcol.yaml").write_text(textwrap.dedent("""\
        name: offcol
        kind: row
        inputs: {x: row, t: index}
        reduce:
          s: sum(where(i == t, x, 1))
          p: sum(where(i == t, x*x, 0))
        outputs:
          loss: s + p
        """))
    (pick,) = derive(load_spec(tmp_path / "offcol.yaml")).body.picks
    assert pick.name == "p"
