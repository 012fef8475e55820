"""Turn argv (+ TOML files + `PRIME_*` environment) into one validated entry-point config.

Sources, highest first:
  1. CLI flags: `--model.name X`, `--model-name X`, `--model_name=X`, `--flag` / `--no-flag`,
     lists as `--ids 0,1` or `--ids '[0, 1]'`, dicts as JSON, a bare `--ckpt` enables an optional section.
  2. TOML files given as `@ path.toml` (several allowed, deep-merged, a later file wins per key) or
     scoped to one section with `--trainer @ t.toml`. A file may include others with
     `toml_files = ["base.toml"]` (relative to itself; the including file wins).
  3. Environment variables `PRIME_MODEL__NAME=...` (`__` nests).
  4. Field defaults.

pydantic-settings does the parsing: its `CliSettingsSource` turns the flags into values (lists, JSON,
`--flag`/`--no-flag`, bare section flags, `--help`) and `EnvSettingsSource` (see `EntrypointConfig`)
reads the environment. This module adds only what the library lacks: the `@ file.toml` syntax with
includes, more spellings of a key, `--no-<section>`, pass-through of foreign flags, `--dry-run`, and
errors that name the dotted key, where its value came from and the closest valid key (`ConfigError`;
entry points turn it into exit code 2).
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
from pydantic import BaseModel, ValidationError
from pydantic_settings import CliSettingsSource, SettingsError

from prime_rl.config.base import EntrypointConfig
from prime_rl.utils.fs import write_atomic

C = TypeVar("C", bound=BaseModel)
Key = tuple[str, ...]

ENV_PREFIX = "PRIME_"
INCLUDE_KEY = "toml_files"


class ConfigError(Exception):
    """A problem with the user's config: printed as is, exit code 2."""


# ---------------------------------------------------------------------------------------------
# The dotted keys of a config: what the spellings, suggestions and error locations resolve against.
# ---------------------------------------------------------------------------------------------


def _members(annotation: Any) -> list[Any]:
    """The types a field can hold: `Annotated` and unions unpacked (`X | None` -> [X, NoneType])."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _members(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _members(arg)]
    return [annotation]


def _sections(annotation: Any) -> list[type[BaseModel]]:
    """The config sections a field can hold (several for a union such as `AdamWConfig | SGDConfig`)."""
    return [m for m in _members(annotation) if isinstance(m, type) and issubclass(m, BaseModel)]


def _is_bool(annotation: Any) -> bool:
    return set(_members(annotation)) - {type(None)} == {bool}


def _is_list(annotation: Any) -> bool:
    return any(m in (list, tuple, set) or typing.get_origin(m) in (list, tuple, set) for m in _members(annotation))


def _is_dict(annotation: Any) -> bool:
    return any(m is dict or typing.get_origin(m) is dict for m in _members(annotation))


def _optional(annotation: Any) -> bool:
    return type(None) in _members(annotation)


def config_keys(cls: type[BaseModel]) -> dict[Key, Any]:
    """Every dotted key below `cls` (sections and leaves) with its annotation; a union's sections share keys."""
    keys: dict[Key, Any] = {}

    def walk(models: list[type[BaseModel]], prefix: Key) -> None:
        for model in models:
            for name, info in model.model_fields.items():
                if prefix + (name,) not in keys:
                    keys[prefix + (name,)] = info.annotation
                    walk(_sections(info.annotation), prefix + (name,))

    walk([cls], ())
    return keys


def _split(raw: str) -> Key:
    return tuple(seg.replace("-", "_") for seg in raw.split("."))


def _tokens(text: str) -> Key:
    return tuple(t for t in re.split(r"[.\-_]", text.lower()) if t)


