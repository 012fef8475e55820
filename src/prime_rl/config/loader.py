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
reads the environment. We add only what the library lacks: the `@ file.toml` syntax with includes
(`toml_files`), more spellings of a key, `--no-<section>`, pass-through of foreign flags and `--dry-run`
(`argv`), and errors that name the dotted key, where its value came from and the closest valid key
(`keys.ConfigError`; entry points turn it into exit code 2). This module puts those layers together.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import tomli_w
from pydantic import BaseModel, ValidationError
from pydantic_settings import SettingsError

from prime_rl.config.argv import ParsedArgv, parse_cli, passthrough_args, split_argv
from prime_rl.config.base import EntrypointConfig
from prime_rl.config.keys import ConfigError, Key, config_keys, format_validation_error, nest
from prime_rl.config.toml_files import deep_merge, fill_discriminators, leaf_paths, load_toml  # also imported here
from prime_rl.config.upstream import translate
from prime_rl.utils.fs import write_atomic

C = TypeVar("C", bound=BaseModel)

ENV_PREFIX = "PRIME_"


def _env_sources() -> dict[Key, str]:
    """The key each `PRIME_*` variable sets, to name it in an error (the library reads the values)."""
    return {
        tuple(part.lower() for part in name[len(ENV_PREFIX) :].split("__")): f"environment variable {name}"
        for name in os.environ
        if name.upper().startswith(ENV_PREFIX)
    }


def given_data(
    cls: type[BaseModel], parsed: ParsedArgv, cli: dict, entrypoint: str = "", notes: list | None = None
) -> tuple[dict, dict[Key, str]]:
    """The TOML files deep-merged with the CLI values over them (each file read in upstream prime-rl's spellings too,
    `upstream.translate`; what was translated is appended to `notes`), and where each key came from."""
    data: dict = {}
    sources = _env_sources()
    for path, scope in parsed.toml_files:
        file_data, file_sources = load_toml(path)
        file_data, translated = translate(entrypoint, nest(scope, file_data), str(path))
        if translated and notes is not None:
            notes.append((path, translated))
        data = deep_merge(data, file_data)
        sources.update({scope + p: s for p, s in file_sources.items()})
        sources.update({p: str(path) for p in leaf_paths(file_data) if p not in sources})
    data = _cli_overrides_sections(cls, data, cli, notes)
    sources.update(parsed.cli_sources)
    for path in parsed.cli_nulls:
        cli = deep_merge(cli, nest(path, None))
    return deep_merge(data, cli), sources


def build_config(
    cls: type[C], keys: dict[Key, Any], parsed: ParsedArgv, cli: dict, entrypoint: str = "", notes: list | None = None
) -> C:
    """`given_data` validated into `cls`; a settings class reads the environment below these values itself
    (`EntrypointConfig`)."""
    given, sources = given_data(cls, parsed, cli, entrypoint, notes)
    try:
        return cls(**fill_discriminators(cls, given))
    except ValidationError as e:
        raise ConfigError(format_validation_error(keys, e, sources)) from None
    except SettingsError as e:  # a PRIME_* value that is not even parseable, e.g. a list not written as JSON
        field = m.group(1) if (m := re.search(r'field "(\w+)"', str(e))) else ""
        names = sorted(n.upper() for n in os.environ if n.upper().startswith(f"{ENV_PREFIX}{field.upper()}"))
        raise ConfigError(
            f"{e}: check {', '.join(names) or 'the PRIME_* variables'} "
            "(lists and tables in the environment are JSON, e.g. '[\"http://a:8000/v1\"]')"
        ) from None


def given_values(cls: type[BaseModel], entrypoint: str, argv: list[str]) -> dict:
    """What argv's files and flags give (upstream spellings translated), before defaults and validators: what
    reproduces the config elsewhere (`rl`'s SLURM job), where a full dump would pin every derived default."""
    keys = config_keys(cls)
    parsed = split_argv(keys, argv)
    cli, _ = parse_cli(cls, entrypoint, parsed.cli)
    return given_data(cls, parsed, cli, entrypoint)[0]


def _cli_overrides_sections(cls: type[BaseModel], data: dict, cli: dict, notes: list | None) -> dict:
    """Drop the sections' file values of a shared key the command line sets (`cls.CLI_OVERRIDES_SECTIONS`)."""
    overridden = []
    for shared, section_keys in getattr(cls, "CLI_OVERRIDES_SECTIONS", {}).items():
        if _lookup(cli, shared) is None:
            continue
        for key in section_keys:
            parent = _lookup(data, key[:-1])
            if isinstance(parent, dict) and key[-1] in parent:
                value = parent.pop(key[-1])
                overridden.append(f"--{'.'.join(shared)} overrides `{'.'.join(key)}` = {value!r}")
    if overridden and notes is not None:
        notes.append(("the command line", overridden))
    return data


def _lookup(data: dict, path: Key) -> Any:
    for part in path:
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


def without_nulls(value: Any) -> Any:
    """`value` with every None-valued key dropped, at any depth: TOML has no null (the key keeps its default)."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


def to_toml(config: BaseModel) -> str:
    """The resolved config as TOML (None values are omitted: TOML has no null; secrets are masked)."""
    return tomli_w.dumps(without_nulls(config.model_dump(mode="json", exclude_none=True)))


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
        notes: list = []
        config = build_config(cls, keys, parsed, cli, entrypoint, notes)
        if check_passthrough is not None:
            check_passthrough(config, passthrough)
    except ConfigError as e:
        print(f"{entrypoint}: error: {e}", file=sys.stderr)
        sys.exit(2)
    for path, translated in notes:  # before logging is set up: the console is where the user looks
        what = "" if path == "the command line" else " is in upstream prime-rl's spelling,"
        print(f"{entrypoint}: {path}{what} read as: {'; '.join(translated)}", file=sys.stderr)
    if parsed.dry_run:
        for path, translated in notes:
            print(f"# read from {path}:\n" + "".join(f"#   {n}\n" for n in translated), end="")
        print(to_toml(config), end="")
        if passthrough:
            print(f"# passed through: {' '.join(passthrough)}")
        sys.exit(0)
    return config, passthrough
