"""argv: take out what only we know (`@ file.toml`, `--section @ file.toml`, `--dry-run`, our extra spellings of a
key, `--no-<section>`), hand the rest to pydantic-settings' CLI source, and sort out the flags of another program."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_settings import CliSettingsSource, SettingsError

from prime_rl.config.keys import (
    ConfigError,
    Key,
    is_bool,
    is_list,
    is_optional,
    nest,
    resolve_key,
    section_types,
    split_key,
    suggest,
)


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
            if is_list(keys.get(path)):
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
    if path is None or not section_types(keys.get(path)):
        raise ConfigError(f"--{raw} @ FILE: `{raw}` is not a config section{suggest(keys, split_key(raw))}")
    return path


def _flag_key(keys: dict[Key, Any], raw: str) -> tuple[Key | None, bool]:
    """The key a flag names, and whether it is the `--no-` form (of a bool or an optional section)."""
    path = resolve_key(keys, raw)
    if path is None and re.match(r"no[-_]", raw):
        negated = resolve_key(keys, raw[3:])
        annotation = keys.get(negated) if negated else None
        if negated and (is_bool(annotation) or (is_optional(annotation) and section_types(annotation))):
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
    if negated or is_bool(keys.get(path)):
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
    if not is_bool(keys[path]):
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
        return f"{_flag(path[:n])}={json.dumps(nest(path[n:], value))}"
    if value is not None and is_optional(keys[path]) and value.lower() in ("none", "null"):
        return None
    if value is not None and is_list(keys[path]) and not value.strip():
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
            if not allowed or ("." in raw and (split_key(raw)[0],) in keys):  # a typo in one of our sections
                raise ConfigError(f"unknown option --{raw}{suggest(keys, split_key(raw))}")
        elif not passthrough:  # only a foreign flag takes a value we do not know about
            raise ConfigError(f"unexpected argument {arg!r}: options look like `--key value`, files like `@ file.toml`")
        passthrough.append(arg)
    return passthrough