def resolve_key(keys: dict[Key, Any], raw: str) -> Key | None:
    """Map a flag name (`model.name`, `model-name`, `max_steps`, ...) to its dotted key; None if unknown.

    The library's parser knows one spelling (`--model.max-model-len`); we also accept `_` for `-` in
    each segment, keys below a dict field (`--env-args.k`), and `-`/`_` in place of the dots when that
    spelling names exactly one key (`--model-name`).
    """
    path = _split(raw)
    known = max((n for n in range(1, len(path) + 1) if path[:n] in keys), default=0)
    if known == len(path) or (known and _is_dict(keys[path[:known]])):
        return path
    matches = [key for key in keys if _tokens(".".join(key)) == _tokens(raw)]
    if len(matches) > 1:
        options = ", ".join("--" + ".".join(m) for m in matches)
        raise ConfigError(f"flag --{raw} is ambiguous: use one of {options}")
    return matches[0] if matches else None


def suggest(keys: dict[Key, Any], path: Key) -> str:
    """' (did you mean `x.y`?)' for the closest other valid key (a sibling first, then any key), or ''."""
    siblings = [k[-1] for k in keys if k[:-1] == path[:-1] and k != path]
    close = difflib.get_close_matches(path[-1].replace("-", "_"), siblings, n=1, cutoff=0.6)
    if close:
        return f" (did you mean `{'.'.join(path[:-1] + (close[0],))}`?)"
    others = [".".join(k) for k in keys if k != path]
    close = difflib.get_close_matches(".".join(path).replace("-", "_"), others, n=1, cutoff=0.75)
    return f" (did you mean `{close[0]}`?)" if close else ""


# ---------------------------------------------------------------------------------------------
# argv: take out what only we know, hand the rest to pydantic-settings' CLI source.
# ---------------------------------------------------------------------------------------------


@dataclass
class ParsedArgv:
    """argv sorted into TOML layers, flags for the library's parser, and where each key was set."""

    toml_files: list[tuple[Path, Key]] = field(default_factory=list)  # (path, section it loads into)
    cli: list[str] = field(default_factory=list)
    cli_sources: dict[Key, str] = field(default_factory=dict)
    cli_nulls: list[Key] = field(default_factory=list)  # `--no-ckpt`, `--max-steps none`: set here, not by the library
    dry_run: bool = False

    def add_flag(self, keys: dict[Key, Any], arg: str, token: str | None, path: Key | None) -> None:
        """Add one respelled flag; the last flag for a key wins (the library would append to a list, and
        a None set here would win over a later `--ckpt.interval 2`)."""
        if path is not None:
            self.cli_sources[path] = arg.partition("=")[0]
            self.cli_nulls = [p for p in self.cli_nulls if path[: len(p)] != p]
            if _is_list(keys.get(path)):
                self.cli = [t for t in self.cli if t.partition("=")[0] != _flag(path)]
        if token is None:
            self.cli_nulls.append(path)
        else:
            self.cli.append(token)


def split_argv(keys: dict[Key, Any], argv: list[str]) -> ParsedArgv:
    """Take out `@ file.toml`, `--section @ file.toml` and `--dry-run` (the library has no such syntax)
    and respell our flags for the library's parser; everything else is left for that parser."""
    parsed = ParsedArgv()
    i = 0
    while i < len(argv):
        arg, i = argv[i], i + 1
        if arg.startswith("@"):
            if arg == "@":
                if i >= len(argv):
                    raise ConfigError("`@` must be followed by a TOML file path")
                arg, i = "@" + argv[i], i + 1
            parsed.toml_files.append((Path(arg[1:]), ()))
        elif arg in ("--dry-run", "--dry_run"):
            parsed.dry_run = True
        elif arg.startswith("--") and "=" not in arg and i < len(argv) and argv[i] == "@":
            if i + 1 >= len(argv):
                raise ConfigError(f"{arg} @ must be followed by a TOML file path")
            parsed.toml_files.append((Path(argv[i + 1]), _section(keys, arg[2:])))
            i += 2
        elif arg.startswith("--"):
            token, path, i = _respell(keys, argv, i)
            parsed.add_flag(keys, arg, token, path)
        else:
            parsed.cli.append(arg)
    return parsed


def _section(keys: dict[Key, Any], raw: str) -> Key:
    """The section a `--section @ file.toml` loads into; anything else is an error."""
    path = resolve_key(keys, raw)
    if path is None or not _sections(keys.get(path)):
        raise ConfigError(f"--{raw} @ FILE: `{raw}` is not a config section{suggest(keys, _split(raw))}")
    return path


