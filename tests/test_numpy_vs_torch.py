"""Every shipped op's generated numpy module, forward and backward, against PyTorch autograd
on the CPU in float64 (the derivation and the printers together, against an independent
implementation)."""
from __future__ import annotations

import numpy as np
import pytest

from eulergen.generator.derive import derive
from eulergen.generator.numpy_module import load_module_from_source, render_numpy_module
from eulergen.generator.ops_path import find_ops
from eulergen.generator.spec import load_spec

torch = pytest.importorskip("torch")
F = torch.nn.functional

# float64 against float64: only rounding separates the two implementations.
RTOL, ATOL = 1e-10, 1e-12


def module(name: str):
    return load_module_from_source(name, render_numpy_module(derive(load_spec(find_ops()[name]))))


def t(a, grad=True):
    return torch.tensor(a, dtype=torch.float64, requires_grad=grad)


def autograd(fn, arrays, douts):
    """Forward outputs and input gradients of a torch function, as numpy."""
    ins = [t(a) for a in arrays]
    outs = fn(*ins)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = torch.autograd.grad(outs, ins, [torch.tensor(d) for d in douts], allow_unused=True)
    return ([o.detach().numpy() for o in outs],
            [np.zeros_like(a) if g is None else g.numpy() for a, g in zip(arrays, grads)])


def as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def assert_matches(name, got_out, got_grads, want_out, want_grads):
    for n, (g, w) in enumerate(zip(got_out, want_out)):
        np.testing.assert_allclose(g, w, RTOL, ATOL, err_msg=f"{name} output {n}")
    for n, (g, w) in enumerate(zip(got_grads, want_grads)):
        np.testing.assert_allclose(g, w, RTOL, ATOL, err_msg=f"{name} grad {n}")


POINTWISE = {
    "gelu": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_erf": lambda x: F.gelu(x),
    "silu": F.silu,
    "relu": F.relu,
    "relu2": lambda x: F.relu(x) ** 2,
    "swiglu": lambda a, b: F.silu(a) * b,
    "geglu": lambda a, b: F.gelu(a, approximate="tanh") * b,
}


@pytest.mark.parametrize("name", sorted(POINTWISE))
def test_pointwise_op_matches_torch(name):
    mod = module(name)
    rng = np.random.default_rng(0)
    ins = [rng.uniform(-5, 5, 200) for _ in mod.INPUTS]
    for a in ins:
        a[:3] = [0.0, -1e-3, 1e-3]  # relu's kink: PyTorch gives 0 at 0, and so must we
    douts = [rng.uniform(-1, 1, 200) for _ in mod.OUTPUTS]
    want_out, want_grads = autograd(POINTWISE[name], ins, douts)
    assert_matches(name, as_tuple(mod.forward(*ins)), as_tuple(mod.backward(*ins, *douts)),
                   want_out, want_grads)


ROWS = {
    "rmsnorm": (lambda x, w: F.rms_norm(x, (x.shape[-1],), w, eps=1e-5), ("x", "w")),
    "layernorm": (lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, eps=1e-5), ("x", "w", "b")),
    "softmax": (lambda x: torch.softmax(x, -1), ("x",)),
    "log_softmax": (lambda x: torch.log_softmax(x, -1), ("x",)),
}


@pytest.mark.parametrize("name", sorted(ROWS))
@pytest.mark.parametrize("n", [1, 17, 64])
def test_row_op_matches_torch(name, n):
    fn, names = ROWS[name]
    mod = module(name)
    rng = np.random.default_rng(n)
    ins = [rng.normal(size=(2, 3, n)) * 3 if a == "x" else rng.normal(size=n) for a in names]
    dy = rng.normal(size=(2, 3, n))
    want_out, want_grads = autograd(fn, ins, [dy])
    assert_matches(name, as_tuple(mod.forward(*ins)), as_tuple(mod.backward(*ins, dy)),
                   want_out, want_grads)


@pytest.mark.parametrize("name", sorted(ROWS))
def test_a_row_op_s_add_fusion_is_the_op_of_the_sum_and_adds_the_stream_s_gradient(name):
    """forward_add(x, branch, w…) = (x + branch, op(x + branch)); backward_add(h, w…, dy,
    dh) = (dh + the op's dx at h, its weight gradients)."""
    fn, names = ROWS[name]
    mod = module(name)
    rng = np.random.default_rng(3)
    x, branch, dy, dh = (rng.normal(size=(2, 3, 17)) * 2 for _ in range(4))
    weights = [rng.normal(size=17) for _ in names[1:]]
    h = x + branch
    want_out, want_grads = autograd(fn, [h, *weights], [dy])
    want_grads[0] = want_grads[0] + dh
    assert_matches(f"{name} add", as_tuple(mod.forward_add(x, branch, *weights)),
                   as_tuple(mod.backward_add(h, *weights, dy, dh)), [h, *want_out], want_grads)


