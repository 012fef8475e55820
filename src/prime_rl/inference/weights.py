"""Checks on a weight directory before the server loads it: the server must never be left half-updated.

The shape checks read safetensors headers only (milliseconds); the finiteness check (`nonfinite_tensor`) reads every
tensor, streamed a bounded chunk at a time: a NaN or inf in the weights would be served (and a request's non-finite
activations could reach other requests, see `finite_kv`), so it is refused (422, naming the tensor) before anything
pauses. It sums each chunk (a finite sum proves every value finite; only a non-finite one is looked at element by
element): ~20 GB/s from the page cache on one core here, 22 ms for a 135M-parameter float32 model (538 MB), 1 ms
for the demo's 0.69M, next to milliseconds for the headers; from disk it reads at the disk's speed, and vLLM's load
right after then reads the same pages from the cache.

Allowed roots: a directory given by a request must resolve inside them, and so must every file in it that vLLM will
read (a directory inside the roots may hold symlinks to files elsewhere). A file that resolves outside is refused
unopened, and so is a hard link (a file with more than one name, whose other names may lie outside the roots: the
roots are a rule about names, which a hard link escapes). Replies name only the file, not where it leads, and no reply
quotes a value read from a file (a config value, a pattern, a parser's message about the contents): they name the
key and what is accepted. Names are the exception, clipped: of tensors (with their shapes and dtypes) and of the files
an index lists, as saying which one is wrong is the point.
What the checks read is the file they checked (`open_in_roots`). vLLM reads the directory again afterwards, by path:
someone who can write inside the roots can still swap a file for a symlink in the moment between the check and vLLM's
read. Closing that would need a private copy of every file checked, made before vLLM reads it; writing inside the
roots is the trust this server gives the trainer that publishes there.
"""

import errno
import glob
import json
import math
import os
import re
import stat
from collections.abc import Iterator
from contextlib import closing, contextmanager
from fnmatch import fnmatch
from pathlib import Path
from typing import NamedTuple

from safetensors import safe_open

ECHO_CHARS = 200
"""Error messages quote at most this many characters of any one value taken from a request or a file."""

# Float dtypes the loader converts into the served dtype by value (the trainer may publish any of them).
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
MAX_JSON_BYTES = 16 << 20
"""The largest JSON file (adapter_config.json, a safetensors index) the checks read."""
SCAN_CHUNK_BYTES = 64 << 20
"""The most tensor data `nonfinite_tensor` holds at once (a tensor is read in chunks of whole rows)."""
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


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


def safetensors_specs(
    model_dir: Path, roots: list[Path] | None = None, shown: str | None = None
) -> dict[str, TensorSpec]:
    """Tensor name -> (dtype, shape) over the safetensors files vLLM loads from `model_dir` (headers only).

    `roots`: every file read (each safetensors file, the index that selects them) must resolve inside them (403);
    None for the served model's own directory, which is not a request's. `shown`: how messages name the directory.
    A name stored in two files is refused: vLLM would load it twice, which its layerwise reload counts as
    a complete layer before the layer's other tensors arrived.
    """
    shown = shown if shown is not None else clip(str(model_dir))
    specs: dict[str, TensorSpec] = {}
    with closing(opened_weight_files(model_dir, roots, shown)) as files:
        for name, path in files:
            for tensor, spec in file_specs(path, f"{shown}: {clip(name)}").items():
                if tensor in specs:
                    raise WeightDirError(422, f"tensor {clip(tensor)} is stored twice (again in {clip(name)})")
                specs[tensor] = spec
    return specs


def opened_weight_files(model_dir: Path, roots: list[Path] | None, shown: str) -> Iterator[tuple[str, str]]:
    """(file name, a path that reads the opened file) for each safetensors file vLLM loads from `model_dir`, the index
    that selects them read first; each file is opened by `open_in_roots` and stays open until the next is asked for
    (close the generator when stopping early)."""
    folder = str(model_dir)
    files, index_name = weight_files(folder)
    if files:
        with open_in_roots(Path(folder) / index_name, roots, shown) as index:
            if index is not None:
                files = indexed_files(files, read_json(index, shown, index_name), folder, shown, index_name)
    for file in files:
        name = os.path.basename(file)
        with open_in_roots(Path(file), roots, shown) as path:
            if path is None:
                raise WeightDirError(422, f"{shown}: {clip(name)} is not a readable file")
            yield name, path


def nonfinite_problem(model_dir: Path, roots: list[Path] | None, shown: str) -> str | None:
    """Which tensor of the weights in `model_dir` holds a NaN or an infinity, or None: every tensor is read
    (`nonfinite_tensor`), the files through the same checks as their headers were."""
    with closing(opened_weight_files(model_dir, roots, shown)) as files:
        for name, path in files:
            try:
                tensor = nonfinite_tensor(path)
            except WeightDirError as e:
                return f"{shown}: {clip(name)} has {e.message}"
            if tensor is not None:
                return f"{shown}: tensor {clip(tensor, 120)} (in {clip(name)}) has non-finite values (NaN or inf)"
    return None