def _flag_key(keys: dict[Key, Any], raw: str) -> tuple[Key | None, bool]:
    """The key a flag names, and whether it is the `--no-` form (of a bool or an optional section)."""
    path = resolve_key(keys, raw)
    if path is None and re.match(r"no[-_]", raw):
        negated = resolve_key(keys, raw[3:])
        annotation = keys.get(negated) if negated else None
        if negated and (_is_bool(annotation) or (_optional(annotation) and _sections(annotation))):
            return negated, True
    return path, False


def _respell(keys: dict[Key, Any], argv: list[str], i: int) -> tuple[str | None, Key | None, int]:
    """Rewrite our flag `argv[i - 1]` (with its value) into the one arg the library parses.

    Returns (that arg or None when it sets its key to None, its key, index of the next unread arg). A flag
    that is not ours stays as it is (key None): the library's parser answers `--help` and returns the others
    as unknown.
    """
    raw, has_eq, value = argv[i - 1][2:].partition("=")
    path, negated = _flag_key(keys, raw)
    if path is None:
        return argv[i - 1], None, i
    if negated or _is_bool(keys.get(path)):
        if not negated and not has_eq and i < len(argv) and argv[i].lower() in ("true", "false"):
            value, has_eq, i = argv[i], True, i + 1
        return _switch(keys, path, raw, negated, value if has_eq else None), path, i
    if not has_eq and i < len(argv) and not argv[i].startswith("--"):
        value, has_eq, i = argv[i], True, i + 1
    return _with_value(keys, path, raw, value if has_eq else None), path, i


def _flag(path: Key) -> str:
    """The one spelling the library's parser registers (`cli_kebab_case`): `--model.max-model-len`."""
    return "--" + ".".join(path).replace("_", "-")


def _switch(keys: dict[Key, Any], path: Key, raw: str, negated: bool, value: str | None) -> str | None:
    """`--flag`, `--flag false`, `--flag=yes`, `--no-flag` -> `--flag` / `--no-flag` (the library's
    `cli_implicit_flags` take no value); `--no-ckpt` -> None (the library has no negated sections)."""
    if value is not None and (negated or value.lower() not in ("true", "false", "1", "0", "yes", "no")):
        raise ConfigError(f"--{raw} takes no value" if negated else f"--{raw}: expects true or false, got {value!r}")
    if not _is_bool(keys[path]):
        return None
    on = not negated and (value is None or value.lower() in ("true", "1", "yes"))
    return _flag(path) if on else f"--no-{_flag(path)[2:]}"


def _with_value(keys: dict[Key, Any], path: Key, raw: str, value: str | None) -> str | None:
    """`--model_name x` -> `--model.name=x` (joined: a value may start with `-`); `--env-args.k v` ->
    `--env-args={"k": "v"}` (the library knows no keys below a dict field); `none`/`null` for an optional
    key -> None (the library reads only `null`, and for a list not even that)."""
    if path not in keys:
        if value is None:
            raise ConfigError(f"--{raw} needs a value")
        n = max(n for n in range(len(path)) if path[:n] in keys)
        return f"{_flag(path[:n])}={json.dumps(_nest(path[n:], value))}"
    if value is not None and _optional(keys[path]) and value.lower() in ("none", "null"):
        return None
    if value is not None and _is_list(keys[path]) and not value.strip():
        value = "[]"  # the library would read one empty item
    return _flag(path) if value is None else f"{_flag(path)}={value}"


