"""Turn argv (+ TOML files + `PRIME_*` environment) into one validated entry-point config.

Sources, highest first:
  1. CLI flags: `--model.name X`, `--model-name X`, `--model_name=X`, `--flag` / `--no-flag`,
     lists as `--ids 0,1` or `--ids '[0, 1]'`, dicts as JSON, a bare `--ckpt` enables an optional section.
  2. TOML files given as `@ path.toml` (several allowed, deep-merged, a later file wins per key) or
     scoped to one section with `--trainer @ t.toml`. A file may include others with
     `toml_files = ["base.toml"]` (relative to itself; the including file wins).
  3. Environment variables `PRIME_MODEL__NAME=...` (`__` nests), read by pydantic-settings.
  4. Field defaults.

Every value remembers where it came from, so an error names the dotted key and its source, and
suggests the closest valid key. Errors raise `ConfigError`; entry points turn that into exit code 2.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import sys
import tomllib
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import tomli_w
from pydantic import BaseModel, SecretStr, ValidationError

from prime_rl.config.base import EntrypointConfig
from prime_rl.utils.fs import write_atomic

C = TypeVar("C", bound=BaseModel)

ENV_PREFIX = "PRIME_"
INCLUDE_KEY = "toml_files"


class ConfigError(Exception):
    """A problem with the user's config: printed as is, exit code 2."""


# ---------------------------------------------------------------------------------------------
# Schema introspection: which dotted keys exist, and what kind of value each takes.
# ---------------------------------------------------------------------------------------------


def _strip_optional(annotation: Any) -> tuple[Any, bool]:
    """`X | None` -> (X, True); anything else -> (annotation, False)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        if len(args) == 1:
            return args[0], optional
        return typing.Union[tuple(args)], optional  # noqa: UP007
    if origin is typing.Annotated:
        return _strip_optional(typing.get_args(annotation)[0])
    return annotation, False


def _model_classes(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation can hold (several for a union of sections)."""
    inner, _ = _strip_optional(annotation)
    if isinstance(inner, type) and issubclass(inner, BaseModel):
        return [inner]
    if typing.get_origin(inner) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(inner) if isinstance(a, type) and issubclass(a, BaseModel)]
    return []


@dataclass
class FieldInfo:
    """What the CLI parser needs to know about one dotted key."""

    path: tuple[str, ...]
    annotation: Any
    sections: list[type[BaseModel]] = field(default_factory=list)  # non-empty: a sub-config
    optional: bool = False

    @property
    def kind(self) -> str:
        inner, _ = _strip_optional(self.annotation)
        origin = typing.get_origin(inner)
        if self.sections:
            return "section"
        if inner is bool:
            return "bool"
        if origin in (list, tuple, set) or inner in (list, tuple, set):
            return "list"
        if origin is dict or inner is dict:
            return "dict"
        return "scalar"