def weight_files(folder: str) -> tuple[list[str], str]:
    """The safetensors files vLLM 0.32's default loader (load format "auto") reads from the local directory `folder`,
    before the index filters them, and the name of that index: its own `glob` (names starting with a dot are not
    matched), Mistral's `consolidated*.safetensors` instead when the tree holds one."""
    mistral = any(fnmatch(f.name, "consolidated*.safetensors") and f.is_file() for f in Path(folder).rglob("*"))
    pattern = "consolidated*.safetensors" if mistral else "*.safetensors"
    index = "consolidated.safetensors.index.json" if mistral else "model.safetensors.index.json"
    return sorted(glob.glob(os.path.join(folder, pattern))), index


def indexed_files(files: list[str], index: object, folder: str, shown: str, index_name: str) -> list[str]:
    """`files` that the safetensors index's weight_map names, as vLLM keeps them; 422 where vLLM would fail."""
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise WeightDirError(422, f"{shown}: {index_name} has no weight_map of tensor names to file names")
    listed = {os.path.join(folder, v) for v in weight_map.values()}
    missing = sorted(os.path.relpath(f, folder) for f in listed - set(files))
    if missing:
        raise WeightDirError(422, f"{shown}: {index_name} names files it does not hold: {names(missing)}")
    return [f for f in files if f in listed]


def file_specs(file: Path | str, shown: str | None = None) -> dict[str, TensorSpec]:
    """Tensor name -> (dtype, shape) of one safetensors file (its header only); 422 if it is not readable. `shown`:
    how messages name the file."""
    try:
        with safe_open(str(file), framework="pt") as f:
            specs = {}
            for name in f.keys():
                sliced = f.get_slice(name)
                specs[name] = TensorSpec(sliced.get_dtype(), tuple(sliced.get_shape()))
            return specs
    except Exception as e:  # safetensors raises several types for a corrupt or truncated file
        shown = shown if shown is not None else clip(file)
        raise WeightDirError(422, f"{shown} is not a readable safetensors file: {parser_reason(e)}") from None


def parser_reason(error: Exception) -> str:
    """A parser's message about a file, without what it quotes of the contents (serde and json quote the offending
    value: "unknown variant `...`"); the error's type where nothing is left."""
    words = re.match(r"[^`'\"]*", str(error)).group(0).strip(" :,")
    return clip(words, 120) if words else type(error).__name__


