"""The tape nodes of the KV-cache decoder (runtime/generate/decoder.py) that training's tape does
not have: they read the device-held positions, or the decoder's `live` values (pos0) when
they run, so that one recorded run, eager or captured as a CUDA graph, serves every
position; and LinearAct, a step's linear and activation as one gemv kernel."""
from __future__ import annotations

from eulergen.runtime.engine.gemv import gemv
from eulergen.runtime.generate.moves import scatter_rows, take_row
from eulergen.runtime.model.tape import Tape


class Embed:
    """x = wte[ids] (+ wpe[positions], gathered by the same op and added)."""

    def __init__(self, op, ids, wte, out, wpe=None, positions=None, pos_emb=None):
        self.op, self.ids, self.wte, self.out = op, ids, wte, out
        self.wpe, self.positions, self.pos_emb = wpe, positions, pos_emb

    def forward(self, tape: Tape) -> None:
        tape.lib.forward(self.op, self.ids, self.wte, None, out=(self.out,))
        if self.wpe is not None:
            tape.lib.forward(self.op, self.positions, self.wpe, None, out=(self.pos_emb,))
            tape.add(self.out, self.pos_emb, self.out)


class LinearAct:
    """y = act(x·wᵀ + b) in one kernel (runtime/engine/gemv.py, the op's `gemv` variant): a
    linear and the activation after it, at a step's few rows."""

    def __init__(self, x, w, b, y, act, params: dict):
        self.x, self.w, self.b, self.y, self.act, self.params = x, w, b, y, act, params

    def forward(self, tape: Tape) -> None:
        gemv(self.x, self.w, self.y, bias=self.b, act=self.act, params=self.params)


class Rope:
    """y = rope(x) with the first row at absolute position live['pos0']."""

    def __init__(self, op, x, y, params: dict, live: dict):
        self.op, self.x, self.y, self.params, self.live = op, x, y, params, live

    def forward(self, tape: Tape) -> None:
        tape.lib.forward(self.op, self.x, out=(self.y,), pos0=self.live["pos0"], **self.params)


class Scatter:
    """dst[b, positions[b, t]] = src[b, t]: k and v into the cache, ids into `held`."""

    def __init__(self, src, positions, dst):
        self.src, self.positions, self.dst = src, positions, dst

    def forward(self, tape: Tape) -> None:
        scatter_rows(self.src, self.positions, self.dst)


class Attend:
    """o = attention of the new queries over cache positions 0 … pos0+R-1, with the run's
    keys and values `new` = (k, v) written into the cache's rows pos0 … by the same call
    (lib.decode: the op's score, mask and params; the split planned for `keys`, in
    `workspace`)."""

    def __init__(self, op, q, k_cache, v_cache, o, live: dict, keys: int, workspace, new):
        self.op, self.q, self.k_cache, self.v_cache, self.o = op, q, k_cache, v_cache, o
        self.live, self.keys, self.workspace, self.new = live, keys, workspace, new

    def forward(self, tape: Tape) -> None:
        tape.lib.decode(self.op, self.q, self.k_cache, self.v_cache, self.live["pos0"],
                        out=self.o, keys=self.keys, workspace=self.workspace, new=self.new)


class TakeLast:
    """out [B, d] = x[:, last]: the only position the head and the sampler need (`index`:
    the device-held row of a padded run; None: the run's last row)."""

    def __init__(self, x, out, index=None):
        self.x, self.out, self.index = x, out, index

    def forward(self, tape: Tape) -> None:
        if self.index is None:
            self.out[...] = self.x[:, -1]
        else:
            take_row(self.x, self.index, self.out)


class Advance:
    """positions += 1 after a one-row step: the next step's position."""

    def __init__(self, positions):
        self.positions = positions

    def forward(self, tape: Tape) -> None:
        tape.xp.add(self.positions, 1, out=self.positions)
