"""A kernel's signature: one frozen value per `extern "C"` entry point, made by the planner
(generator/), printed by its template (`c_params`), written into manifest.json (`to_json`),
read back by the runtime as the same value (`from_json`), and bound and launched there by
its names, C types and geometry.

A kernel is found by what it is, through `select`: the call of the op it serves (`stage`),
its storage dtype, which of that call's kernels it is (`part`), the fused variant it
belongs to (`fusion`), the mixed-precision variant (`precision`) and facts of its geometry
(a row layout's `aligned`, an attention kernel's `head_dim`). Kernel names are the
planner's alone: nothing looks a kernel up by one.

An op's C functions (its CPU build for `eulergen export-c`) have a signature too,
`CFunction`: their parameters, the call and the fused variant, with no launch.

A leaf: it imports only eulergen/launch.py, so the generator and the runtime share it.
"""
from __future__ import annotations

from dataclasses import dataclass

from eulergen.launch import Geometry, from_json as geometry_from_json

DTYPES = ("f32", "bf16")   # storage dtypes; compute is fp32
# The first slots of an update step's `control` argument, before the op's runtime params:
# whether the step is skipped, and the factor every grad input is scaled by.
CONTROL = ("skip", "grad_scale")
# The mixed-precision variants besides '' (every pointer in the kernel's dtype): `autocast`
# stores the operands torch.autocast keeps in float32 so (a row op's stream, its gradient
# and its weights; an update's grads beside a bf16 weight copy), the others in `dtype`.
AUTOCAST = "autocast"
PRECISIONS = (AUTOCAST,)


def bf16_copy(name: str) -> str:
    """The argument of a kernel that also writes `name` rounded to bf16 (an update's weight
    copy, an autocast row backward's dx for the GEMMs that read it)."""
    return f"{name}_bf16"


class BadSignature(ValueError):
    """What `from_json` refuses; `key` is the field at fault."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class KernelSig:
    """One `extern "C"` kernel: its parameters in launch order, what it is, its launch."""
    name: str                          # e.g. rmsnorm_backward_bf16
    args: tuple[tuple[str, str], ...]  # (name, C type) in launch order
    dtype: str                         # one of DTYPES
    stage: str                         # the op's call: forward, backward, fwdbwd, step, decode
    geometry: Geometry                 # its launch (eulergen/launch.py)
    # which of the call's kernels, where a call launches several: a row backward's split
    # 'rows' and 'cols' and its 'reduce', attention's 'rowdot', 'dkv' and 'dq', the
    # embedding's 'sort', 'merge', 'wte', 'wte_long' and 'wpe'; '' the call's one kernel
    part: str = ""
    fusion: str = ""                   # the fused variant it computes ('add', 'bias'); '' the op
    control: tuple[str, ...] = ()      # update steps: the slots of the `control` argument
    precision: str = ""                # one of PRECISIONS: each operand's dtype is in `args`

    @property
    def c_params(self) -> str:
        """The C parameter list the template prints: the one place it is spelled out."""
        return _c_params(self.args)

    @property
    def call_args(self) -> str:
        """The parameters' names, as an entry point passes them on to its device impl."""
        return ", ".join(name for name, _ in self.args)

    def to_json(self) -> dict:
        """The manifest's entry (its name is the key): empty part, fusion, precision and
        control left out."""
        data = {"args": [list(a) for a in self.args], "dtype": self.dtype, "stage": self.stage}
        data.update((k, getattr(self, k)) for k in ("part", "fusion", "precision")
                    if getattr(self, k))
        data["geometry"] = self.geometry.to_json()
        if self.control:
            data["control"] = list(self.control)
        return data

    @classmethod
    def from_json(cls, name: str, data) -> KernelSig:
        """The value `to_json` wrote; BadSignature names the field at fault."""
        if not isinstance(data, dict):
            raise BadSignature("", "should be an object")
        unknown = sorted(set(data) - {"args", "dtype", "stage", "part", "fusion", "precision",
                                      "geometry", "control"})
        if unknown:
            raise BadSignature(unknown[0], "unknown key")
        args = _args(data)
        if data.get("dtype") not in DTYPES:
            raise BadSignature("dtype", f"dtype {data.get('dtype')!r} should be one of "
                                        f"{', '.join(DTYPES)}")
        if "stage" not in data:
            raise BadSignature("stage", "missing key 'stage'")
        words = {key: data.get(key, "") for key in ("stage", "part", "fusion", "precision")}
        for key, word in words.items():
            if not isinstance(word, str):
                raise BadSignature(key, f"{key} should be a string")
        if words["precision"] and words["precision"] not in PRECISIONS:
            raise BadSignature("precision", f"precision {words['precision']!r} should be one "
                                            f"of {', '.join(PRECISIONS)}")
        control = data.get("control", [])
        if not (isinstance(control, list) and all(isinstance(c, str) for c in control)):
            raise BadSignature("control", "control should be a list of slot names")
        try:
            geometry = geometry_from_json(data.get("geometry"))
        except (ValueError, TypeError) as err:
            raise BadSignature("geometry", str(err)) from None
        return cls(name, args, data["dtype"], geometry=geometry,
                   control=tuple(control), **words)