def _fields_of(models: list[type[BaseModel]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for model in models:
        for name, info in model.model_fields.items():
            merged.setdefault(name, info.annotation)
    return merged


def _walk(models: list[type[BaseModel]], prefix: tuple[str, ...] = ()) -> list[FieldInfo]:
    """Every dotted key (sections and leaves) below the given models."""
    out = []
    for name, annotation in _fields_of(models).items():
        path = prefix + (name,)
        sections = _model_classes(annotation)
        _, optional = _strip_optional(annotation)
        out.append(FieldInfo(path, annotation, sections, optional))
        if sections:
            out.extend(_walk(sections, path))
    return out


def _lookup(root: type[BaseModel], path: tuple[str, ...]) -> FieldInfo | None:
    models: list[type[BaseModel]] = [root]
    info = None
    for i, name in enumerate(path):
        fields = _fields_of(models)
        if name not in fields:
            return None
        annotation = fields[name]
        sections = _model_classes(annotation)
        info = FieldInfo(path[: i + 1], annotation, sections, _strip_optional(annotation)[1])
        if i < len(path) - 1:
            if not sections:
                # Free-form keys below a dict field (e.g. environment args) are allowed.
                return FieldInfo(path, Any) if info.kind == "dict" else None
            models = sections
    return info


def _tokens(text: str) -> tuple[str, ...]:
    return tuple(t for t in re.split(r"[.\-_]", text.lower()) if t)


def resolve_key(root: type[BaseModel], raw: str) -> FieldInfo | None:
    """Map a CLI key (`model.name`, `model-name`, `max_steps`, ...) to a field; None if unknown.

    Dotted keys are matched segment by segment with `-` and `_` equivalent. Undotted keys may also
    use `-`/`_` in place of the dots (`--model-name`) when that spelling names exactly one key.
    """
    info = _lookup(root, _split(raw))
    if info is not None:
        return info
    wanted = _tokens(raw)
    matches = [f for f in _walk([root]) if tuple(t for seg in f.path for t in _tokens(seg)) == wanted]
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        options = ", ".join("--" + ".".join(m.path) for m in matches)
        raise ConfigError(f"flag --{raw} is ambiguous: use one of {options}")
    return None


def suggest(root: type[BaseModel], path: tuple[str, ...]) -> str:
    """' (did you mean `x.y`?)' for the closest valid key, or ''."""
    parent = path[:-1]
    parent_info = _lookup(root, parent) if parent else None
    models = [root] if not parent else (parent_info.sections if parent_info else [])
    names = list(_fields_of(models))
    close = difflib.get_close_matches(path[-1].replace("-", "_"), names, n=1, cutoff=0.6)
    if not close:
        dotted = ".".join(path)
        all_keys = [".".join(f.path) for f in _walk([root])]
        close = difflib.get_close_matches(dotted.replace("-", "_"), all_keys, n=1, cutoff=0.75)
        return f" (did you mean `{close[0]}`?)" if close else ""
    return f" (did you mean `{'.'.join(parent + (close[0],))}`?)"


# ---------------------------------------------------------------------------------------------
# Layers: nested dicts plus where each key came from.
# ---------------------------------------------------------------------------------------------


def deep_merge(base: dict, override: dict) -> dict:
    """Merge `override` into a copy of `base`: tables merge key by key, other values replace."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _leaf_paths(data: dict, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for key, value in data.items():
        path = prefix + (key,)
        out.append(path)
        if isinstance(value, dict):
            out.extend(_leaf_paths(value, path))
    return out


def _set_path(data: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        child = data.get(key)
        if not isinstance(child, dict):
            child = data[key] = {}
        data = child
    data[path[-1]] = value


def load_toml(path: Path, _stack: tuple[Path, ...] = ()) -> tuple[dict, dict[tuple[str, ...], str]]:
    """Read a TOML file with its `toml_files` includes; returns (data, source of every key)."""
    path = path.expanduser().resolve()
    if path in _stack:
        chain = " -> ".join(str(p) for p in _stack + (path,))
        raise ConfigError(f"config files include each other in a cycle: {chain}")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    includes = data.pop(INCLUDE_KEY, [])
    if not isinstance(includes, list) or not all(isinstance(p, str) for p in includes):
        raise ConfigError(f"`{INCLUDE_KEY}` in {path} must be a list of paths")
    merged: dict = {}
    sources: dict[tuple[str, ...], str] = {}
    for include in includes:
        inc_data, inc_sources = load_toml(path.parent / include, _stack + (path,))
        merged = deep_merge(merged, inc_data)
        sources.update(inc_sources)
    merged = deep_merge(merged, data)
    sources.update({p: str(path) for p in _leaf_paths(data)})
    return merged, sources


def _parse_cli_value(info: FieldInfo, value: str, flag: str) -> Any:
    kind = info.kind
    if info.optional and value.lower() in ("none", "null"):
        return None
    if kind == "list":
        text = value.strip()
        if text.startswith("["):
            try:
                return json.loads(text)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{flag}: not a valid JSON list: {e}") from None
        return [item.strip() for item in text.split(",") if item.strip()]
    if kind in ("dict", "section"):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{flag}: expects a JSON object, got {value!r} ({e})") from None
        if not isinstance(parsed, dict):
            raise ConfigError(f"{flag}: expects a JSON object, got {value!r}")
        return parsed
    if kind == "bool":
        lowered = value.lower()
        if lowered not in ("true", "false", "1", "0", "yes", "no"):
            raise ConfigError(f"{flag}: expects true or false, got {value!r}")
        return lowered in ("true", "1", "yes")
    return value


@dataclass
class ParsedArgs:
    """argv split into its layers."""

    toml_files: list[tuple[Path, tuple[str, ...]]] = field(default_factory=list)  # (path, scope)
    cli: dict = field(default_factory=dict)
    cli_sources: dict[tuple[str, ...], str] = field(default_factory=dict)
    passthrough: list[str] = field(default_factory=list)
    dry_run: bool = False
    help: bool = False


def _is_ours(root: type[BaseModel], raw: str) -> bool:
    """A flag that is not a key but looks like one of ours (typo in a section), not a foreign flag."""
    first = raw.split(".")[0].replace("-", "_")
    return "." in raw and first in _fields_of([root])


def parse_argv(root: type[BaseModel], argv: list[str], allow_passthrough: bool = False) -> ParsedArgs:
    """Split argv into TOML layers, our CLI values, and (optionally) flags for another program."""
    parsed = ParsedArgs()
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "@" or (arg.startswith("@") and len(arg) > 1):
            if arg == "@":
                if i + 1 >= len(argv):
                    raise ConfigError("`@` must be followed by a TOML file path")
                parsed.toml_files.append((Path(argv[i + 1]), ()))
                i += 2
            else:
                parsed.toml_files.append((Path(arg[1:]), ()))
                i += 1
            continue
        if not arg.startswith("--") or arg == "--":
            if allow_passthrough and parsed.passthrough:
                parsed.passthrough.append(arg)  # value of the previous foreign flag
                i += 1
                continue
            raise ConfigError(f"unexpected argument {arg!r}: options look like `--key value`, files like `@ file.toml`")
        raw, has_eq, inline = arg[2:].partition("=")
        if raw in ("dry-run", "dry_run"):
            parsed.dry_run = True
            i += 1
            continue
        if raw in ("help", "h"):
            parsed.help = True
            i += 1
            continue
        if not has_eq and i + 1 < len(argv) and argv[i + 1] == "@":
            # `--trainer @ t.toml`: the file's contents go under the `trainer` section.
            if i + 2 >= len(argv):
                raise ConfigError(f"--{raw} @ must be followed by a TOML file path")
            info = resolve_key(root, raw)
            if info is None or not info.sections:
                raise ConfigError(f"--{raw} @ FILE: `{raw}` is not a config section{suggest(root, _split(raw))}")
            parsed.toml_files.append((Path(argv[i + 2]), info.path))
            i += 3
            continue

        negated = False
        info = resolve_key(root, raw)
        if info is None and re.match(r"no[-_]", raw):
            candidate = resolve_key(root, raw[3:])
            if candidate is not None and (candidate.kind == "bool" or (candidate.sections and candidate.optional)):
                info, negated = candidate, True
        if info is None:
            if allow_passthrough and not _is_ours(root, raw):
                parsed.passthrough.append(arg)
                i += 1
                continue
            raise ConfigError(f"unknown option --{raw}{suggest(root, _split(raw))}")
        flag = f"--{raw}"
        i += 1
        if negated:
            if has_eq:
                raise ConfigError(f"{flag} takes no value")
            value: Any = False if info.kind == "bool" else None
        elif info.kind == "bool":
            if has_eq:
                value = _parse_cli_value(info, inline, flag)
            elif i < len(argv) and argv[i].lower() in ("true", "false"):
                value = argv[i].lower() == "true"
                i += 1
            else:
                value = True
        elif info.kind == "section" and not has_eq and (i >= len(argv) or argv[i].startswith("--") or argv[i] == "@"):
            # A bare `--ckpt` enables an optional section with its defaults (keeps values set elsewhere).
            value = {}
        else:
            if has_eq:
                text = inline
            elif i < len(argv) and not argv[i].startswith("--"):
                text = argv[i]
                i += 1
            else:
                raise ConfigError(f"{flag} needs a value")
            value = _parse_cli_value(info, text, flag)
        if isinstance(value, dict):
            existing = _get_path(parsed.cli, info.path)
            value = deep_merge(existing if isinstance(existing, dict) else {}, value)
        _set_path(parsed.cli, info.path, value)
        parsed.cli_sources[info.path] = flag
        if isinstance(value, dict):
            parsed.cli_sources.update({info.path + p: flag for p in _leaf_paths(value)})
    return parsed


def _split(raw: str) -> tuple[str, ...]:
    return tuple(seg.replace("-", "_") for seg in raw.split("."))


def _get_path(data: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data


def _env_sources() -> dict[tuple[str, ...], str]:
    out = {}
    for name in os.environ:
        if name.upper().startswith(ENV_PREFIX):
            path = tuple(part.lower() for part in name[len(ENV_PREFIX) :].split("__"))
            out[path] = f"environment variable {name}"
    return out


# ---------------------------------------------------------------------------------------------
# Validation errors, readable.
# ---------------------------------------------------------------------------------------------


def _source_of(path: tuple[str, ...], sources: dict[tuple[str, ...], str]) -> str:
    for n in range(len(path), 0, -1):
        if path[:n] in sources:
            return sources[path[:n]]
    return "defaults"


def _clean_loc(root: type[BaseModel], loc: tuple) -> tuple[str, ...]:
    """Drop pydantic's union-member tags (e.g. `AdamWConfig`) so the path reads as the user's key."""
    out: list[str] = []
    for part in loc:
        part = str(part)
        if _lookup(root, tuple(out) + (part,)) is None and _lookup(root, tuple(out)) is not None:
            if part[:1].isupper() or part in ("function-after", "function-before", "function-wrap"):
                continue
        out.append(part)
    return tuple(out)


def format_validation_error(root: type[BaseModel], error: ValidationError, sources: dict) -> str:
    lines = []
    for err in error.errors():
        path = _clean_loc(root, err["loc"])
        key = ".".join(path) or "(top level)"
        origin = _source_of(path, sources)
        if err["type"] == "extra_forbidden":
            lines.append(f"unknown key `{key}` (from {origin}){suggest(root, path)}")
        elif err["type"] == "missing":
            lines.append(f"missing required key `{key}`")
        else:
            got = err.get("input")
            shown = "" if isinstance(got, dict) else f", got {got!r}"
            lines.append(f"invalid value for `{key}` (from {origin}): {err['msg']}{shown}")
    return "invalid config:\n  " + "\n  ".join(lines)


# ---------------------------------------------------------------------------------------------
# Entry point helpers.
# ---------------------------------------------------------------------------------------------


def fill_discriminators(cls: type[BaseModel], data: dict) -> dict:
    """`--optim.lr 0.1` overrides the default optimizer's lr: give partial tables of a tagged union
    (e.g. `optim: AdamWConfig | SGDConfig`) the tag of the field's default when they do not name one."""
    for name, info in cls.model_fields.items():
        value = data.get(name)
        if not isinstance(value, dict):
            continue
        sections = _model_classes(info.annotation)
        default = info.get_default(call_default_factory=True)
        if len(sections) > 1 and isinstance(default, BaseModel) and "type" in type(default).model_fields:
            if "type" not in value:
                value = {"type": default.type, **value}
        if len(sections) == 1:
            value = fill_discriminators(sections[0], value)
        elif tag_value := value.get("type"):
            match = [m for m in sections if m.model_fields.get("type") and m.model_fields["type"].default == tag_value]
            if match:
                value = fill_discriminators(match[0], value)
        data = {**data, name: value}
    return data


def build_config(cls: type[C], parsed: ParsedArgs) -> C:
    """Merge the layers of `parsed` (plus the environment) and validate them into `cls`."""
    data: dict = {}
    sources: dict[tuple[str, ...], str] = {}
    sources.update(_env_sources())
    for path, scope in parsed.toml_files:
        file_data, file_sources = load_toml(path)
        for key in reversed(scope):
            file_data = {key: file_data}
        data = deep_merge(data, file_data)
        sources.update({scope + p: s for p, s in file_sources.items()})
    data = fill_discriminators(cls, deep_merge(data, parsed.cli))
    sources.update(parsed.cli_sources)
    try:
        return cls(**data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(cls, e, sources)) from None


def to_toml(config: BaseModel) -> str:
    """The resolved config as TOML (None values are omitted: TOML has no null; secrets are masked)."""

    def plain(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items() if v is not None}
        if isinstance(value, list):
            return [plain(v) for v in value]
        return value

    data = config.model_dump(mode="json", exclude_none=True)
    return tomli_w.dumps(plain(data))


def help_text(cls: type[BaseModel], prog: str) -> str:
    lines = [f"usage: {prog} [@ config.toml ...] [--section @ file.toml] [--key value ...] [--dry-run]", ""]
    for info in _walk([cls]):
        descr = _description(cls, info.path)
        if info.sections:
            lines.append(
                f"[{'.'.join(info.path)}]{' (optional: --' + '.'.join(info.path) + ' enables)' if info.optional else ''}  {descr}"
            )
        else:
            lines.append(f"  --{'.'.join(info.path).replace('_', '-')}  {descr}")
    return "\n".join(lines)


def _description(root: type[BaseModel], path: tuple[str, ...]) -> str:
    models: list[type[BaseModel]] = [root]
    for name in path[:-1]:
        models = _model_classes(_fields_of(models)[name])
    for model in models:
        if path[-1] in model.model_fields:
            info = model.model_fields[path[-1]]
            if info.is_required():
                return f"{info.description or ''} [required]"
            default = info.get_default(call_default_factory=True)
            if isinstance(default, BaseModel) or default is None or isinstance(default, SecretStr):
                return info.description or ""
            shown = str(default) if isinstance(default, Path) else repr(default)
            return f"{info.description or ''} [default: {shown}]"
    return ""


def write_resolved_config(config: EntrypointConfig, entrypoint: str) -> Path:
    """Write `{output_dir}/configs/<entrypoint>.toml` atomically (tmp + rename)."""
    target = Path(config.output_dir) / "configs" / f"{entrypoint}.toml"
    write_atomic(target, to_toml(config).encode())
    return target


def load_config(
    cls: type[C],
    entrypoint: str,
    argv: list[str] | None = None,
    check_passthrough: Callable[[C, list[str]], None] | None = None,
) -> tuple[C, list[str]]:
    """Parse argv for one entry point. Handles `--help`/`--dry-run` and config errors (exit 2) itself.

    With `check_passthrough`, flags that are not ours are collected (e.g. for vLLM) and handed to it
    for validation (it raises `ConfigError`); they are returned beside the config.
    """
    allow_passthrough = check_passthrough is not None
    argv = sys.argv[1:] if argv is None else argv
    try:
        parsed = parse_argv(cls, argv, allow_passthrough)
        if parsed.help:
            print(help_text(cls, entrypoint))
            sys.exit(0)
        config = build_config(cls, parsed)
        if check_passthrough is not None:
            check_passthrough(config, parsed.passthrough)
    except ConfigError as e:
        print(f"{entrypoint}: error: {e}", file=sys.stderr)
        sys.exit(2)
    if parsed.dry_run:
        print(to_toml(config), end="")
        if parsed.passthrough:
            print(f"# passed through: {' '.join(parsed.passthrough)}")
        sys.exit(0)
    return config, parsed.passthrough