def nonfinite_tensor(file: str) -> str | None:
    """The name of the first float tensor in the safetensors `file` holding a NaN or an infinity, or None; reads every
    float tensor, `SCAN_CHUNK_BYTES` of whole rows at a time (a file of any size in bounded memory). `WeightDirError`
    (422) if the data is unreadable (a truncated file)."""
    import torch

    try:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                sliced = f.get_slice(name)
                dtype = sliced.get_dtype()
                if dtype not in DTYPE_BYTES:  # integers and bools have no NaN; a float8 is refused as no float dtype
                    continue
                shape = sliced.get_shape()
                if not shape:
                    chunks = [f.get_tensor(name)]
                else:
                    row = math.prod(shape[1:]) * DTYPE_BYTES[dtype]
                    rows = max(1, SCAN_CHUNK_BYTES // max(row, 1))
                    chunks = (sliced[start : start + rows] for start in range(0, shape[0], rows))
                for chunk in chunks:
                    if not all_finite(chunk, torch):
                        return name
    except Exception as e:
        raise WeightDirError(422, f"tensor data that cannot be read ({parser_reason(e)})") from None
    return None


def all_finite(tensor, torch) -> bool:
    """No NaN or infinity in `tensor`. A non-finite element makes the sum NaN or inf, so a finite sum (one pass, no
    mask) proves every element finite; a non-finite one (or finite values that overflowed the sum) is settled exactly."""
    return math.isfinite(tensor.sum().item()) or bool(torch.isfinite(tensor).all())


def read_json(file: str, shown: str, name: str) -> object:
    """The JSON value in `file` (a path `open_in_roots` gave); 422 if it is not readable JSON."""
    try:
        with open(file, "rb") as f:
            data = f.read(MAX_JSON_BYTES + 1)
        if len(data) > MAX_JSON_BYTES:
            raise ValueError(f"over {MAX_JSON_BYTES} bytes")
        return json.loads(data)
    except (ValueError, RecursionError, OSError) as e:
        raise WeightDirError(422, f"{shown}: {clip(name)} is not readable JSON ({parser_reason(e)})") from None


def safetensors_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape over every `*.safetensors` file in `model_dir` (headers only)."""
    return {name: spec.shape for name, spec in safetensors_specs(model_dir).items()}


def is_under(path: Path, roots: list[Path]) -> bool:
    """True if `path` (symlinks resolved) lies inside one of `roots`."""
    return within(path.resolve(), roots)


def within(resolved: str | Path, roots: list[Path]) -> bool:
    """True if the already resolved path `resolved` lies inside one of `roots`."""
    return any(Path(resolved).is_relative_to(Path(root).resolve()) for root in roots)


def resolve(path: Path | str) -> str:
    """`path` with every symlink resolved (`os.path.realpath`; tests stand in for it to act out a swap)."""
    return os.path.realpath(path)


@contextmanager
def open_in_roots(entry: Path, roots: list[Path] | None, shown: str) -> Iterator[str | None]:
    """Opens the file `entry` names for the caller to read, if it resolves inside `roots`; yields a path that reads
    exactly the opened file (`/proc/self/fd/N` on Linux), or None when `entry` is not a regular file (missing, a
    directory, a dangling link). `roots` None: not checked (the served model's own directory).

    `entry` is resolved first, and a file that resolves outside the roots is refused (403) without being opened and
    without naming where it leads. The file is then opened without following a last symlink, never blocking (a FIFO),
    and the kernel's path of the open file is checked again, so a link swapped into the path in between is caught.
    A hard link (a regular file with more than one name) is refused unread, 403 as well: its other names may lie
    outside the roots, and which is the "real" one cannot be told; a copy is accepted.
    `shown`: how messages name the directory. See the module docstring for the race this leaves (vLLM's own read).
    """
    outside = WeightDirError(403, f"{shown}: {clip(entry.name)} resolves outside the allowed roots")
    try:
        real = resolve(entry)
    except (OSError, ValueError, RuntimeError) as e:
        raise WeightDirError(400, f"{shown}: {clip(entry.name)} is not a usable path ({type(e).__name__})") from None
    if roots is not None and not within(real, roots):
        raise outside
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(real, flags)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            yield None
            return
        raise WeightDirError(422, f"{shown}: {clip(entry.name)} cannot be opened ({e.strerror})") from None
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            yield None
            return
        if roots is not None and status.st_nlink > 1:
            raise WeightDirError(
                403,
                f"{shown}: {clip(entry.name)} is a hard link ({status.st_nlink} names), refused as a file that may "
                "lie outside the allowed roots: give a copy",
            )
        path = real
        try:
            opened = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # no /proc: the resolved path is what there is
            opened = None
        else:
            path = f"/proc/self/fd/{fd}"
        if roots is not None and opened is not None and not within(opened.removesuffix(" (deleted)"), roots):
            raise outside
        yield path
    finally:
        os.close(fd)


def dtypes_compatible(got: str, expected: str) -> bool:
    """Same dtype, or two float dtypes (loaded by value conversion); an int32 tensor for a bf16 weight is not."""
    return got == expected or (got in FLOAT_DTYPES and expected in FLOAT_DTYPES)


def check_weight_dir(weight_dir: str, roots: list[Path], expected: dict[str, TensorSpec]) -> Path:
    """Validate a `/update_weights` target; returns its resolved path or raises `WeightDirError`. The directory and
    every file vLLM will read from it must resolve inside `roots`, its tensors fit the served model's, and every
    value must be finite (read in full, streamed: the module docstring has the cost)."""
    shown = clip(weight_dir)
    path = checked_dir(weight_dir, roots, "weight_dir")
    try:
        specs = safetensors_specs(path, roots, f"weight_dir {shown}")
        if not specs:
            raise WeightDirError(422, f"weight_dir {shown} holds no *.safetensors files")
        problem = spec_problem(specs, expected, "weight_dir")
        if problem is None:  # only weights that fit are read in full
            problem = nonfinite_problem(path, roots, f"weight_dir {shown}")
    except OSError as e:
        raise WeightDirError(
            400, f"weight_dir {shown} is not a usable path ({e.strerror or type(e).__name__})"
        ) from None
    if problem is not None:
        raise WeightDirError(422, problem)
    return path


def checked_dir(value: str, roots: list[Path], field: str) -> Path:
    """`value` resolved, if it is an existing directory under one of `roots`; else `WeightDirError`.

    The root check comes first so nothing about paths outside the allowed roots is revealed. Only the directory is
    checked here: the files in it that are read must each pass `open_in_roots` too. A path the
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
    """Why a broadcast's header (`weight_broadcast.Header`) cannot be received: the trainer's own refusal (its policy
    holds a NaN or an infinity: `Header.refused`), else `spec_problem`; `expected` as sent over RPC (lists)."""
    if getattr(header, "refused", None):
        return f"the trainer sends no weights: {clip(header.refused, 1000)}"
    dtype = TORCH_TO_SAFETENSORS.get(header.dtype, header.dtype)
    specs = {name: TensorSpec(dtype, tuple(shape)) for name, shape in header.specs().items()}
    served = {name: TensorSpec(d, tuple(shape)) for name, (d, shape) in expected.items()}
    return spec_problem(specs, served, "the broadcast")


def names(items: list[str], count: int = 5, limit: int = 120) -> str:
    """The first `count` items, each clipped to `limit` characters, for an error message."""
    shown = ", ".join(clip(x, limit) for x in items[:count])
    return shown + (f" (+{len(items) - count} more)" if len(items) > count else "")
