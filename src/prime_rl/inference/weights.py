"""Checks on a weight directory before the server loads it: the server must never be left half-updated.

Everything here reads safetensors headers only (no tensor data), so a check costs milliseconds.
"""

from pathlib import Path

from safetensors import safe_open


class WeightDirError(Exception):
    """A weight directory the server refuses; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def safetensors_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape over every `*.safetensors` file in `model_dir` (headers only)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except Exception as e:  # safetensors raises several types for a corrupt header
            raise WeightDirError(422, f"{file} is not a readable safetensors file: {e}") from None
    return shapes


def is_under(path: Path, roots: list[Path]) -> bool:
    """True if `path` (symlinks resolved) lies inside one of `roots`."""
    resolved = path.resolve()
    return any(resolved.is_relative_to(Path(root).resolve()) for root in roots)


def check_weight_dir(weight_dir: str, roots: list[Path], expected: dict[str, tuple[int, ...]]) -> Path:
    """Validate a `/update_weights` target; returns its resolved path or raises `WeightDirError`.

    The root check comes first so nothing about paths outside the allowed roots is revealed.
    """
    path = Path(weight_dir).expanduser()
    if not path.is_absolute():
        raise WeightDirError(400, f"weight_dir must be an absolute path, got {weight_dir!r}")
    if not is_under(path, roots):
        allowed = ", ".join(str(r) for r in roots)
        raise WeightDirError(403, f"weight_dir {weight_dir} is outside the allowed roots ({allowed})")
    if not path.exists():
        raise WeightDirError(404, f"weight_dir {weight_dir} does not exist")
    if not path.is_dir():
        raise WeightDirError(400, f"weight_dir {weight_dir} is not a directory")
    shapes = safetensors_shapes(path)
    if not shapes:
        raise WeightDirError(422, f"weight_dir {weight_dir} holds no *.safetensors files")
    unknown = sorted(set(shapes) - set(expected))
    if unknown:
        raise WeightDirError(422, f"weight_dir has tensors the served model does not: {unknown[:5]}")
    missing = sorted(set(expected) - set(shapes))
    if missing:
        raise WeightDirError(422, f"weight_dir lacks tensors of the served model: {missing[:5]}")
    wrong = [f"{n}: {shapes[n]} != {expected[n]}" for n in sorted(shapes) if shapes[n] != expected[n]]
    if wrong:
        raise WeightDirError(422, f"weight_dir tensor shapes differ from the served model: {wrong[:5]}")
    return path.resolve()
