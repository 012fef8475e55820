"""The checks of a LoRA adapter directory, before the server loads it (`adapters.Adapters.load`).

An adapter is a PEFT directory (`adapter_config.json` + `adapter_model.safetensors`, tensors
`base_model.model.<layer>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r] for a linear layer's weight [out, in]).
An input embedding's weight is [vocab, dim] and its LoRA the other way round: A [r, vocab], B [dim, r] (PEFT names them
`<layer>.lora_embedding_A` / `_B`, and saves the embedding's own weight next to them as `<layer>.base_layer.weight`,
which vLLM ignores). The checks read the config, the safetensors header and then the tensors' data (adapters are
small), so a bad adapter is refused (422) before the engine sees it: vLLM itself checks neither tensor shapes against
the model nor, before loading, whether the model has the layers, nor whether the values are finite (a NaN adapter
served NaN, and its requests' NaN activations reached other requests: see `finite_kv`). Both files must resolve inside
the allowed roots, as the directory must, and must not be hard links (403; see `weights.open_in_roots`, and the module
docstring of `weights` for the race left between the check and vLLM's read). The config is held to what vLLM's
`PEFTHelper` reads (`CONFIG_KEYS`); its rank/alpha patterns are regexes, compiled and matched in a child process
bounded in memory and time (vLLM's engine has no bound on them), which inherits none of the server's environment.
Replies name the config key (or the pattern's position) and what is accepted, never the value the file holds.

Their own module because they need neither vLLM nor a running server: the tests check directories without an engine,
and eval tells an adapter directory by its `ADAPTER_CONFIG`.
"""

from __future__ import annotations

import json
import math
import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import regex

from prime_rl.inference.weights import (
    FLOAT_DTYPES,
    TensorSpec,
    WeightDirError,
    checked_dir,
    clip,
    file_specs,
    names,
    nonfinite_tensor,
    open_in_roots,
    read_json,
)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
LORA_SUFFIXES = {
    ".lora_A.weight": "lora_A",
    ".lora_B.weight": "lora_B",
    ".lora_embedding_A": "lora_A",  # PEFT's names for an embedding's; vLLM loads them as lora_A / lora_B
    ".lora_embedding_B": "lora_B",
}
INPUT_EMBEDDINGS = frozenset({"embed_tokens", "wte"})
"""Layer names vLLM's models give their input embedding (`embedding_modules`' "input_embeddings"): their LoRA is
shaped A [r, vocab], B [dim, r]. (The output embedding, `lm_head`, takes a linear layer's: A [r, dim], B [vocab, r].)"""
EMBEDDING_COPIES = (".embed_tokens.base_layer.weight", ".lm_head.base_layer.weight")
"""Tensors PEFT saves with an embedding adapter (the embedding's own weight) and vLLM skips when loading it."""
INITS_SERVED = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")
"""String `init_lora_weights` vLLM serves: they only initialized the adapter (PiSSA, OLoRA, CorDA, LoftQ... change the
base weights, which vLLM refuses)."""
PATTERN_SECONDS = 1.0
"""How long the adapter's rank/alpha patterns may take to match its layer names (vLLM matches them in the engine, with
no limit: a pattern that backtracks for long stalls generation)."""
PATTERN_MEMORY = 1 << 30
"""Address space of the process that compiles the patterns: a pattern as short as `(?:(?:a{60000}){60000})` takes all
the machine's memory to compile."""
PATTERN_FIELDS = ("rank_pattern", "alpha_pattern")
PATTERN_PREFIX = "(.*\\.)?("
"""vLLM matches a pattern key as `(.*\\.)?(<key>)$`."""
PATTERN_LOCK = threading.Lock()
CHILD_ENVIRONMENT = ("PYTHONPATH",)
"""What the pattern child keeps of the server's environment: where `prime_rl` may be imported from. Nothing else (the
server's may hold API keys or the run secret); the interpreter is this one (`sys.executable`)."""


