"""TOML config files: read one with its `toml_files` includes (remembering which file set each key), deep-merge the
layers, and tag partial tables of a tagged union."""

from __future__ import annotations

import tomllib
from pathlib import Path

from pydantic import BaseModel

from prime_rl.config.keys import ConfigError, Key, section_types

INCLUDE_KEY = "toml_files"


def deep_merge(base: dict, override: dict) -> dict:
    """Merge `override` into a copy of `base`: tables merge key by key, other values replace."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def leaf_paths(data: dict, prefix: Key = ()) -> list[Key]:
    out = []
    for key, value in data.items():
        out.append(prefix + (key,))
        if isinstance(value, dict):
            out.extend(leaf_paths(value, prefix + (key,)))
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
    sources.update({p: str(path) for p in leaf_paths(data)})
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
        sections = section_types(info.annotation)
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