def _c_params(args) -> str:
    return ", ".join(f"{ctype} {name}" for name, ctype in args)


def _args(data: dict) -> tuple[tuple[str, str], ...]:
    """A signature's `args` as JSON holds them: [[name, C type], …]."""
    args = data.get("args")
    if not (isinstance(args, list) and all(
            isinstance(a, list) and len(a) == 2 and all(isinstance(s, str) for s in a)
            for a in args)):
        raise BadSignature("args", "args should be [[name, C type], …]")
    return tuple((a, t) for a, t in args)


def select(kernels, stage: str, dtype: str | None = None, *, part: str = "", fusion: str = "",
           precision: str = "", **geometry) -> list[KernelSig]:
    """The kernels among `kernels` of one call's `part` (of the `fusion` variant, in the
    `precision` variant) in `dtype` (None: any), whose geometry has the given field values,
    in their order."""
    return [k for k in kernels
            if (k.stage, k.part, k.fusion, k.precision) == (stage, part, fusion, precision)
            and (dtype is None or k.dtype == dtype)
            and all(getattr(k.geometry, f, None) == v for f, v in geometry.items())]


def variant_name(stage: str, fusion: str = "") -> str:
    """A fused variant's name for one of its stages, as its numpy function and its kernels'
    names spell it: `backward` of `add` is backward_add."""
    return f"{stage}_{fusion}" if fusion else stage


@dataclass(frozen=True)
class CFunction:
    """One C function of an op's CPU build (generated/c/<op>.c, printed from the op's
    derived expressions): its parameters in call order and the op's call it makes (`stage`,
    of the fused variant `fusion`). Written into manifest.json under the op's `c_functions`
    and read back as this value by `eulergen export-c`, which calls it by its names."""
    name: str
    args: tuple[tuple[str, str], ...]
    stage: str
    fusion: str = ""

    @property
    def c_params(self) -> str:
        return _c_params(self.args)

    def to_json(self) -> dict:
        data = {"args": [list(a) for a in self.args], "stage": self.stage}
        if self.fusion:
            data["fusion"] = self.fusion
        return data

    @classmethod
    def from_json(cls, name: str, data) -> CFunction:
        if not isinstance(data, dict):
            raise BadSignature("", "should be an object")
        unknown = sorted(set(data) - {"args", "stage", "fusion"})
        if unknown:
            raise BadSignature(unknown[0], "unknown key")
        args = _args(data)
        stage, fusion = data.get("stage"), data.get("fusion", "")
        if not isinstance(stage, str) or not isinstance(fusion, str):
            raise BadSignature("stage", "stage and fusion should be strings")
        return cls(name, args, stage, fusion)
