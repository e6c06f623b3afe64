"""Reading `manifest.json` (docs/internals.md, "Manifest") and the numpy modules it names.

The runtime knows ops only through a manifest: the built-in one in generated/ and those
of user ops built into `$EULERGEN_CACHE/ops/<hash>/`. Paths inside a manifest are
relative to its folder. Everything here is read once and then frozen."""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from eulergen import GENERATED_DIR
from eulergen.errors import EulerError
from eulergen.signature import BadSignature, CFunction, KernelSig, select

FORMAT = 3
BUILTIN_MANIFEST = GENERATED_DIR / "manifest.json"


@dataclass(frozen=True)
class Operand:
    name: str
    role: str
    differentiable: bool = True


@dataclass(frozen=True)
class Operands:
    """The operands of one side of a fused variant (generator/fuse.py), in call order."""
    inputs: tuple[Operand, ...]
    outputs: tuple[Operand, ...]

    @property
    def grads(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.inputs if o.differentiable)


@dataclass(frozen=True)
class Fusion:
    """A fused variant of an op (the manifest's `fusions`): its forward takes `forward`'s
    inputs and writes its outputs; its backward takes `backward`'s inputs and the gradients
    of its outputs, and writes the gradients of its differentiable inputs. Its kernels'
    signatures have `fusion` = its name."""
    name: str
    forward: Operands
    backward: Operands


@dataclass(frozen=True)
class MatrixStep:
    """An update op's matrix step (the manifest's `matrix`, generator/ir.py's MatrixStep):
    the work input it orthogonalises per 2-D parameter, its Newton-Schulz steps and
    coefficients (a, b, c) and the eps of the norm it divides by first (the parameters it
    does not take are its op's `rest` op's)."""
    orthogonalize: str
    steps: int
    coefficients: tuple[float, float, float]
    eps: float


@dataclass(frozen=True)
class OpEntry:
    name: str
    kind: str
    spec: str                            # the spec file, as the manifest names it
    spec_sha256: str
    inputs: tuple[Operand, ...]
    outputs: tuple[Operand, ...]
    params: dict = field(hash=False)     # name -> default (None: must be given at call)
    numpy: Path | None = None            # absolute path of the numpy module
    cuda: Path | None = None             # absolute path of the .cu file
    cuda_sha256: str = ""
    kernels: dict = field(default_factory=dict, hash=False)  # name -> KernelSig
    manifest: Path = Path()
    fast_math: bool = False              # the spec opted in (`fast_math: true`)
    template: str = ""                   # templates/<x>.cu.j2, where the manifest names it
    index: dict = field(default_factory=dict, hash=False)   # pair ops: index symbol -> role
    fusions: dict = field(default_factory=dict, hash=False)  # name -> Fusion
    matrix: MatrixStep | None = None     # update ops with a matrix step (muon)
    rest: str | None = None              # update ops: the op of the parameters that are no
                                         # Linear weight (None: this one steps them too)
    c: Path | None = None                # absolute path of its C functions (None: no C printer)
    c_train: Path | None = None          # ... of those only training calls (None: none)
    c_functions: dict = field(default_factory=dict, hash=False)  # name -> CFunction

    @property
    def grads(self) -> tuple[str, ...]:
        """Names of the inputs that get a gradient, in input order (the module's GRADS)."""
        return tuple(o.name for o in self.inputs if o.differentiable)

    def kernel(self, stage: str, dtype: str, *, part: str = "", fusion: str = "",
               precision: str = "", **geometry) -> KernelSig:
        """The first kernel of one call's `part` (of the `fusion` variant, in the `precision`
        variant) in `dtype` whose geometry has the given fields (signature.select), or
        EulerError naming those there are."""
        found = select(self.kernels.values(), stage, dtype, part=part, fusion=fusion,
                       precision=precision, **geometry)
        if found:
            return found[0]
        what = "/".join(w for w in (stage, part, fusion, precision) if w)
        have = sorted({"/".join(w for w in (k.stage, k.part, k.fusion, k.precision, k.dtype) if w)
                       for k in self.kernels.values()}) or ["none"]
        given = "".join(f", {f}={v!r}" for f, v in geometry.items())
        raise EulerError(f"no {what} kernel for dtype {dtype}{given} (have: {', '.join(have)})",
                         file=str(self.manifest), key=f"ops.{self.name}.kernels")

    def c_function(self, stage: str, fusion: str = "") -> CFunction:
        """Its C function of one call (of the `fusion` variant), for `eulergen export-c`."""
        for fn in self.c_functions.values():
            if (fn.stage, fn.fusion) == (stage, fusion):
                return fn
        what = "/".join(w for w in (stage, fusion) if w)
        raise EulerError(f"no C function for {what} (its kind has no C printer, or a build "
                         "older than it: run `eulergen build`)", file=str(self.manifest),
                         key=f"ops.{self.name}.c_functions")


