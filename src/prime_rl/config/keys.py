"""The dotted keys of a config, and the errors that name them: what flag spellings, "did you mean" suggestions and
validation-error locations resolve against. `ConfigError` is every config problem a user sees (exit code 2)."""

from __future__ import annotations

import difflib
import re
import types
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

Key = tuple[str, ...]


class ConfigError(Exception):
    """A problem with the user's config: printed as is, exit code 2."""


def _members(annotation: Any) -> list[Any]:
    """The types a field can hold: `Annotated` and unions unpacked (`X | None` -> [X, NoneType])."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _members(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _members(arg)]
    return [annotation]


def section_types(annotation: Any) -> list[type[BaseModel]]:
    """The config sections a field can hold (several for a union such as `AdamWConfig | SGDConfig`)."""
    return [m for m in _members(annotation) if isinstance(m, type) and issubclass(m, BaseModel)]


def is_bool(annotation: Any) -> bool:
    return set(_members(annotation)) - {type(None)} == {bool}


def is_list(annotation: Any) -> bool:
    return any(m in (list, tuple, set) or typing.get_origin(m) in (list, tuple, set) for m in _members(annotation))


def _is_dict(annotation: Any) -> bool:
    return any(m is dict or typing.get_origin(m) is dict for m in _members(annotation))


def is_optional(annotation: Any) -> bool:
    return type(None) in _members(annotation)


def config_keys(cls: type[BaseModel]) -> dict[Key, Any]:
    """Every dotted key below `cls` (sections and leaves) with its annotation; a union's sections share keys."""
    keys: dict[Key, Any] = {}

    def walk(models: list[type[BaseModel]], prefix: Key) -> None:
        for model in models:
            for name, info in model.model_fields.items():
                if prefix + (name,) not in keys:
                    keys[prefix + (name,)] = info.annotation
                    walk(section_types(info.annotation), prefix + (name,))

    walk([cls], ())
    return keys


def split_key(raw: str) -> Key:
    return tuple(seg.replace("-", "_") for seg in raw.split("."))


def _tokens(text: str) -> Key:
    return tuple(t for t in re.split(r"[.\-_]", text.lower()) if t)


def resolve_key(keys: dict[Key, Any], raw: str) -> Key | None:
    """Map a flag name (`model.name`, `model-name`, `max_steps`, ...) to its dotted key; None if unknown.

    The library's parser knows one spelling (`--model.max-model-len`); we also accept `_` for `-` in
    each segment, keys below a dict field (`--env-args.k`), and `-`/`_` in place of the dots when that
    spelling names exactly one key (`--model-name`).
    """
    path = split_key(raw)
    known = max((n for n in range(1, len(path) + 1) if path[:n] in keys), default=0)
    if known == len(path) or (known and _is_dict(keys[path[:known]])):
        return path
    matches = [key for key in keys if _tokens(".".join(key)) == _tokens(raw)]
    if len(matches) > 1:
        options = ", ".join("--" + ".".join(m) for m in matches)
        raise ConfigError(f"flag --{raw} is ambiguous: use one of {options}")
    return matches[0] if matches else None


# Upstream prime-rl's names of our settings (its configs are translated at load, `config/upstream.py`; these help a
# flag or a key in the wrong place): did-you-mean asks by meaning before spelling.
MEANINGS: dict[str, tuple[Key, ...]] = {
    "group_size": (("rollouts_per_example",),),
    "lora_name": (("adapter", "name"),),
    "async_level": (("max_async_level",),),
    "oversampling_factor": (("oversampling",),),
    "max_completion_tokens": (("max_tokens",),),
    "fsdp_cpu_offload": (("cpu_offload",),),
    "fused_lm_head_token_chunk_size": (("logprob_chunk",),),
    "micro_batch_size": (("micro_batch_tokens",),),
    "renderer": (("model", "renderer"), ("data", "renderer")),
    "monitors": (("wandb",),),
    "num_train_gpus": (("trainer_gpu_ids",),),
    "num_infer_gpus": (("inference_gpu_ids",),),
    "enable_lora": (("lora",),),
    "val": (("eval",),),
    "source": (("env",),),
    "train": (("env",),),
}


# Upstream names with no counterpart here: said instead of a guess by spelling.
UPSTREAM_ONLY: dict[str, str] = {
    "impl": "upstream's choice of model implementation; the Hugging Face one always runs here",
    "ep": "upstream's MoE expert parallelism, not supported here",
    "dp_replicate": "upstream's replicated data parallelism (HSDP), not supported here",
    "ac_offloading": "upstream's activation offloading, not supported here",
    "optimization_dtype": "upstream's master-weight dtype; float32 here (`model.dtype` is the compute dtype)",
    "reduce_dtype": "upstream's gradient-reduction dtype; float32 here",
}


def _by_meaning(keys: dict[Key, Any], path: Key) -> tuple[str, str] | None:
    """Our key for a path that uses one of upstream's names (at any level), and that name: the name replaced in
    place first, else our key at the top, else the one key anywhere ending so."""
    for i in range(len(path) - 1, -1, -1):
        name = path[i].replace("-", "_")
        for ours in MEANINGS.get(name, ()):
            tail = ours + path[i + 1 :]
            anywhere = [k for k in keys if k[-len(tail) :] == tail]
            for candidate in [path[:i] + tail, tail] + (anywhere if len(anywhere) == 1 else []):
                if candidate in keys:
                    return ".".join(candidate), name
    return None


def suggest(keys: dict[Key, Any], path: Key) -> str:
    """' (did you mean `x.y`?)' for our name of an upstream setting, else the closest other valid key (a sibling
    first, then any key), or ''."""
    if path[-1] in UPSTREAM_ONLY:
        return f" ({UPSTREAM_ONLY[path[-1]]})"
    meant = _by_meaning(keys, path)
    if meant is not None:
        return f" (did you mean `{meant[0]}`? upstream prime-rl's `{meant[1]}`)"
    siblings = [k[-1] for k in keys if k[:-1] == path[:-1] and k != path]
    close = difflib.get_close_matches(path[-1].replace("-", "_"), siblings, n=1, cutoff=0.6)
    if close:
        return f" (did you mean `{'.'.join(path[:-1] + (close[0],))}`?)"
    others = [".".join(k) for k in keys if k != path]
    close = difflib.get_close_matches(".".join(path).replace("-", "_"), others, n=1, cutoff=0.75)
    return f" (did you mean `{close[0]}`?)" if close else ""


def nest(path: Key, value: Any) -> Any:
    """`(a, b), v` -> `{a: {b: v}}`."""
    for key in reversed(path):
        value = {key: value}
    return value


def _source_of(path: Key, sources: dict[Key, str]) -> str:
    for n in range(len(path), 0, -1):
        if path[:n] in sources:
            return sources[path[:n]]
    return "defaults"


def _clean_loc(keys: dict[Key, Any], loc: tuple) -> Key:
    """Drop the union member pydantic puts in an error location (`optim.sgd.betas` -> `optim.betas`)."""
    out: Key = ()
    for part in map(str, loc):
        members = section_types(keys.get(out))
        tags = {m.__name__ for m in members} | {
            m.model_fields["type"].default for m in members if "type" in m.model_fields
        }
        if len(members) > 1 and part in tags and out + (part,) not in keys:
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
