"""The CUDA call path of OpLibrary without a GPU: a stand-in `cupy` (numpy arrays) and
kernels emulated by the op's numpy module, fed exactly the arguments the runtime binds.

What this guards: every manifest kernel is called with the arguments its signature names,
in order and of the right C width; outputs, workspaces and the weight-gradient reduce are
wired as the templates expect (a wrong partials count or a dropped reduce shows as a wrong
gradient); shapes and dtypes are refused before a launch. The kernels' own arithmetic is
tested on the GPU (tests/gpu/test_kernels.py)."""
from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from eulergen import GENERATED_DIR
from eulergen.errors import EulerError
from eulergen.runtime.engine import kernels as K
from eulergen.runtime.engine.backend import Backend, get_backend
from eulergen.runtime.engine.cuda_ops import workspace_elements
from eulergen.runtime.engine.kinds.row import row_aligned, row_kernel
from eulergen.runtime.engine.manifest import load_manifest, load_numpy_module
from eulergen.runtime.engine.bf16 import from_bf16, to_bf16
from eulergen.runtime.engine.ops import OpLibrary

MANIFEST = GENERATED_DIR / "manifest.json"
OPS = load_manifest(MANIFEST).ops if MANIFEST.exists() else {}
needs_manifest = pytest.mark.skipif(not OPS, reason="generated/manifest.json not built yet")


class FakeArray(np.ndarray):
    """A numpy array that answers the questions bind() asks of a CuPy array."""

    @property
    def device(self):
        return types.SimpleNamespace(id=0)

    def get(self):
        return np.asarray(self)

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0], device_id=0)


def _wrap(fn):
    def call(*args, **kwargs):
        out = fn(*args, **kwargs)
        return out.view(FakeArray) if isinstance(out, np.ndarray) else out
    return call


def fake_cupy() -> types.ModuleType:
    mod = types.ModuleType("cupy")
    mod.ndarray = FakeArray
    for name in ("empty", "zeros", "ones", "full", "asarray", "arange", "argsort",
                 "flatnonzero", "concatenate", "stack"):
        setattr(mod, name, _wrap(getattr(np, name)))
    mod.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDevice=lambda: 0))
    return mod


def dev(a) -> FakeArray:
    return np.ascontiguousarray(a).view(FakeArray)