@dataclass(frozen=True)
class Manifest:
    path: Path
    generator: str
    ops: dict = field(hash=False)        # name -> OpEntry


def _need(obj, key: str, typ, file: Path, where: str):
    if not isinstance(obj, dict) or key not in obj:
        raise EulerError(f"missing key {key!r}", file=str(file), key=where)
    value = obj[key]
    if not isinstance(value, typ):
        raise EulerError(f"{key!r} should be {typ.__name__ if isinstance(typ, type) else typ}, "
                         f"got {type(value).__name__}", file=str(file), key=f"{where}.{key}")
    return value


def _operands(items, file: Path, where: str) -> tuple[Operand, ...]:
    if not isinstance(items, list):
        raise EulerError("should be a list of {name, role}", file=str(file), key=where)
    out = []
    for n, item in enumerate(items):
        w = f"{where}[{n}]"
        out.append(Operand(_need(item, "name", str, file, w), _need(item, "role", str, file, w),
                           bool(item.get("differentiable", True))))
    return tuple(out)


def _signature(cls, name: str, data, file: Path, where: str):
    """A KernelSig or CFunction as the manifest holds it."""
    try:
        return cls.from_json(name, data)
    except BadSignature as err:
        raise EulerError(f"{err} (rebuild with `eulergen build`)", file=str(file),
                         key=f"{where}.{err.key}" if err.key else where) from None


def _fusions(items, file: Path, where: str) -> dict[str, Fusion]:
    if not isinstance(items, dict):
        raise EulerError("should be an object name -> {forward, backward}", file=str(file),
                         key=where)
    out = {}
    for name, f in items.items():
        sides = [Operands(_operands(_need(side, "inputs", list, file, f"{where}.{name}.{s}"),
                                    file, f"{where}.{name}.{s}.inputs"),
                          _operands(_need(side, "outputs", list, file, f"{where}.{name}.{s}"),
                                    file, f"{where}.{name}.{s}.outputs"))
                 for s in ("forward", "backward")
                 for side in (_need(f, s, dict, file, f"{where}.{name}"),)]
        out[name] = Fusion(name, *sides)
    return out


def _matrix(m, file: Path, where: str) -> MatrixStep | None:
    if m is None:
        return None
    coefficients = _need(m, "coefficients", list, file, where)
    if len(coefficients) != 3 or not all(isinstance(c, (int, float)) for c in coefficients):
        raise EulerError("coefficients should be three numbers a, b, c", file=str(file),
                         key=f"{where}.coefficients")
    return MatrixStep(_need(m, "orthogonalize", str, file, where),
                      _need(m, "steps", int, file, where),
                      tuple(float(c) for c in coefficients),
                      float(_need(m, "eps", (int, float), file, where)))


def _rest(o, file: Path, where: str) -> str | None:
    """An update op's rest op: required with a matrix step (it steps no vector)."""
    if "rest" not in o:
        if o.get("matrix") is not None:
            raise EulerError("an op with a matrix step needs 'rest' (the update op of the "
                             "parameters that are no matrices; rebuild with `eulergen build`)",
                             file=str(file), key=where)
        return None
    return _need(o, "rest", str, file, where)


