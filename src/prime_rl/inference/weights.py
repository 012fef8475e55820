"""Checks on a weight directory before the server loads it: the server must never be left half-updated.

Everything here reads safetensors headers only (no tensor data), so a check costs milliseconds.
"""

from pathlib import Path
from typing import NamedTuple

from safetensors import safe_open

ECHO_CHARS = 200
"""Error messages quote at most this many characters of any one value taken from a request or a file."""

# Float dtypes the loader converts into the served dtype by value (the trainer may publish any of them).
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})


class WeightDirError(Exception):
    """A weight directory the server refuses; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class TensorSpec(NamedTuple):
    dtype: str
    """safetensors header dtype: "BF16", "F32", "I32", ..."""
    shape: tuple[int, ...]


def clip(value: object, limit: int = ECHO_CHARS) -> str:
    """`str(value)` cut to `limit` characters, so an error reply never echoes unbounded input."""
    text = str(value)
    return text if len(text) <= limit else f"{text[:limit]}...({len(text)} chars)"


def safetensors_specs(model_dir: Path) -> dict[str, TensorSpec]:
    """Tensor name -> (dtype, shape) over every `*.safetensors` file in `model_dir` (headers only).

    A name stored in two files is refused: vLLM would load it twice, which its layerwise reload counts as
    a complete layer before the layer's other tensors arrived.
    """
    specs: dict[str, TensorSpec] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        for name, spec in file_specs(file).items():
            if name in specs:
                raise WeightDirError(422, f"tensor {clip(name)} is stored twice (again in {file.name})")
            specs[name] = spec
    return specs


def file_specs(file: Path) -> dict[str, TensorSpec]:
    """Tensor name -> (dtype, shape) of one safetensors file (its header only); 422 if it is not readable."""
    try:
        with safe_open(str(file), framework="pt") as f:
            specs = {}
            for name in f.keys():
                sliced = f.get_slice(name)
                specs[name] = TensorSpec(sliced.get_dtype(), tuple(sliced.get_shape()))
            return specs
    except Exception as e:  # safetensors raises several types for a corrupt or truncated file
        raise WeightDirError(422, f"{clip(file)} is not a readable safetensors file: {clip(e)}") from None


def safetensors_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape over every `*.safetensors` file in `model_dir` (headers only)."""
    return {name: spec.shape for name, spec in safetensors_specs(model_dir).items()}


def is_under(path: Path, roots: list[Path]) -> bool:
    """True if `path` (symlinks resolved) lies inside one of `roots`."""
    resolved = path.resolve()
    return any(resolved.is_relative_to(Path(root).resolve()) for root in roots)


def dtypes_compatible(got: str, expected: str) -> bool:
    """Same dtype, or two float dtypes (loaded by value conversion); an int32 tensor for a bf16 weight is not."""
    return got == expected or (got in FLOAT_DTYPES and expected in FLOAT_DTYPES)


def check_weight_dir(weight_dir: str, roots: list[Path], expected: dict[str, TensorSpec]) -> Path:
    """Validate a `/update_weights` target; returns its resolved path or raises `WeightDirError`."""
    shown = clip(weight_dir)
    path = checked_dir(weight_dir, roots, "weight_dir")
    try:
        specs = safetensors_specs(path)
    except OSError as e:
        raise WeightDirError(
            400, f"weight_dir {shown} is not a usable path ({e.strerror or type(e).__name__})"
        ) from None
    if not specs:
        raise WeightDirError(422, f"weight_dir {shown} holds no *.safetensors files")
    problem = spec_problem(specs, expected, "weight_dir")
    if problem is not None:
        raise WeightDirError(422, problem)
    return path


def checked_dir(value: str, roots: list[Path], field: str) -> Path:
    """`value` resolved, if it is an existing directory under one of `roots`; else `WeightDirError`.

    The root check comes first so nothing about paths outside the allowed roots is revealed. A path the
    file system cannot even look up (a component over NAME_MAX, a NUL byte, a symlink loop) is a 400, not
    an exception escaping to a 500. `field` names the request field in messages.
    """
    shown = clip(value)
    try:
        path = Path(value)
        if not path.is_absolute():
            raise WeightDirError(400, f"{field} must be an absolute path, got {shown!r}")
        if not is_under(path, roots):
            allowed = ", ".join(str(r) for r in roots)
            raise WeightDirError(403, f"{field} {shown} is outside the allowed roots ({allowed})")
        if not path.exists():
            raise WeightDirError(404, f"{field} {shown} does not exist")
        if not path.is_dir():
            raise WeightDirError(400, f"{field} {shown} is not a directory")
        return path.resolve()
    except (OSError, ValueError, RuntimeError) as e:  # ENAMETOOLONG, "embedded null byte", "Symlink loop"
        reason = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise WeightDirError(400, f"{field} {shown} is not a usable path ({reason})") from None


def spec_problem(specs: dict[str, TensorSpec], expected: dict[str, TensorSpec], what: str) -> str | None:
    """Why tensors with `specs` cannot replace the served model's (`expected`), or None: the same names, shapes and
    float-compatible dtypes. `what` names the source in the message."""
    unknown = sorted(set(specs) - set(expected))
    if unknown:
        return f"{what} has tensors the served model does not: {names(unknown)}"
    missing = sorted(set(expected) - set(specs))
    if missing:
        return f"{what} lacks tensors of the served model: {names(missing)}"
    wrong = [
        f"{n}: {specs[n].shape} != {expected[n].shape}" for n in sorted(specs) if specs[n].shape != expected[n].shape
    ]
    if wrong:
        return f"{what} tensor shapes differ from the served model: {names(wrong)}"
    wrong = [
        f"{n}: {specs[n].dtype} != {expected[n].dtype}"
        for n in sorted(specs)
        if not dtypes_compatible(specs[n].dtype, expected[n].dtype)
    ]
    if wrong:
        return f"{what} tensor dtypes differ from the served model: {names(wrong)}"
    return None


TORCH_TO_SAFETENSORS = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def header_problem(header, expected: dict) -> str | None:
    """`spec_problem` for a broadcast's header (`weight_broadcast.Header`); `expected` as sent over RPC (lists)."""
    dtype = TORCH_TO_SAFETENSORS.get(header.dtype, header.dtype)
    specs = {name: TensorSpec(dtype, tuple(shape)) for name, shape in header.specs().items()}
    served = {name: TensorSpec(d, tuple(shape)) for name, (d, shape) in expected.items()}
    return spec_problem(specs, served, "the broadcast")


def names(items: list[str], count: int = 5) -> str:
    """The first `count` items, each clipped, for an error message."""
    shown = ", ".join(clip(x, 120) for x in items[:count])
    return shown + (f" (+{len(items) - count} more)" if len(items) > count else "")