class Emulator:
    """Stands in for Launcher.function: runs each kernel's stage with the numpy module,
    reading and writing only the arrays the launch was given."""

    def __init__(self):
        self.launches: list[tuple[str, tuple, tuple, dict]] = []

    def function(self, launcher, kernel):
        op = launcher.op

        def run(grid, block, args, shared_mem=0):
            names = [n for n, _ in kernel.args]
            assert len(args) == len(names), f"{kernel.name}: {len(args)} args for {names}"
            for (n, ctext), a in zip(kernel.args, args):
                ct = K.parse_ctype(ctext)
                if not ct.pointer:
                    assert a.dtype == ct.dtype, f"{kernel.name}.{n}: passed as {a.dtype}, C {ctext}"
            assert all(g >= 1 for g in grid) and 1 <= int(np.prod(block)) <= 1024
            values = dict(zip(names, args))
            self.launches.append((kernel.name, grid, block, values))
            # bf16 storage: the emulation computes on float32 copies; written ones go back
            # rounded, as the kernels store them.
            wide = {n: from_bf16(np.asarray(a)).view(FakeArray) for (n, ctext), a in zip(kernel.args, args)
                    if K.parse_ctype(ctext).base == "__nv_bfloat16" and isinstance(a, np.ndarray)}
            getattr(self, f"_{op.kind}")(op, kernel, {**values, **wide})
            for (n, ctext) in kernel.args:
                if n in wide and not K.parse_ctype(ctext).const:
                    values[n][...] = to_bf16(np.asarray(wide[n]))
        return run

    @staticmethod
    def _params(op, values):
        return {p: float(values[p]) for p in op.params}

    def _pointwise(self, op, kernel, v):
        mod = load_numpy_module(op)
        ins = [v[o.name] for o in op.inputs]
        if kernel.stage == "forward":
            got, names = mod.forward(*ins, **self._params(op, v)), [o.name for o in op.outputs]
        else:
            douts = [v[f"d{o.name}"] for o in op.outputs]
            got, names = mod.backward(*ins, *douts, **self._params(op, v)), [f"d{g}" for g in op.grads]
        for n, g in zip(names, got if isinstance(got, tuple) else (got,)):
            v[n][...] = g

    def _row(self, op, kernel, v):
        mod = load_numpy_module(op)
        which = kernel.part
        if which == "reduce":
            total = v["partials"][: int(v["num_partials"])].sum(axis=0)
            v["dw"][...] = total + (v["dw"] if int(v["accumulate"]) else 0)
            return
        rows, cols = int(v["rows"]), int(v["cols"])
        shape = {"row": (rows, cols), "weight": (cols,), "index": (rows,), "scalar": (rows,)}
        take = lambda name, role: np.asarray(v[name]).reshape(shape[role])  # noqa: E731
        if which == "cols":
            # the kernel gets the weights its terms read: any value serves for the others
            ins = [take(o.name, o.role) if o.name in v else np.ones(shape[o.role], np.float32)
                   for o in op.inputs]
            assert np.isfinite(np.asarray(v["rowstats"])).all(), "the rows part wrote them"
        else:
            ins = [take(o.name, o.role) for o in op.inputs]
        p = self._params(op, v)
        if which == "rows":
            v["rowstats"][...] = 0
        if kernel.stage in ("forward", "fwdbwd"):
            got = mod.forward(*ins, **p)
            for o, g in zip(op.outputs, got if isinstance(got, tuple) else (got,)):
                v[o.name].reshape(shape[o.role])[...] = g
        if kernel.stage in ("backward", "fwdbwd"):
            douts = [take(f"d{o.name}", o.role) for o in op.outputs]
            grads = mod.backward(*ins, *douts, **p)
            for o, g in zip((o for o in op.inputs if o.differentiable),
                            grads if isinstance(grads, tuple) else (grads,)):
                # the split backward: its rows part writes the input grads, its cols the
                # weights' partials
                if which == ("cols" if o.role != "weight" else "rows"):
                    continue
                if o.role == "weight":
                    part = v[f"d{o.name}_partials"]
                    part[...] = 0
                    part[-1] = g   # the reduce must sum every partial row it was given
                else:
                    v[f"d{o.name}"].reshape(shape["row"])[...] = g

    def _pair(self, op, kernel, v):
        mod = load_numpy_module(op)
        B, T, H, D = (int(v[k]) for k in "BTHD")
        ins = [v[o.name] for o in op.inputs if o.name in v]
        if kernel.stage == "forward":
            got, names = mod.forward(*ins, **self._params(op, v)), [o.name for o in op.outputs]
        else:
            douts = [v[f"d{o.name}"] for o in op.outputs]
            xs = ins or [np.zeros((B, T, H, D), np.float32) for _ in op.inputs]
            got, names = mod.backward(*xs, *douts, **self._params(op, v)), [f"d{g}" for g in op.grads]
        for n, g in zip(names, got if isinstance(got, tuple) else (got,)):
            assert v[n].strides[:3] == tuple(int(v[f"{n}_s{k}"]) * 4 for k in "bth")
            v[n][...] = g

    def _update(self, op, kernel, v):
        fixed = {p: float(v[p]) for p, default in op.params.items() if default is not None}
        load_numpy_module(op).step(*[v[o.name] for o in op.inputs], v["control"], **fixed)
        weight = next(o.name for o in op.inputs if o.role == "state")
        inputs = {o.name for o in op.inputs}
        for n, _ in kernel.args:   # the bf16 copy, where the call gave one
            if n.endswith("_bf16") and n not in inputs and isinstance(v[n], np.ndarray):
                v[n][...] = v[weight]

    def _embedding(self, op, kernel, v):
        if kernel.stage == "forward":
            C, T, flat = int(v["C"]), int(v["T"]), np.asarray(v["ids"]).reshape(-1)
            assert 0 <= flat.min() and flat.max() < int(v["V"]), "the kernel traps"
            out = v["out"].reshape(-1, C)
            out[...] = v["wte"][flat]
            if not isinstance(v["wpe"], np.uint64):
                out += np.tile(v["wpe"][:T], (flat.size // T, 1))
        elif kernel.part == "sort":
            n, tile = int(v["n"]), kernel.geometry.tile
            keys = (np.asarray(v["ids"]).reshape(-1).astype(np.int64) << 32) | np.arange(n)
            for b in range(0, n, tile):
                v["tiled"][b:b + tile] = np.sort(keys[b:b + tile])
            v["first"][:int(v["V"])] = 0
            v["runs"][0] = 0
        elif kernel.part == "merge":
            v["keys"][...] = np.sort(v["tiled"])
            ids, rank = np.unique(np.asarray(v["keys"]) >> 32, return_index=True)
            v["first"][ids] = int(v["n"]) - rank
        elif kernel.part in ("wte", "wte_long"):
            # the first kernel sums the runs of at most long_run keys and lists the others,
            # which the second sums
            C, keys = int(v["C"]), np.asarray(v["keys"])
            rows, ids = v["dout"].reshape(-1, C), keys >> 32
            long_run = op.kernel("backward", "f32", part="wte_long").geometry.long_run
            present, counts = np.unique(ids, return_counts=True)
            is_long = np.isin(ids, present[counts > long_run])
            if kernel.part == "wte":
                assert (np.flatnonzero(v["first"][:int(v["V"])]) == present).all()
                listed = present[counts > long_run]
                v["runs"][0] = listed.size
                v["runs"][1:1 + listed.size] = listed[::-1]       # any order
                if not v["accumulate"]:
                    v["dwte"][np.setdiff1d(np.arange(int(v["V"])), listed)] = 0
                take = ~is_long
            else:
                listed = np.asarray(v["runs"][1:1 + int(v["runs"][0])])
                assert sorted(listed) == sorted(present[counts > long_run])
                if not v["accumulate"]:
                    v["dwte"][listed] = 0
                take = is_long
            np.add.at(v["dwte"], ids[take], rows[keys[take] & 0xFFFFFFFF])
        else:
            B, T, C = int(v["B"]), int(v["T"]), int(v["C"])
            total = v["dout"].reshape(B, T, C).sum(axis=0)
            v["dwpe"][:T] = v["dwpe"][:T] + total if v["accumulate"] else total


@pytest.fixture
def emu(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy())
    e = Emulator()
    monkeypatch.setattr(K.Launcher, "function", lambda self, kernel: e.function(self, kernel))
    return e


@pytest.fixture
def libs(emu):
    import cupy
    return OpLibrary(Backend("cuda", cupy, True, "emulated")), OpLibrary(get_backend("numpy"))


def _ops(kind):
    return sorted(n for n, o in OPS.items() if o.kind == kind)


# The update ops of one kernel a step; a matrix step's phases and GEMMs (muon) are
# tests/test_optimizer.py's and test_cuda_emulated.py's.
POINTWISE_UPDATES = [n for n in _ops("update") if OPS[n].matrix is None]


def close(got, want):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


@needs_manifest
@pytest.mark.parametrize("name", _ops("pointwise"))
def test_pointwise_calls_bind_every_argument(name, libs, emu):
    gpu, ref = libs
    op = OPS[name]
    rng = np.random.default_rng(0)
    xs = [rng.uniform(-2, 2, (3, 5)).astype(np.float32) for _ in op.inputs]
    got = gpu.forward(name, *map(dev, xs))
    want = ref.forward(name, *xs)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        close(g, w)
    douts = [rng.uniform(-1, 1, (3, 5)).astype(np.float32) for _ in op.outputs]
    for g, w in zip(gpu.backward(name, *map(dev, xs + douts)), ref.backward(name, *xs, *douts)):
        close(g, w)
    assert emu.launches[0][0] == f"{name}_forward_f32"


@needs_manifest
@pytest.mark.parametrize("cols", [17, 2048])
@pytest.mark.parametrize("name", _ops("row"))
def test_row_calls_wire_outputs_workspace_and_reduce(name, cols, libs, emu):
    gpu, ref = libs
    op = OPS[name]
    rng = np.random.default_rng(cols)
    lead = (3, 7)
    xs = [rng.integers(0, cols, lead).astype(np.int32) if o.role == "index" else
          rng.uniform(-2, 2, (cols,) if o.role == "weight" else lead + (cols,)).astype(np.float32)
          for o in op.inputs]
    got = gpu.forward(name, *map(dev, xs))
    want = ref.forward(name, *xs)
    close(got, want)
    layout = OPS[name].kernels[emu.launches[0][0]].geometry.shape
    assert layout == ("warp_per_row" if cols <= 1024 else "block_per_row")
    douts = [rng.uniform(-1, 1, lead if o.role == "scalar" else lead + (cols,)).astype(np.float32)
             for o in op.outputs]
    for g, w in zip(gpu.backward(name, *map(dev, xs + douts)), ref.backward(name, *xs, *douts)):
        close(g, w)


@needs_manifest
@pytest.mark.parametrize("name,dtype,layouts", [
    ("softmax", "bf16", ("warp_per_row", "block_held", "block_held", "block_per_row")),
    ("cross_entropy", "bf16", ("warp_per_row", "block_held", "block_held", "block_per_row")),
    ("layernorm", "bf16", ("warp_per_row", "block_held", "block_held", "block_per_row")),
    ("softmax", "f32", ("warp_per_row", "block_per_row", "block_per_row", "block_per_row"))])
def test_row_kernel_takes_the_warp_then_the_held_block_then_the_long_row_block(name, dtype,
                                                                               layouts):
    """A warp's registers hold 768 bf16 columns; block_held kernels (bf16, stages without
    weight gradients) hold the rows from there to their max_cols (8192); longer rows take
    block_per_row, as every row past a warp's does where there is no held kernel (fp32, and
    the backward of an op with weights)."""
    op = OPS[name]
    top = 8192
    for cols, layout in zip((768, 769, top, top + 1), layouts):
        for aligned in (True, False):
            k = row_kernel(op, "forward", dtype, cols, aligned)
            assert (k.geometry.shape, k.geometry.aligned) == (layout, aligned), cols
            if name == "layernorm":
                back = row_kernel(op, "backward", dtype, cols, aligned)
                assert back.geometry.shape == ("warp_per_row" if cols <= 768
                                               else "block_per_row"), cols


@needs_manifest
@pytest.mark.parametrize("name", ["layernorm", "rmsnorm"])
def test_long_rows_take_the_split_backward_in_the_given_workspace(name, libs, emu):
    """From the plan's split_cols columns (generator/plan.py WGRAD_SPLIT_COLS) a backward
    with weight gradients is its rows, cols and reduce parts, its per-row values
    and partials carved from the caller's workspace as workspace_elements counts them."""
    gpu, ref = libs
    op = OPS[name]
    split = op.kernel("backward", "f32", part="rows").geometry.split_cols
    rng = np.random.default_rng(5)
    # split - 1: the fused kernel; split (odd): the `_unaligned` split kernels; a multiple
    # of 8 past it: the aligned ones (numpy's buffers start on 16-byte boundaries)
    for cols in (split - 1, split, -(-split // 8) * 8 + 8):
        emu.launches.clear()
        x = rng.uniform(-2, 2, (3, cols)).astype(np.float32)
        weights = [rng.uniform(0.5, 1.5, cols).astype(np.float32)
                   for o in op.inputs if o.role == "weight"]
        dy = rng.uniform(-1, 1, x.shape).astype(np.float32)
        need = workspace_elements(op, "backward", x.shape)
        workspace = dev(np.full(need, np.nan, np.float32))
        got = gpu.backward(name, dev(x), *map(dev, weights), dev(dy), workspace=workspace)
        for g, w in zip(got, ref.backward(name, x, *weights, dy)):
            np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-5)
        parts = [op.kernels[k].part for k, _, _, _ in emu.launches]
        first = ["rows", "cols"] if cols >= split else [""]
        assert {op.kernels[k].stage for k, _, _, _ in emu.launches} == {"backward"}
        assert parts == first + ["reduce"] * len(weights)
        aligned = [op.kernels[k].geometry.aligned for k, _, _, _ in emu.launches[:len(first)]]
        assert aligned == [cols % 8 == 0] * len(first)
        for _, _, _, values in emu.launches[:len(first)]:
            for n, a in values.items():
                if n == "rowstats" or n.endswith("_partials"):
                    assert np.shares_memory(a, workspace), n
        if cols >= split:
            groups = emu.launches[1][1][1]
            stats = op.kernel("backward", "f32", part="cols").geometry.row_stats
            assert need == sum(-(-n // 64) * 64 for n in [3 * stats] + [groups * cols] * len(weights))


def test_row_aligned_wants_one_offset_for_rows_and_whole_vectors_only_with_weights():
    assert row_aligned([0x100, 0x210], [], row_bytes=34, wgrads=False)  # heads alike
    assert not row_aligned([0x100, 0x204], [], row_bytes=32, wgrads=False)
    assert not row_aligned([0x100, 0x200], [0x300], row_bytes=34, wgrads=False)
    assert not row_aligned([0x104, 0x204], [0x300], row_bytes=32, wgrads=False)
    assert not row_aligned([0x100, 0x200], [0x308], row_bytes=32, wgrads=False)
    assert row_aligned([0x100, 0x200], [0x300], row_bytes=32, wgrads=False)
    assert not row_aligned([0x100], [], row_bytes=34, wgrads=True)
    assert row_aligned([0x100], [], row_bytes=48, wgrads=True)


@needs_manifest
@pytest.mark.parametrize("name", _ops("row"))
def test_row_calls_take_the_aligned_kernels_exactly_where_every_access_is_16_bytes(
        name, libs, emu):
    """Whole 16-byte vectors a row: the aligned kernel. A row length that leaves a head: the
    aligned one still where the op has no weights (its row operands share the head). An
    input 4 bytes off a boundary: `_unaligned` where a row output (new, on a boundary) or a
    weight is not off alike."""
    gpu, ref = libs
    op = OPS[name]
    weights = any(o.role == "weight" for o in op.inputs)
    row_out = any(o.role == "row" for o in op.outputs)
    rng = np.random.default_rng(0)
    for cols, shift, aligned in ((2048, 0, True), (2047, 0, not weights),
                                 (2048, 1, not weights and not row_out)):
        xs = []
        for o in op.inputs:
            if o.role == "index":
                xs.append(dev(rng.integers(0, cols, 5).astype(np.int32)))
            elif o.role == "weight":
                xs.append(dev(rng.uniform(-2, 2, cols).astype(np.float32)))
            else:
                flat = dev(rng.uniform(-2, 2, 5 * cols + shift).astype(np.float32))
                xs.append(flat[shift:].reshape(5, cols))
        got = gpu.forward(name, *xs)
        close(got, ref.forward(name, *(np.asarray(x) for x in xs)))
        kernel = emu.launches[-1][0]
        assert ("_unaligned_" not in kernel) == aligned, (cols, shift, kernel)


@needs_manifest
@pytest.mark.parametrize("name", [n for n in _ops("row")
                                  if any(k.stage == "fwdbwd" for k in OPS[n].kernels.values())])
def test_fused_row_call_may_write_the_gradient_over_the_input(name, libs, emu):
    gpu, ref = libs
    op = OPS[name]
    rng = np.random.default_rng(3)
    xs = [rng.integers(0, 50, (6,)).astype(np.int32) if o.role == "index" else
          rng.uniform(-2, 2, (6, 50)).astype(np.float32) for o in op.inputs]
    dl = [np.full(6, 0.5, np.float32) for _ in op.outputs]
    want = ref.fused(name, *xs, *dl)
    ins = list(map(dev, xs))
    loss = dev(np.zeros(6, np.float32))
    got = gpu.fused(name, *ins, *map(dev, dl), out=(loss, ins[0]))
    assert got[1] is ins[0] and emu.launches[-1][0].startswith(f"{name}_fwdbwd")
    close(loss, want[0])
    close(ins[0], want[1])


@needs_manifest
@pytest.mark.parametrize("name", _ops("pair"))
def test_pair_calls_pass_element_strides_of_views(name, libs, emu):
    gpu, ref = libs
    rng = np.random.default_rng(4)
    qkv = rng.uniform(-2, 2, (2, 5, 3, 4, 8)).astype(np.float32)
    q_view = dev(qkv)[:, :, 0]
    close(gpu.forward(name, q_view), ref.forward(name, qkv[:, :, 0]))
    dy = rng.uniform(-1, 1, (2, 5, 4, 8)).astype(np.float32)
    close(gpu.backward(name, q_view, dev(dy))[0], ref.backward(name, qkv[:, :, 0], dy)[0])


@needs_manifest
@pytest.mark.parametrize("name", _ops("pair"))
def test_pair_calls_over_2_31_tokens_are_refused_before_any_launch(name, libs, emu):
    """The pair kernels count tokens in 32 bits. A broadcast view holds 2^31 tokens in one
    element of memory."""
    gpu, _ = libs
    x = np.broadcast_to(np.zeros(1, np.float32), (1 << 16, 1 << 15, 1, 2)).view(FakeArray)
    with pytest.raises(EulerError, match="at most 2\\^31 - 1"):
        gpu.forward(name, x)
    assert not emu.launches


@needs_manifest
@pytest.mark.parametrize("name", POINTWISE_UPDATES)
def test_update_step_updates_the_given_buffers(name, libs, emu):
    gpu, ref = libs
    op = OPS[name]
    rng = np.random.default_rng(5)
    host = [rng.uniform(0, 1, 37).astype(np.float32) for _ in op.inputs]
    ours = [dev(h.copy()) for h in host]
    runtime = {k: 1.0 if k == "step" else 1e-2 for k, v in op.params.items() if v is None}
    gpu.step(name, *ours, **runtime)
    ref.step(name, *host, **runtime)
    for a, b in zip(ours, host):
        close(a, b)
    (_, _, _, values), = emu.launches
    slots = gpu.control_slots(name)
    assert slots == ref.control_slots(name)
    assert values["control"].dtype == np.float32   # what the kernels read
    assert values["control"].tolist() == [np.float32({"skip": 0.0, "grad_scale": 1.0,
                                                      **runtime}[s]) for s in slots]


@needs_manifest
@pytest.mark.parametrize("name", POINTWISE_UPDATES)
def test_a_bf16_update_step_takes_its_control_array_and_writes_the_bf16_copy(name, libs, emu):
    gpu, _ = libs
    op = OPS[name]
    rng = np.random.default_rng(6)
    arrays = [dev(to_bf16(rng.uniform(-1, 1, 40)) if o.role == "grad"
                  else rng.uniform(0, 1, 40).astype(np.float32)) for o in op.inputs]
    slots = gpu.control_slots(name)
    control = dev(np.array([{"skip": 0.0, "grad_scale": 0.5}.get(s, 1e-2) for s in slots],
                           np.float32))
    copy = dev(np.zeros(40, np.uint16))
    gpu.step(name, *arrays, control=control, copy=copy)
    (kernel, _, _, values), = emu.launches
    assert kernel == f"{name}_step_bf16" and values["control"] is control
    weight = next(a for o, a in zip(op.inputs, arrays) if o.role == "state")
    np.testing.assert_array_equal(copy, to_bf16(np.asarray(weight)))
    with pytest.raises(EulerError, match="comes from control"):
        gpu.step(name, *arrays, control=control, **{slots[-1]: 1.0})
    with pytest.raises(EulerError, match="must be float32"):
        gpu.step(name, *arrays, control=dev(np.zeros(len(slots))))
    with pytest.raises(EulerError, match="copy= wants the weight's shape"):
        gpu.step(name, *arrays, control=control, copy=dev(np.zeros(39, np.uint16)))
    # float32 grads beside a bf16 copy (autocast): the autocast kernel writes it
    emu.launches.clear()
    wide = [dev(from_bf16(np.asarray(a)) if a.dtype == np.uint16 else a) for a in arrays]
    gpu.step(name, *wide, control=control, copy=copy)
    (kernel, _, _, values), = emu.launches
    assert kernel == f"{name}_step_autocast_f32" and values["control"] is control
    np.testing.assert_array_equal(copy, to_bf16(np.asarray(wide[0])))


@needs_manifest
@pytest.mark.skipif("embedding" not in OPS, reason="no embedding op")
def test_embedding_backward_groups_repeated_ids_and_matches_numpy(libs, emu):
    gpu, ref = libs
    rng = np.random.default_rng(6)
    ids = rng.integers(0, 5, (3, 4)).astype(np.int32)   # many repeats
    wte = rng.standard_normal((5, 16)).astype(np.float32)
    wpe = rng.standard_normal((8, 16)).astype(np.float32)
    close(gpu.forward("embedding", dev(ids), dev(wte), dev(wpe)), ref.forward("embedding", ids, wte, wpe))
    dout = rng.standard_normal((3, 4, 16)).astype(np.float32)
    got = gpu.backward("embedding", dev(ids), dev(wte), dev(wpe), dev(dout))
    want = ref.backward("embedding", ids, wte, wpe, dout)
    close(got[0], want[0])
    close(got[1], want[1])
    assert not got[1][4:].any(), "positions past T have a zero gradient"
    # accumulate: the table's gradient adds to what is there (the tied head's), per flag
    dwte, dwpe = dev(np.ones_like(wte)), dev(np.ones_like(wpe))
    gpu.backward("embedding", dev(ids), dev(wte), dev(wpe), dev(dout), out=(dwte, dwpe),
                 accumulate=(True, False))
    close(dwte, want[0] + 1)
    close(dwpe, want[1])
    with pytest.raises(EulerError, match="accumulate= needs out="):
        gpu.backward("embedding", dev(ids), dev(wte), dev(wpe), dev(dout), accumulate=True)
    with pytest.raises(EulerError, match="accumulate= has 1 flags, expected 2"):
        gpu.backward("embedding", dev(ids), dev(wte), dev(wpe), dev(dout), out=(dwte, dwpe),
                     accumulate=(True,))


@needs_manifest
@pytest.mark.skipif("embedding" not in OPS, reason="no embedding op")
def test_embedding_backward_sorts_on_the_device_in_the_callers_workspace(libs, emu,
                                                                         monkeypatch):
    """No host read of a device array (on a GPU, a sync): the range check is the kernels',
    and sort, merge, run sums and long-run sums are four launches (no positions here)
    whose sort keys, first-key ranks and list of long runs live in the caller's
    workspace, so a planned step allocates nothing; nor does the table gradient take a
    fill: the run sums write all of it. Ids 0 and 1 here take thousands of tokens each
    (long runs), id 2 a few (a short run)."""
    from eulergen.runtime.engine.cuda_ops import workspace_elements
    gpu, ref = libs
    rng = np.random.default_rng(8)
    ids = rng.integers(0, 2, (2, 5000)).astype(np.int32)   # several sort tiles
    ids[0, :3] = 2
    wte = rng.standard_normal((3, 8)).astype(np.float32)
    dout = rng.standard_normal((2, 5000, 8)).astype(np.float32)
    ws = dev(np.full(workspace_elements(gpu.op("embedding"), "backward", ids.shape,
                                        table_rows=wte.shape[0]), np.nan, np.float32))
    emu.launches.clear()

    def refuse(*args, **kwargs):
        raise AssertionError("the host read a device array (a sync on a GPU)")
    with monkeypatch.context() as m:
        for name in ("get", "item", "tolist", "__int__", "__index__", "__float__", "__bool__"):
            m.setattr(FakeArray, name, refuse, raising=False)
        got = gpu.backward("embedding", dev(ids), dev(wte), None, dev(dout), workspace=ws)
    assert [n for n, *_ in emu.launches] == ["embedding_backward_sort_f32",
                                              "embedding_backward_merge_f32",
                                              "embedding_backward_wte_f32",
                                              "embedding_backward_wte_long_f32"]
    tile = gpu.op("embedding").kernel("backward", "f32", part="sort").geometry.tile
    assert emu.launches[0][1] == (-(-ids.size // tile),) and ids.size > 2 * tile
    assert np.shares_memory(emu.launches[2][3]["keys"], ws)
    assert np.shares_memory(emu.launches[2][3]["first"], ws)
    assert np.shares_memory(emu.launches[3][3]["runs"], ws)
    close(got[0], ref.backward("embedding", ids, wte, None, dout)[0])
    assert got[1] is None


@needs_manifest
@pytest.mark.parametrize("name", _ops("row")[:1] + _ops("pointwise")[:1])
def test_bf16_arrays_select_the_bf16_kernels_and_come_back_as_bf16(name, libs, emu):
    gpu, ref = libs
    op = OPS[name]
    rng = np.random.default_rng(7)
    xs = [rng.integers(0, 32, (4,)).astype(np.int32) if o.role == "index" else
          from_bf16(to_bf16(rng.uniform(-2, 2, (32,) if o.role == "weight" else (4, 32))
                            .astype(np.float32))) for o in op.inputs]
    got = gpu.forward(name, *[dev(x if x.dtype == np.int32 else to_bf16(x)) for x in xs])
    got = got if isinstance(got, tuple) else (got,)
    want = ref.forward(name, *xs)
    for o, g, w in zip(op.outputs, got, want if isinstance(want, tuple) else (want,)):
        if o.role != "scalar":
            assert g.dtype == np.uint16
            g = from_bf16(np.asarray(g))
        np.testing.assert_allclose(g, w, rtol=2.0 ** -8, atol=1e-6)
    assert emu.launches[0][0].endswith("_bf16")


@needs_manifest
def test_bad_calls_are_refused_before_any_launch(libs, emu):
    gpu, _ = libs
    name = _ops("pointwise")[0]
    n_in = len(OPS[name].inputs)
    with pytest.raises(EulerError, match="expected a CuPy array"):
        gpu.forward(name, *[np.ones(4, np.float32)] * n_in)
    with pytest.raises(EulerError, match=r"out y has shape \(3,\), expected \(4,\)|out .* has shape"):
        gpu.forward(name, *[dev(np.ones(4, np.float32))] * n_in,
                    out=tuple(dev(np.ones(3, np.float32)) for _ in OPS[name].outputs))
    with pytest.raises(EulerError, match="float32 or bf16"):
        gpu.forward(name, *[dev(np.ones(4, np.float64))] * n_in)
    assert emu.launches == []