def is_rank(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def is_finite_number(value: object) -> bool:
    """vLLM divides it by the rank: a string or null fails, an int too large for a float overflows, inf/NaN serve NaN."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def patterns_of(is_value: Callable[[object], bool]) -> Callable[[object], bool]:
    """vLLM reads a false `rank_pattern`/`alpha_pattern` as {} (its regexes are checked by `pattern_problem`)."""
    return lambda patterns: (
        not patterns or (isinstance(patterns, dict) and all(is_value(value) for value in patterns.values()))
    )


def unset(feature: str) -> tuple[Callable[[object], bool], str]:
    return (lambda value: not value), f"false or unset, as it does not support {feature}"


CONFIG_KEYS: dict[str, tuple[Callable[[object], bool], str]] = {
    "peft_type": (lambda value: value == "LORA", "'LORA'"),
    "r": (is_rank, "a positive integer"),
    "lora_alpha": (is_finite_number, "a finite number"),
    "target_modules": (lambda value: True, "any value"),
    "bias": (lambda value: value == "none", "'none'"),
    "use_rslora": (lambda value: value is None or isinstance(value, bool), "true or false"),
    "init_lora_weights": (
        lambda value: not isinstance(value, str) or value.lower() in INITS_SERVED,
        f"true, false or one of {', '.join(INITS_SERVED)} (other inits change the base weights)",
    ),
    "rank_pattern": (patterns_of(is_rank), "an object of regexes to positive integers"),
    "alpha_pattern": (patterns_of(is_finite_number), "an object of regexes to finite numbers"),
    "use_dora": unset("DoRA"),
    "lora_bias": unset("LoRA biases"),
    "modules_to_save": unset("full modules"),
    "layer_replication": unset("layer replication"),
    "alora_invocation_tokens": unset("Activated LoRA"),
    "use_bdlora": unset("block-diagonal LoRA"),
    "use_qalora": unset("QALoRA"),
}
"""The `adapter_config.json` keys vLLM reads (`vllm.lora.peft_helper.PEFTHelper`): key -> (accepts a value, what is
accepted). A key left out takes PEFT's default, which vLLM serves, except for the `REQUIRED_KEYS`."""
REQUIRED_KEYS = ("peft_type", "r", "lora_alpha", "target_modules")
"""vLLM requires r, lora_alpha and target_modules (null counts as given); peft_type tells a LoRA from other PEFT types."""


def check_adapter_dir(
    lora_path: str, roots: list[Path], base: dict[str, TensorSpec], max_rank: int, modules: set[str] | None
) -> Path:
    """Validate a `/load_lora_adapter` target against the served model; returns its resolved path.

    `base`: the served model's tensors; `max_rank`: the server's `max_lora_rank`; `modules`: the layer names vLLM
    applies LoRA to in this model (None: not known, not checked). Raises `WeightDirError` (400/403/404 for the path
    or a file resolving outside the roots, 422 for the contents)."""
    path = checked_dir(lora_path, roots, "lora_path")
    shown = f"lora_path {clip(lora_path)}"
    with open_in_roots(path / ADAPTER_CONFIG, roots, shown) as file:
        if file is None:
            raise WeightDirError(422, f"{shown} has no {ADAPTER_CONFIG} (not a PEFT adapter directory)")
        config = read_adapter_config(read_json(file, shown, ADAPTER_CONFIG), shown)
    rank = config_rank(config, max_rank)
    with open_in_roots(path / ADAPTER_WEIGHTS, roots, shown) as file:
        if file is None:
            raise WeightDirError(422, f"{shown} has no {ADAPTER_WEIGHTS}")
        specs = file_specs(file, f"{shown}: {ADAPTER_WEIGHTS}")
        problem = tensor_problem(specs, base, max_rank, modules, rank if not config.get("rank_pattern") else None)
        if problem is None:
            problem = pattern_problem(config, sorted(lora_layers(specs)))
        if problem is None:
            problem = nonfinite_problem(file)  # the data of the very file whose header was checked
    if problem is not None:
        raise WeightDirError(422, f"{shown}: {problem}")
    return path


def nonfinite_problem(file: str) -> str | None:
    """Why the adapter's values cannot be served (a NaN or an infinity), or None."""
    try:
        name = nonfinite_tensor(file)
    except WeightDirError as e:
        return f"{ADAPTER_WEIGHTS} has {e.message}"
    if name is None:
        return None
    return f"{ADAPTER_WEIGHTS} has non-finite values (NaN or inf) in tensor {clip(name, 120)}"


def read_adapter_config(config: object, shown: str) -> dict:
    """The parsed `adapter_config.json`, if vLLM can serve an adapter of it (else 422, naming each key refused)."""
    if not isinstance(config, dict):
        raise WeightDirError(422, f"{shown}: {ADAPTER_CONFIG} is not a JSON object")
    missing = [key for key in REQUIRED_KEYS if key not in config]
    if missing:
        raise WeightDirError(
            422, f"{shown}: {ADAPTER_CONFIG} has no {', '.join(missing)} (required: {', '.join(REQUIRED_KEYS)})"
        )
    refused = [  # the key and the JSON type of its value, never the value: the file's contents are not echoed
        f"{key} as {json_type(config[key])} (vLLM takes {accepted})"
        for key, (accepts, accepted) in CONFIG_KEYS.items()
        if key in config and not accepts(config[key])
    ]
    if refused:
        raise WeightDirError(422, f"{shown}: {ADAPTER_CONFIG} has {'; '.join(refused)}")
    return config


JSON_KINDS = {
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "an array",
    dict: "an object",
}


def json_type(value: object) -> str:
    """What kind of JSON value `value` is ("a string", "an object"...), for a message that must not quote it."""
    kind = next((name for cls, name in JSON_KINDS.items() if isinstance(value, cls)), None)
    return kind or ("null" if value is None else type(value).__name__)


def config_rank(config: dict, max_rank: int) -> int:
    """The adapter's rank `r`, checked against the server's `max_lora_rank` (so are the ranks of `rank_pattern`).
    `config` passed `read_adapter_config`."""
    ranks = [config["r"], *(config.get("rank_pattern") or {}).values()]
    if max(ranks) > max_rank:
        raise WeightDirError(
            422, f"adapter rank {max(ranks)} exceeds this server's max_lora_rank {max_rank} (inference [lora])"
        )
    return config["r"]


def pattern_problem(config: dict, layers: list[str]) -> str | None:
    """Why vLLM cannot match the config's rank/alpha patterns against the adapter's `layers`, or None. Compiled and
    matched in a child process, bounded in memory and time (`pattern_check`)."""
    patterns = {field: list(config.get(field) or {}) for field in PATTERN_FIELDS}
    if not any(patterns.values()):
        return None
    command = [
        sys.executable,
        "-P",
        "-c",
        "from prime_rl.inference.adapter_checks import pattern_check; pattern_check()",
    ]
    request = json.dumps({"patterns": patterns, "layers": layers})
    fields = " and ".join(field for field in PATTERN_FIELDS if patterns[field])
    env = child_environment(os.environ)
    try:
        with PATTERN_LOCK:  # one child at a time: concurrent loads cannot add up to many PATTERN_MEMORYs
            done = subprocess.run(
                command, input=request, capture_output=True, text=True, timeout=PATTERN_SECONDS + 10, env=env
            )
    except subprocess.TimeoutExpired:
        return f"{ADAPTER_CONFIG}: compiling and matching {fields} took over {PATTERN_SECONDS + 10}s"
    except OSError as e:
        raise WeightDirError(500, f"could not start the check of {fields}: {clip(e)}") from None
    if done.returncode < 0:  # killed: a pattern's compiling ran out of memory (or stack)
        return f"{ADAPTER_CONFIG}: compiling {fields} took over {PATTERN_MEMORY >> 20} MiB"
    try:
        found = json.loads(done.stdout)
    except ValueError:
        raise WeightDirError(500, f"the check of {fields} failed: {clip(done.stderr[-400:], 400)}") from None
    if found:  # the pattern is named by its place in the file, not quoted
        field = found["field"]
        place = f"{found['index'] + 1} of {len(patterns[field])}"
        return f"{ADAPTER_CONFIG} has a {field} key ({place}) that {clip(found['problem'])}"
    return None


def child_environment(environ: dict[str, str]) -> dict[str, str]:
    """The pattern child's environment: `CHILD_ENVIRONMENT` of `environ`, nothing else."""
    return {key: environ[key] for key in CHILD_ENVIRONMENT if key in environ}


def pattern_check() -> None:
    """The child of `pattern_problem`: reads {"patterns", "layers"} from stdin, writes the first problem found
    ({"field", "index", "problem"}) or {}."""
    resource.setrlimit(resource.RLIMIT_AS, (PATTERN_MEMORY, PATTERN_MEMORY))
    request = json.load(sys.stdin)
    print(json.dumps(first_pattern_problem(request["patterns"], request["layers"], PATTERN_SECONDS) or {}))


def first_pattern_problem(patterns: dict[str, list[str]], layers: list[str], seconds: float) -> dict | None:
    """The first pattern vLLM cannot use, as {"field", "index" (its place among the field's keys), "problem"}. The
    problem says what is wrong without quoting the pattern (a regex error's message may quote part of it)."""
    deadline = time.monotonic() + seconds
    for field, keys in patterns.items():
        for index, key in enumerate(keys):
            found = {"field": field, "index": index}
            try:  # vLLM: re.match(rf"(.*\.)?({key})$", layer) with the `regex` module (PEFTHelper._match_pattern)
                pattern = regex.compile(f"{PATTERN_PREFIX}{key})$")
            except MemoryError:
                return found | {"problem": f"takes over {PATTERN_MEMORY >> 20} MiB to compile"}
            except regex.error as e:
                where = f" at position {max(e.pos - len(PATTERN_PREFIX), 0)}" if isinstance(e.pos, int) else ""
                return found | {"problem": f"is not a valid regex (in `{PATTERN_PREFIX}<key>)$`{where})"}
            except Exception as e:  # whatever else an odd pattern raises
                return found | {"problem": f"is not a valid regex ({type(e).__name__})"}
            for layer in layers:
                try:
                    pattern.match(layer, timeout=max(deadline - time.monotonic(), 0.001))
                except TimeoutError:
                    return found | {"problem": f"takes over {seconds}s to match the layer names"}
                except Exception as e:  # MemoryError, RecursionError
                    return found | {"problem": f"fails to match the layer names ({type(e).__name__})"}
    return None


def tensor_problem(
    specs: dict[str, TensorSpec],
    base: dict[str, TensorSpec],
    max_rank: int,
    modules: set[str] | None,
    rank: int | None,
) -> str | None:
    """Why the adapter's tensors (`specs`) cannot apply to the served model (`base`), or None. `rank`: the rank every
    layer must have (None when `rank_pattern` gives layers their own)."""
    if not specs:
        return f"{ADAPTER_WEIGHTS} holds no tensors"
    pairs: dict[str, dict[str, TensorSpec]] = {}
    copies: dict[str, TensorSpec] = {}
    strange, twice, misnamed = [], [], []
    for name, spec in specs.items():
        if name.startswith(PEFT_PREFIX) and name.endswith(EMBEDDING_COPIES):
            copies[name[len(PEFT_PREFIX) : -len(".base_layer.weight")]] = spec
            continue
        suffix = next((s for s in LORA_SUFFIXES if name.endswith(s)), None)
        if not name.startswith(PEFT_PREFIX) or suffix is None:
            strange.append(name)
            continue
        layer, half = name[len(PEFT_PREFIX) : -len(suffix)], LORA_SUFFIXES[suffix]
        if half in pairs.setdefault(layer, {}):
            twice.append(f"{layer}.{half}")
        if "embedding" in suffix and not is_input_embedding(layer):
            misnamed.append(name)
        pairs[layer][half] = spec
    if strange:
        return (
            f"tensors that are not `{PEFT_PREFIX}<layer>.lora_A/lora_B.weight` (or an embedding's lora_embedding_A/B; "
            f"biases and modules_to_save are not supported): {names(sorted(strange))}"
        )
    if twice:
        return f"tensors given twice (as lora_A/B.weight and as lora_embedding_A/B): {names(sorted(twice))}"
    if misnamed:
        return f"lora_embedding_A/B are an input embedding's ({', '.join(sorted(INPUT_EMBEDDINGS))}): {names(misnamed)}"
    missing = sorted(layer for layer in {*pairs, *copies} if f"{layer}.weight" not in base)
    if missing:
        return f"the served model has no layer {names(missing)}"
    if modules is not None:
        refused = sorted(layer for layer in pairs if layer.rsplit(".", 1)[-1] not in modules)
        if refused:
            return f"vLLM applies LoRA only to {', '.join(sorted(modules))} in this model, not to {names(refused)}"
    wrong = [  # vLLM skips an adapter's copy of an embedding: one that differs in shape (a resized vocabulary) is lost
        f"{layer}.base_layer.weight {spec.shape} is not the served {base[f'{layer}.weight'].shape} (a resized vocabulary)"
        for layer, spec in sorted(copies.items())
        if spec.shape != base[f"{layer}.weight"].shape
    ]
    for layer, pair in sorted(pairs.items()):
        if set(pair) != {"lora_A", "lora_B"}:
            wrong.append(f"{layer}: lora_A and lora_B must both be given")
            continue
        weight, a, b = base[f"{layer}.weight"], pair["lora_A"], pair["lora_B"]
        if len(weight.shape) != 2:
            wrong.append(f"{layer}: its weight has shape {weight.shape}, not [out, in]")
            continue
        embedding = is_input_embedding(layer)
        # A linear weight W [out, in] computes x W^T + x A^T B^T; an embedding [vocab, dim] adds B A[:, t] to row t.
        inner, out = weight.shape if embedding else reversed(weight.shape)
        if (
            len(a.shape) != 2
            or len(b.shape) != 2
            or a.shape[1] != inner
            or b.shape[0] != out
            or a.shape[0] != b.shape[1]
        ):
            kind = "embedding" if embedding else "weight"
            wrong.append(
                f"{layer}: lora_A {a.shape}, lora_B {b.shape} do not fit its {kind} {list(weight.shape)}: "
                f"A [r, {inner}], B [{out}, r]"
            )
        elif a.shape[0] > max_rank or (rank is not None and a.shape[0] != rank):
            wrong.append(f"{layer}: rank {a.shape[0]} (adapter_config r {rank}, server max_lora_rank {max_rank})")
        elif a.dtype not in FLOAT_DTYPES or b.dtype not in FLOAT_DTYPES:
            wrong.append(f"{layer}: dtypes {a.dtype}, {b.dtype} are not floats")
    if wrong:
        return f"tensors that do not fit the served model: {names(wrong, limit=160)}"
    return None


def lora_layers(specs: dict[str, TensorSpec]) -> set[str]:
    """The layers the adapter's LoRA tensors apply to, named as vLLM matches rank/alpha patterns against them."""
    layers = set()
    for name in specs:
        suffix = next((s for s in LORA_SUFFIXES if name.endswith(s)), None)
        if name.startswith(PEFT_PREFIX) and suffix is not None:
            layers.add(name[len(PEFT_PREFIX) : -len(suffix)])
    return layers


def is_input_embedding(layer: str) -> bool:
    return layer.rsplit(".", 1)[-1] in INPUT_EMBEDDINGS