def parse_cli(cls: type[BaseModel], prog: str, args: list[str]) -> tuple[dict, list[str]]:
    """Parse our flags with pydantic-settings' CLI source; returns (nested values, the args it did not know).

    `--help` prints the library's help (every key with its docstring and default) and exits 0.
    """
    unknown: list[str] = []

    def parse_known_args(parser: Any, args: list[str]) -> Any:
        namespace, rest = parser.parse_known_args(args)
        unknown.extend(rest)
        return namespace

    source = CliSettingsSource(
        cls,  # type: ignore[arg-type]  # a plain model (e.g. TinyModelConfig) parses just as well
        cli_prog_name=prog,
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_hide_none_type=True,
        cli_exit_on_error=False,
        parse_args_method=parse_known_args,
    )
    source.root_parser.usage = f"{prog} [@ config.toml ...] [--section @ file.toml] [--key value ...] [--dry-run]"
    try:
        return source(args=args)(), unknown
    except SettingsError as e:
        raise ConfigError(str(e).removeprefix("error parsing CLI: ")) from None


def passthrough_args(keys: dict[Key, Any], unknown: list[str], allowed: bool) -> list[str]:
    """The args the parser did not know: flags for another program (with their values) when allowed, else an error."""
    passthrough: list[str] = []
    for arg in unknown:
        if arg.startswith("--") and arg != "--":
            raw = arg[2:].partition("=")[0]
            if not allowed or ("." in raw and (_split(raw)[0],) in keys):  # a typo in one of our sections
                raise ConfigError(f"unknown option --{raw}{suggest(keys, _split(raw))}")
        elif not passthrough:  # only a foreign flag takes a value we do not know about
            raise ConfigError(f"unexpected argument {arg!r}: options look like `--key value`, files like `@ file.toml`")
        passthrough.append(arg)
    return passthrough


# ---------------------------------------------------------------------------------------------
# TOML layers, merged with the CLI values.
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


def _nest(path: Key, value: Any) -> Any:
    """`(a, b), v` -> `{a: {b: v}}`."""
    for key in reversed(path):
        value = {key: value}
    return value


def _leaf_paths(data: dict, prefix: Key = ()) -> list[Key]:
    out = []
    for key, value in data.items():
        out.append(prefix + (key,))
        if isinstance(value, dict):
            out.extend(_leaf_paths(value, prefix + (key,)))
    return out


def load_toml(path: Path, _stack: tuple[Path, ...] = ()) -> tuple[dict, dict[Key, str]]:
    """Read a TOML file with its `toml_files` includes; returns (data, source of every key).

    Not pydantic-settings' `TomlConfigSettingsSource`: it skips a missing file silently, has no includes
    and no section scoping, and forgets which file set a key.
    """
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
    sources: dict[Key, str] = {}
    for include in includes:
        inc_data, inc_sources = load_toml(path.parent / include, _stack + (path,))
        merged = deep_merge(merged, inc_data)
        sources.update(inc_sources)
    sources.update({p: str(path) for p in _leaf_paths(data)})
    return deep_merge(merged, data), sources


def fill_discriminators(cls: type[BaseModel], data: dict) -> dict:
    """`--optim.lr 0.1` overrides the default optimizer's lr: give partial tables of a tagged union
    (e.g. `optim: AdamWConfig | SGDConfig`) the tag of the field's default when they do not name one (of the union's
    first member when the default is None).
    (pydantic-settings' `nested_model_default_partial_update` would also keep the default's other keys,
    which another member of the union refuses.)"""
    for name, info in cls.model_fields.items():
        value = data.get(name)
        if not isinstance(value, dict):
            continue
        sections = _sections(info.annotation)
        default = info.get_default(call_default_factory=True)
        if len(sections) > 1 and isinstance(default, BaseModel) and "type" in type(default).model_fields:
            value = {"type": default.type, **value}
        elif len(sections) > 1 and default is None and "type" in sections[0].model_fields:  # an optional union: its
            value = {"type": sections[0].model_fields["type"].default, **value}  # first member (adamw, constant)
        if len(sections) > 1:  # recurse into the member the tag names
            sections = [
                m for m in sections if "type" in m.model_fields and m.model_fields["type"].default == value.get("type")
            ]
        if len(sections) == 1:
            value = fill_discriminators(sections[0], value)
        data = {**data, name: value}
    return data


# ---------------------------------------------------------------------------------------------
# Validation errors, readable.
# ---------------------------------------------------------------------------------------------