@pytest.mark.parametrize("name", sorted(POINTWISE))
def test_a_pointwise_op_s_bias_fusion_is_the_op_of_x_plus_a_bias_over_rows(name):
    """forward_bias(x…, b…) = op(x + b), b [F] broadcast over rows; backward_bias gives the
    inputs' gradients and the biases' (summed over rows), as torch's broadcast does."""
    mod = module(name)
    rng = np.random.default_rng(4)
    xs = [rng.uniform(-3, 3, (4, 3, 10)) for _ in mod.INPUTS]
    bs = [rng.uniform(-1, 1, 10) for _ in mod.INPUTS]
    douts = [rng.uniform(-1, 1, (4, 3, 10)) for _ in mod.OUTPUTS]
    k = len(xs)
    want_out, want_grads = autograd(lambda *a: POINTWISE[name](*(x + b for x, b in
                                                                 zip(a[:k], a[k:]))),
                                    xs + bs, douts)
    assert_matches(f"{name} bias", as_tuple(mod.forward_bias(*xs, *bs)),
                   as_tuple(mod.backward_bias(*xs, *bs, *douts)), want_out, want_grads)


@pytest.mark.parametrize("n", [1, 5, 300])
def test_cross_entropy_matches_torch(n):
    mod = module("cross_entropy")
    rng = np.random.default_rng(n)
    x = rng.normal(size=(4, 6, n)) * 4
    target = rng.integers(0, n, size=(4, 6))
    dloss = rng.uniform(0.5, 1.5, size=(4, 6))
    xt = t(x)
    loss = F.cross_entropy(xt.reshape(-1, n), torch.tensor(target.reshape(-1)),
                           reduction="none").reshape(4, 6)
    (dx,) = torch.autograd.grad(loss, [xt], torch.tensor(dloss))
    assert_matches("cross_entropy", [mod.forward(x, target)], [mod.backward(x, target, dloss)],
                   [loss.detach().numpy()], [dx.numpy()])


def test_rope_matches_torch():
    mod = module("rope")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 33, 3, 16))
    dy = rng.normal(size=x.shape)
    base = 500.0

    def rope(x):
        B, T, H, D = x.shape
        k = torch.arange(D // 2, dtype=torch.float64)
        theta = torch.arange(T, dtype=torch.float64)[:, None] * base ** (-2 * k / D)
        cos, sin = torch.cos(theta)[None, :, None], torch.sin(theta)[None, :, None]
        x0, x1 = x[..., : D // 2], x[..., D // 2:]
        return torch.cat([x0 * cos - x1 * sin, x0 * sin + x1 * cos], -1)

    want_out, want_grads = autograd(rope, [x], [dy])
    assert_matches("rope", [mod.forward(x, base=base)], [mod.backward(x, dy, base=base)],
                   want_out, want_grads)


def test_adamw_matches_torch_optim_adamw_over_several_steps():
    mod = module("adamw")
    assert mod.CONTROL == ("skip", "grad_scale", "lr", "step")
    rng = np.random.default_rng(0)
    p = rng.normal(size=100)
    grads = [rng.normal(size=100) for _ in range(5)]
    lr = 1e-2
    tp = torch.tensor(p.copy(), requires_grad=True)
    opt = torch.optim.AdamW([tp], lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    m, v = np.zeros_like(p), np.zeros_like(p)
    for step, g in enumerate(grads, start=1):
        tp.grad = torch.tensor(g)
        opt.step()
        mod.step(p, g, m, v, np.array([0.0, 1.0, lr, step]))   # CONTROL: skip, scale, lr, step
    np.testing.assert_allclose(p, tp.detach().numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(m, opt.state[tp]["exp_avg"].numpy(), rtol=1e-12)
    np.testing.assert_allclose(v, opt.state[tp]["exp_avg_sq"].numpy(), rtol=1e-12)


def test_float32_inputs_give_float32_results():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 8)).astype(np.float32)
    w = np.ones(8, np.float32)
    for name, args in [("gelu", (x,)), ("relu", (x,)), ("rmsnorm", (x, w)),
                       ("cross_entropy", (x, np.zeros(3, np.int64)))]:
        out = module(name).forward(*args)
        assert out.dtype == np.float32, f"{name}: {out.dtype}"