def _op(name: str, o, folder: Path, file: Path) -> OpEntry:
    where = f"ops.{name}"
    kind = _need(o, "kind", str, file, where)
    params = o.get("params") or {}
    if not isinstance(params, dict):
        raise EulerError("params should be an object name -> default", file=str(file),
                         key=f"{where}.params")
    index = o.get("index") or {}
    if not isinstance(index, dict) or not all(isinstance(r, str) for r in index.values()):
        raise EulerError("index should be an object symbol -> role", file=str(file),
                         key=f"{where}.index")
    kernels = o.get("kernels") or {}
    if not isinstance(kernels, dict):
        raise EulerError("kernels should be an object name -> kernel", file=str(file),
                         key=f"{where}.kernels")
    c_functions = o.get("c_functions") or {}
    if not isinstance(c_functions, dict):
        raise EulerError("c_functions should be an object name -> function", file=str(file),
                         key=f"{where}.c_functions")
    return OpEntry(
        name=name, kind=kind, spec=str(o.get("spec", "")), spec_sha256=str(o.get("spec_sha256", "")),
        inputs=_operands(o.get("inputs"), file, f"{where}.inputs"),
        outputs=_operands(o.get("outputs"), file, f"{where}.outputs"),
        params=dict(params),
        numpy=(folder / o["numpy"]) if o.get("numpy") else None,
        cuda=(folder / o["cuda"]) if o.get("cuda") else None,
        cuda_sha256=str(o.get("cuda_sha256", "")),
        kernels={kn: _signature(KernelSig, kn, k, file, f"{where}.kernels.{kn}")
                 for kn, k in kernels.items()},
        manifest=file, fast_math=bool(o.get("fast_math", False)),
        template=str(o.get("template", "")), index=dict(index),
        fusions=_fusions(o.get("fusions") or {}, file, f"{where}.fusions"),
        matrix=_matrix(o.get("matrix"), file, f"{where}.matrix"),
        rest=_rest(o, file, where),
        c=(folder / o["c"]) if o.get("c") else None,
        c_train=(folder / o["c_train"]) if o.get("c_train") else None,
        c_functions={n: _signature(CFunction, n, f, file, f"{where}.c_functions.{n}")
                     for n, f in c_functions.items()})


def load_manifest(path: str | Path) -> Manifest:
    """Parse and check one manifest.json; EulerError names the file and key at fault."""
    file = Path(path).resolve()
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        raise EulerError("manifest not found (run `eulergen build`)", file=str(path)) from None
    except json.JSONDecodeError as err:
        raise EulerError(f"not valid JSON: {err.msg}", file=str(path), line=err.lineno) from None
    fmt = _need(data, "format", int, file, "manifest")
    if fmt != FORMAT:
        raise EulerError(f"manifest format {fmt}, this runtime reads {FORMAT} "
                         "(rebuild with `eulergen build`)", file=str(file), key="format")
    ops = _need(data, "ops", dict, file, "manifest")
    return Manifest(file, str(data.get("generator", "")),
                    {name: _op(name, o, file.parent, file) for name, o in ops.items()})


_MODULES: dict[tuple[Path, float], ModuleType] = {}


def load_numpy_module(op: OpEntry) -> ModuleType:
    """Import an op's generated numpy module by file path (once per file version).

    The modules are not a package: they live in generated/ or a cache folder, so they are
    loaded from their path under a private name that cannot shadow a real module."""
    if op.numpy is None:
        raise EulerError("op has no numpy module", file=str(op.manifest), key=f"ops.{op.name}.numpy")
    try:
        key = (op.numpy, op.numpy.stat().st_mtime)
    except FileNotFoundError:
        raise EulerError(f"numpy module {op.numpy} is missing (run `eulergen build`)",
                         file=str(op.manifest), key=f"ops.{op.name}.numpy") from None
    if key not in _MODULES:
        spec = importlib.util.spec_from_file_location(
            f"eulergen._generated_numpy.{op.name}_{op.spec_sha256[:12] or 'user'}", op.numpy)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        names = tuple(getattr(module, "INPUTS", ()))
        if names and names != tuple(o.name for o in op.inputs):
            raise EulerError(f"numpy module inputs {names} disagree with the manifest "
                             "(stale build: run `eulergen build`)", file=str(op.numpy), key="INPUTS")
        _MODULES[key] = module
    return _MODULES[key]