def _env_sources() -> dict[Key, str]:
    """The key each `PRIME_*` variable sets, to name it in an error (the library reads the values)."""
    return {
        tuple(part.lower() for part in name[len(ENV_PREFIX) :].split("__")): f"environment variable {name}"
        for name in os.environ
        if name.upper().startswith(ENV_PREFIX)
    }


def _source_of(path: Key, sources: dict[Key, str]) -> str:
    for n in range(len(path), 0, -1):
        if path[:n] in sources:
            return sources[path[:n]]
    return "defaults"


def _clean_loc(keys: dict[Key, Any], loc: tuple) -> Key:
    """Drop the union member pydantic puts in an error location (`optim.sgd.betas` -> `optim.betas`)."""
    out: Key = ()
    for part in map(str, loc):
        if len(_sections(keys.get(out))) > 1 and out + (part,) not in keys:
            continue
        out += (part,)
    return out


def format_validation_error(keys: dict[Key, Any], error: ValidationError, sources: dict[Key, str]) -> str:
    """One line per problem: the dotted key, where its value came from, and the closest valid key."""
    lines = []
    for err in error.errors():
        path = _clean_loc(keys, err["loc"])
        key = ".".join(path) or "(top level)"
        origin = _source_of(path, sources)
        if err["type"] == "extra_forbidden":
            hint = " (a key of another `type`)" if path in keys else suggest(keys, path)  # a union's other member
            lines.append(f"unknown key `{key}` (from {origin}){hint}")
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


def build_config(cls: type[C], keys: dict[Key, Any], parsed: ParsedArgv, cli: dict) -> C:
    """Deep-merge the TOML files and the CLI values over them, then validate into `cls`; a settings
    class reads the environment below these values itself (`EntrypointConfig`)."""
    data: dict = {}
    sources = _env_sources()
    for path, scope in parsed.toml_files:
        file_data, file_sources = load_toml(path)
        data = deep_merge(data, _nest(scope, file_data))
        sources.update({scope + p: s for p, s in file_sources.items()})
    sources.update(parsed.cli_sources)
    for path in parsed.cli_nulls:
        cli = deep_merge(cli, _nest(path, None))
    try:
        return cls(**fill_discriminators(cls, deep_merge(data, cli)))
    except ValidationError as e:
        raise ConfigError(format_validation_error(keys, e, sources)) from None
    except SettingsError as e:  # a PRIME_* value that is not even parseable, e.g. a list not written as JSON
        field = m.group(1) if (m := re.search(r'field "(\w+)"', str(e))) else ""
        names = sorted(n.upper() for n in os.environ if n.upper().startswith(f"{ENV_PREFIX}{field.upper()}"))
        raise ConfigError(
            f"{e}: check {', '.join(names) or 'the PRIME_* variables'} "
            "(lists and tables in the environment are JSON, e.g. '[\"http://a:8000/v1\"]')"
        ) from None


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


def write_resolved_config(config: EntrypointConfig, entrypoint: str) -> Path:
    """Write `{output_dir}/configs/<entrypoint>.toml` atomically (tmp + rename); named after `log.file` where one
    is set, so several servers sharing an output dir keep one resolved config each."""
    name = Path(config.log.file).stem if config.log.file else entrypoint
    target = Path(config.output_dir) / "configs" / f"{name}.toml"
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
    argv = sys.argv[1:] if argv is None else argv
    try:
        keys = config_keys(cls)
        parsed = split_argv(keys, argv)
        cli, unknown = parse_cli(cls, entrypoint, parsed.cli)
        passthrough = passthrough_args(keys, unknown, allowed=check_passthrough is not None)
        config = build_config(cls, keys, parsed, cli)
        if check_passthrough is not None:
            check_passthrough(config, passthrough)
    except ConfigError as e:
        print(f"{entrypoint}: error: {e}", file=sys.stderr)
        sys.exit(2)
    if parsed.dry_run:
        print(to_toml(config), end="")
        if passthrough:
            print(f"# passed through: {' '.join(passthrough)}")
        sys.exit(0)
    return config, passthrough
