"""Configs written for upstream prime-rl, read here: its two config generations' spellings mapped onto our schema.

A file written for the system we are modelled on (the `rl --trainer @ t --orchestrator @ o` generation of late 2025,
or the one-file generation of 2026 with `[[orchestrator.train.env]]`, `group_size` and `[monitors.wandb]`) is
translated key by key as it is read, before validation. Every translation is reported (one log line per file, and
`--dry-run` prints the config as we read it); a key whose feature we do not have is refused with one line naming
that feature; a key we do not know at all is left for validation, which names it. Nothing is dropped silently: a
key we leave out (because our behaviour already is what it asks for) is reported as such.

Rules are written per *role* (the config of one process: rl, trainer, orchestrator, inference, sft, eval), relative
to where that config sits: `rl`'s orchestrator section gets the same rules as the orchestrator's own file.
docs/configuration.md has the table "upstream key -> ours".
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prime_rl.config.keys import ConfigError, Key

_MISSING = object()

# Where each role's config sits in each entry point's config.
FRAMES: dict[str, dict[Key, str]] = {
    "rl": {(): "rl", ("trainer",): "trainer", ("orchestrator",): "orchestrator", ("inference",): "inference"},
    "trainer": {(): "trainer"},
    "orchestrator": {(): "orchestrator"},
    "inference": {(): "inference"},
    "sft": {(): "sft"},
    "eval": {(): "eval"},
    "synthesize": {(): "eval"},
}

# Runtimes our environments run model-written code in without a sandbox service: verifiers' default.
LOCAL_RUNTIMES = ("subprocess", "local")


def dotted(path: Key) -> str:
    return ".".join(path)


class Translator:
    """One file's data being rewritten: moves, refusals and the notes that report them."""

    def __init__(self, data: dict, origin: str) -> None:
        self.data = copy.deepcopy(data)
        self.origin = origin
        self.notes: list[str] = []
        self.refusals: list[str] = []

    @functools.cached_property
    def layout_2026(self) -> bool:
        """Whether the file is in the 2026 generation's layout: a few keys mean other things in the two."""
        return _is_2026_layout(self.data)

    def get(self, path: Key) -> Any:
        node: Any = self.data
        for part in path:
            if not isinstance(node, dict) or part not in node:
                return _MISSING
            node = node[part]
        return node

    def has(self, path: Key) -> bool:
        return self.get(path) is not _MISSING

    def pop(self, path: Key) -> Any:
        parent = self.get(path[:-1])
        if not isinstance(parent, dict) or path[-1] not in parent:
            return _MISSING
        value = parent.pop(path[-1])
        self._prune(path[:-1])
        return value

    def _prune(self, path: Key) -> None:
        """Drop tables a move left empty (an upstream `[orchestrator.train]` holding only what moved out)."""
        while path and self.get(path) == {}:
            parent = self.get(path[:-1])
            parent.pop(path[-1])
            path = path[:-1]

    def put(self, path: Key, value: Any, src: Key) -> None:
        """Set `path`; the same key set under both spellings in one file is ambiguous."""
        node = self.data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{self.origin}: `{dotted(path[:-1])}` must be a table to take `{dotted(src)}`")
            node = child
        if path[-1] in node and isinstance(node[path[-1]], dict) and isinstance(value, dict):
            for key, item in value.items():
                self.put(path + (key,), item, src + (key,))
            return
        if path[-1] in node and node[path[-1]] != value:
            raise ConfigError(
                f"{self.origin}: `{dotted(src)}` (upstream's spelling) and `{dotted(path)}` are the same setting, "
                "set to different values: keep one"
            )
        node[path[-1]] = value

    def rename(self, src: Key, dst: Key, convert: Callable[[Any], Any] | None = None, why: str = "") -> None:
        value = self.pop(src)
        if value is _MISSING:
            return
        self.put(dst, convert(value) if convert else value, src)
        self.notes.append(f"`{dotted(src)}` -> `{dotted(dst)}`" + (f" ({why})" if why else ""))

    def leave_out(self, path: Key, why: str, when: Callable[[Any], bool] = lambda _: True) -> None:
        """Remove a key that asks for what we do anyway (reported, never silent)."""
        value = self.get(path)
        if value is not _MISSING and when(value):
            self.pop(path)
            self.notes.append(f"`{dotted(path)}` = {value!r} left out: {why}")

    def refuse(self, path: Key, feature: str, when: Callable[[Any], bool] = lambda _: True) -> None:
        value = self.get(path)
        if value is not _MISSING and when(value):
            self.refusals.append(f"`{dotted(path)}` (from {self.origin}): {feature}")


def _is_2026_layout(data: dict) -> bool:
    """Whether a file is in the 2026 generation's layout: it has a key only that generation has and ours never does
    (`group_size`, `[monitors]`, `[orchestrator.renderer]`, `[inference.vllm]`, an environment given by its
    `taskset`). Not `[concurrency]`: ours has it too."""
    orchestrator, inference = data.get("orchestrator"), data.get("inference")
    if isinstance(orchestrator, dict) and "renderer" in orchestrator:
        return True
    if isinstance(inference, dict) and "vllm" in inference:
        return True
    for section in (data, orchestrator):
        if not isinstance(section, dict):
            continue
        if any(key in section for key in ("group_size", "monitors")):
            return True
        for part in ("train", "eval"):
            table = section.get(part)
            if not isinstance(table, dict):
                continue
            items = [item for name in ("env", "source") if isinstance(table.get(name), list) for item in table[name]]
            envs = [
                item.get("env") if isinstance(item.get("env"), dict) else item
                for item in items
                if isinstance(item, dict)
            ]
            if "group_size" in table or any("taskset" in env for env in envs):
                return True
    return False


def _is_on(value: Any) -> bool:
    """An upstream optional section that is set: a table (empty = defaults) or `true`."""
    return value is not False and value is not None


# ---------------------------------------------------------------------------------------------------------------
# Environments: upstream's `[[env]]` (late 2025) and `[[train.env]]` / `[[train.source]]` / `[[source]]` (2026).


def _seat(sub: Translator, at: Key, name: str, seat: dict) -> dict:
    """One seat of upstream's `env` table (`agent`, `player`, `solver`, ...) as verifiers takes it in our `env_args`:
    a `null` harness and a local runtime are our defaults and left out; a sandboxed runtime is refused."""
    seat = dict(seat)
    harness = seat.get("harness")
    if isinstance(harness, dict) and "runtime" in harness:  # `harness = { id, runtime = {...} }`
        harness = dict(harness)
        seat["runtime"] = harness.pop("runtime")
        seat["harness"] = harness
    harness_id = seat["harness"].get("id") if isinstance(seat.get("harness"), dict) else seat.get("harness")
    if "harness" in seat and harness_id in (None, "null", "none") and set(seat["harness"] or {}) <= {"id"}:
        seat.pop("harness")
        sub.notes.append(f"seat `{name}`: harness `null` -> the taskset's own harness (else the in-process chat one)")
    runtime = seat.get("runtime")
    if runtime is not None:
        kind = runtime.get("type") if isinstance(runtime, dict) else runtime
        if kind not in LOCAL_RUNTIMES or (isinstance(runtime, dict) and set(runtime) - {"type"}):
            sub.refusals.append(
                f"`{dotted(at)}` seat `{name}` (from {sub.origin}): sandboxed runtimes ({kind!r}); model-written code "
                "runs in verifiers' local subprocess runtime here"
            )
        else:
            seat.pop("runtime")
            sub.notes.append(f"seat `{name}`: runtime {kind!r} left out: our default")
    return seat


def _env_item(t: Translator, at: Key, item: Any, eval_item: bool) -> Any:
    """One environment entry (at `at`) in our `EnvConfig` / `EvalEnvConfig` shape. 2026's entries carry verifiers'
    env config in `env` (`env.taskset`, one table per seat such as `env.agent.harness`, other env options): the
    taskset becomes `id` and `args`, the rest our `env_args`, which verifiers reads the same way."""
    if not isinstance(item, dict):
        return item
    sub = Translator(item, t.origin)
    env = sub.pop(("env",))
    if env is not _MISSING:
        env = dict(env) if isinstance(env, dict) else {}
        if "taskset" in env:
            sub.put(("taskset",), env.pop("taskset"), ("env", "taskset"))
        for name in ("harness", "runtime"):  # an entry-level shorthand for the `agent` seat
            if name in env:
                env.setdefault("agent", {})[name] = env.pop(name)
        seats = {
            k: _seat(sub, at, k, v) if isinstance(v, dict) and {"harness", "runtime"} & set(v) else v
            for k, v in env.items()
        }
        seats = {k: v for k, v in seats.items() if v != {}}
        if seats:
            sub.put(("env_args",), seats, ("env",))
            sub.notes.append(f"`env` (verifiers' env config) -> `env_args`: {sorted(seats)}")
    for name in ("harness", "runtime"):  # 2026's `harness = {...}` beside `taskset`: the `agent` seat
        value = sub.pop((name,))
        if value is not _MISSING:
            seat = _seat(sub, at, "agent", {name: value})
            if seat:
                sub.put(("env_args", "agent"), seat, (name,))
    taskset = sub.pop(("taskset",))
    if taskset is not _MISSING:
        taskset = dict(taskset) if isinstance(taskset, dict) else {"id": taskset}
        if "id" not in taskset:
            raise ConfigError(f"{t.origin}: `{dotted(at)}.taskset` needs an `id`")
        env_id = taskset.pop("id")
        if isinstance(env_id, str) and (bundled := _bundled_instead(env_id)) is not None:
            sub.notes.append(f"taskset `{env_id}` (not installed) -> `{bundled}`, the environment bundled here")
            env_id = bundled
        sub.put(("id",), env_id, ("taskset", "id"))
        if taskset:
            sub.put(("args",), taskset, ("taskset",))
        sub.notes.append("`taskset.id` -> `id`, its other keys -> `args`" if taskset else "`taskset.id` -> `id`")
    if sub.has(("address",)):
        sub.refusals.append(f"`{dotted(at)}.address` (from {t.origin}): environments served by a separate env server")
    if eval_item:
        sub.refuse(("curriculum",), "a curriculum of an eval environment (curricula are for training environments)")
    else:
        _curriculum(sub, at)
    sub.rename(("weight",), ("ratio",))
    if eval_item:
        sub.rename(("group_size",), ("rollouts_per_example",))
        select = sub.pop(("select",))
        if select is not _MISSING:
            _select(sub, (), select)
    t.notes.extend(f"`{dotted(at)}`: {note}" for note in sub.notes)
    t.refusals.extend(sub.refusals)
    return sub.data


def _curriculum(t: Translator, at: Key) -> None:
    """2026's `curriculum` of one training source: its task `sampler` -> our `sampler` (same `type`s and `pools`),
    its named admission `gates` -> our one `gate` (`reject_min`/`reject_max` -> `low`/`high`). The sampler's `seed`
    was moved to `buffer.seed` before (`_sampler_seeds`)."""
    cur = ("curriculum",)
    if not isinstance(t.get(cur), dict):
        return
    if t.get(cur + ("sampler", "type")) == "standard":
        t.rename(cur + ("sampler",), ("sampler",), why="a uniformly random task here; upstream cycles in source order")
    else:
        t.rename(cur + ("sampler",), ("sampler",))
    gates = t.get(cur + ("gates",))
    if gates == {}:
        t.leave_out(cur + ("gates",), "no gate")
    elif isinstance(gates, dict) and len(gates) > 1:
        t.refusals.append(
            f"`{dotted(at + cur)}.gates` (from {t.origin}): several admission gates on one environment "
            f"({sorted(gates)}; ours: one `gate`)"
        )
    elif isinstance(gates, dict):
        (name, gate), *_ = gates.items()
        t.pop(cur + ("gates",))
        gate = dict(gate) if isinstance(gate, dict) else gate
        for theirs, ours in (("reject_min", "low"), ("reject_max", "high")):
            if isinstance(gate, dict) and theirs in gate:
                gate[ours] = gate.pop(theirs)
        t.put(("gate",), gate, cur + ("gates", name))
        t.notes.append(f"`curriculum.gates.{name}` -> `gate` (`reject_min`/`reject_max` -> `low`/`high`)")


def _sampler_seeds(t: Translator, at: Key) -> None:
    """The seeds of 2026's per-source difficulty-pool samplers -> `buffer.seed`: here one RNG draws every task."""
    seeds = {}
    for name in ("env", "source"):
        items = t.get(at + ("train", name))
        for i, item in enumerate(items if isinstance(items, list) else []):
            curriculum = item.get("curriculum") if isinstance(item, dict) else None
            sampler = curriculum.get("sampler") if isinstance(curriculum, dict) else None
            if isinstance(sampler, dict) and "seed" in sampler:
                seeds[at + ("train", name, f"{i}", "curriculum", "sampler", "seed")] = sampler
    if len({sampler["seed"] for sampler in seeds.values()}) > 1:
        t.refusals.extend(
            f"`{dotted(src)}` (from {t.origin}): task sampler seeds that differ between environments (ours: one "
            "`buffer.seed`)"
            for src in seeds
        )
        return
    for src, sampler in seeds.items():  # in a list item, out of `Translator.rename`'s reach
        t.put(at + ("buffer", "seed"), sampler.pop("seed"), src)
        why = "one RNG draws the tasks of every environment here"
        t.notes.append(f"`{dotted(src)}` -> `{dotted(at + ('buffer', 'seed'))}` ({why})")


def _taskset_installed(env_id: str) -> bool:
    """Whether verifiers would find the taskset `env_id` (its name, `-` as `_`, as a package of its own or one it
    ships), looked up without importing verifiers: loading a config stays fast."""
    module = env_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()
    if importlib.util.find_spec(module) is not None:
        return True
    spec = importlib.util.find_spec("verifiers")
    roots = spec.submodule_search_locations if spec is not None else None
    return any((Path(root) / "v1" / "tasksets" / module).exists() for root in roots or [])


def _bundled_instead(env_id: str) -> str | None:
    """The environment bundled here for a versioned hub id that is not installed (`reverse-text-v1`, which upstream's
    reverse-text example names, -> our `reverse-text`); None where the id is installed or has no such sibling."""
    match = re.fullmatch(r"(?:[\w.-]+/)?([\w.-]+?)-v\d+(?:@.*)?", env_id)
    if match is None or _taskset_installed(env_id) or not _taskset_installed(match.group(1)):
        return None
    return match.group(1)


def _select(t: Translator, at: Key, select: Any) -> None:
    """2026 evals: `select.limit` examples (the env's first ones) -> `num_examples`."""
    if not isinstance(select, dict) or set(select) - {"limit"}:
        t.refusals.append(f"`{dotted(at)}.select` (from {t.origin}): example selection other than `limit`")
        return
    t.put(at + ("num_examples",), select["limit"], at + ("select", "limit"))
    t.notes.append(f"`{dotted(at + ('select', 'limit'))}` -> `{dotted(at + ('num_examples',))}`")


def _env_list(t: Translator, src: Key, dst: Key, eval_item: bool = False) -> None:
    items = t.pop(src)
    if items is _MISSING:
        return
    if not isinstance(items, list):
        raise ConfigError(f"{t.origin}: `{dotted(src)}` must be an array of tables (`[[{dotted(src)}]]`)")
    translated = [_env_item(t, src + (f"{i}",), item, eval_item) for i, item in enumerate(items)]
    if src != dst:
        t.notes.append(f"`[[{dotted(src)}]]` -> `[[{dotted(dst)}]]`")
    t.put(dst, translated, src)


def _sampling(t: Translator, at: Key) -> None:
    t.rename(at + ("max_completion_tokens",), at + ("max_tokens",))


# ---------------------------------------------------------------------------------------------------------------
# Roles.


def _off_policy_bound(t: Translator, at: Key) -> None:
    """The 2026 layout's `max_off_policy_steps` bounds a trained rollout's age (batch n trains none dispatched before
    policy n-1-m): our `max_async_level`. The earlier layout's meant the policies one rollout spans, as ours does."""
    if not t.has(at + ("max_off_policy_steps",)) or not t.layout_2026:
        return
    if any(t.has(where + (name,)) for where in {at, ()} for name in ("max_async_level", "async_level")):
        t.refuse(at + ("max_off_policy_steps",), "a staleness bound apart from the async level (ours is one bound)")
        return
    t.rename(
        at + ("max_off_policy_steps",),
        ("max_async_level",),  # in an `rl` file the shared one, which both processes read
        why="the age bound on trained rollouts; here the rollouts may also run that many steps ahead, upstream 1",
    )


def _orchestrator(t: Translator, at: Key) -> None:
    _off_policy_bound(t, at)
    for src in (at + ("group_size",), at + ("train", "group_size")):
        t.rename(src, at + ("rollouts_per_example",))
    if t.has(at + ("train", "sampling")):
        t.rename(at + ("train", "sampling"), at + ("sampling",))
    _sampling(t, at + ("sampling",))
    _sampler_seeds(t, at)
    for name in ("env", "source"):
        _env_list(t, at + ("train", name), at + ("env",))
    _env_list(t, at + ("env",), at + ("env",))
    t.rename(at + ("renderer",), at + ("model", "renderer"))
    t.rename(at + ("model", "lora", "name"), at + ("adapter", "name"))
    for name in ("use_renderer", "use_token_client"):
        t.leave_out(at + (name,), "requests are always rendered client-side, tokens in and out, here")
    t.refuse(at + ("advantage", "normalize_by_pass_rate"), "advantages scaled by the group's pass rate", bool)
    t.leave_out(at + ("advantage", "normalize_by_pass_rate"), "off", lambda v: not v)
    t.refuse(at + ("wandb", "platform"), "the Prime Intellect platform monitor")
    t.refuse(at + ("model", "client"), "a separate client for the policy model (NVIDIA Dynamo)")
    t.refuse(at + ("sampling", "extra_body"), "extra request-body sampling parameters (`extra_body`)", bool)
    t.leave_out(at + ("sampling", "extra_body"), "empty", lambda v: not v)
    t.refuse(at + ("token_batch_size",), "batches counted in tokens (ours: `batch_size` rollouts)")
    for name, unit in (("max_inflight_rollouts", 1), ("max_inflight_episodes", 1), ("max_inflight_groups", 0)):
        n = t.get(at + (name,))
        if isinstance(n, int) and n >= 1:
            rollouts = n * (_group_size(t, at) if unit == 0 else 1)
            t.rename(
                at + (name,),
                at + ("concurrency",),
                convert=lambda _, r=rollouts: {"min_inflight": r, "max_inflight": r, "initial_inflight": r},
                why="a fixed number in flight",
            )
    t.rename(at + ("async_level",), at + ("max_async_level",))
    t.rename(at + ("oversampling_factor",), at + ("oversampling",))
    t.rename(at + ("lora_name",), at + ("adapter", "name"))
    t.rename(at + ("wandb", "log_extras"), at + ("log_extras",))
    t.leave_out(at + ("seed",), "upstream's orchestrator never read it (our task order: `buffer.seed`)")
    t.leave_out(at + ("advantage", "length_weighted_mean"), "our default", when=lambda v: v is False)
    t.rename(
        at + ("advantage", "length_weighted_mean"),
        at + ("advantage", "estimator"),
        convert=lambda _: "opo",
        why="the length-weighted group mean is our `opo` estimator",
    )
    for fraction in ("easy_fraction", "hard_fraction"):
        t.leave_out(at + ("buffer", fraction), "our default", when=lambda v: v == 0)
        t.refuse(at + ("buffer", fraction), "moving retired easy/hard tasks back on resume is not supported")
    ratios = t.pop(at + ("buffer", "env_ratios"))
    if ratios is not _MISSING:
        envs = t.get(at + ("env",))
        if not isinstance(envs, list) or len(envs) != len(ratios):
            raise ConfigError(f"{t.origin}: `buffer.env_ratios` needs one ratio per `[[env]]`")
        for env, ratio in zip(envs, ratios, strict=True):
            env["ratio"] = ratio
        t.notes.append(f"`{dotted(at + ('buffer', 'env_ratios'))}` -> each `env.ratio`")
    _algo(t, at)
    _online_eval(t, at + ("eval",))
    _validation(t, at)
    for name in ("teacher_model", "teacher"):
        t.refuse(at + (name,), "a teacher model (distillation) is not supported yet")
    t.refuse(
        at + ("training_mode",),
        "training modes other than RL (distillation) are not supported yet",
        lambda v: v != "rl",
    )
    t.leave_out(at + ("training_mode",), "RL")
    t.refuse(at + ("prime_monitor",), "the Prime Intellect platform monitor")
    t.refuse(
        at + ("curriculum",),
        "a curriculum for the whole orchestrator (set it per training source; ours: `buffer.sampler` / `buffer.gate`)",
    )


ALGORITHMS_HERE = ("grpo", "max_rl", "rae", "hierarchical_grpo", "opd", "sft", "opsd", "echo")
"""Upstream's `algo.type`s we run (config/algorithm.py), spelled as upstream spells them."""


def _algo(t: Translator, at: Key) -> None:
    """`[orchestrator.algo]` (2026: `[orchestrator.train.algo]`) is ours too; what only upstream's has is left out where
    it is our behaviour, mapped where we have it, refused otherwise."""
    algo = at + ("algo",)
    t.rename(at + ("train", "algo"), algo)
    value = t.get(algo)
    if not isinstance(value, dict):
        return
    kind = value.get("type", "grpo")
    if kind not in ALGORITHMS_HERE:
        t.refuse(algo, f"the `{kind}` algorithm is not supported")
        return
    if kind == "sft" and isinstance(t.get(algo + ("sampling", "source")), dict):
        t.rename(algo + ("sampling", "source"), algo + ("teacher",), why="sft's teacher is the model that samples")
        t.leave_out(algo + ("sampling",), "empty", when=lambda v: v == {})
    if kind == "opsd":
        t.leave_out(algo + ("renderer",), "the policy's chat template renders the demonstration", when=_auto_renderer)
        t.refuse(algo + ("renderer",), "a renderer for opsd's demonstration other than the policy's chat template")
    if kind == "echo":
        t.refuse(algo + ("filter",), "a user filter on echo's tokens")
    urls = t.get(algo + ("teacher", "base_url"))
    if isinstance(urls, list) and len(urls) == 1:
        t.rename(algo + ("teacher", "base_url"), algo + ("teacher", "base_url"), convert=lambda v: v[0], why="one URL")
    elif isinstance(urls, list):
        t.refuse(algo + ("teacher", "base_url"), "a teacher behind several URLs (ours: one endpoint)")
    t.leave_out(algo + ("sampling",), "the policy samples", when=lambda v: v in ({}, {"source": "policy"}))
    t.refuse(algo + ("sampling",), "sampling from another model than the policy")
    if kind not in ("grpo", "echo"):
        return
    t.leave_out(algo + ("length_weighted_baseline",), "our default", when=lambda v: v is False)
    t.rename(
        algo + ("length_weighted_baseline",),
        at + ("advantage", "estimator"),
        convert=lambda _: "opo",
        why="the length-weighted group mean is our `opo` estimator",
    )
    t.leave_out(algo + ("loss_aggregation",), "every loss token weighs the same here", when=lambda v: v == "token")
    t.leave_out(algo + ("continue_prob",), "off", when=lambda v: v == 0)
    t.leave_out(algo + ("failsafe_min_members",), "groups are trained whole here: no partial group ships early")
    for name, feature in (
        ("loss_aggregation", "prompt-mean loss aggregation"),
        ("continue_prob", "re-sampling groups without a success (Never Give Up)"),
        ("length_penalty", "a length penalty on rewards"),
    ):
        t.refuse(algo + (name,), feature)


def _auto_renderer(value) -> bool:
    return value in ("auto", {}, {"type": "auto"}) or (isinstance(value, dict) and value.get("type") == "auto")


def _common(t: Translator, at: Key) -> None:
    """Keys every process's config may carry."""
    timeout = at + ("weight_broadcast", "timeout")
    value = t.get(timeout)
    if isinstance(value, int | float) and value > 300:
        t.rename(timeout, timeout, convert=lambda _: 300, why=f"{value} s: transfers time out after at most 300 s here")
    t.leave_out(at + ("weight_broadcast", "inference_world_size"), "every server's workers join the transfer here")
    for name in ("clean", "clean_output_dir"):
        t.leave_out(at + (name,), "a run that does not resume clears the previous run's outputs here", bool)
        t.leave_out(at + (name,), "off", lambda v: not v)
    t.refuse(at + ("env_vars",), "per-process environment variables (export them before starting)", bool)
    t.leave_out(at + ("env_vars",), "empty", lambda v: not v)


def _group_size(t: Translator, at: Key) -> int:
    value = t.get(at + ("rollouts_per_example",))
    return value if isinstance(value, int) and value >= 1 else 1


def _per_env_defaults(t: Translator, at: Key, create: bool) -> None:
    """Eval settings both generations give once for all environments (`num_examples`, `select.limit`,
    `rollouts_per_example`, `group_size`), copied into every `env` that does not set its own; `create`: into our
    default environment when none is listed."""
    defaults = {}
    for src, ours in (
        (("num_examples",), "num_examples"),
        (("select", "limit"), "num_examples"),
        (("rollouts_per_example",), "rollouts_per_example"),
        (("group_size",), "rollouts_per_example"),
    ):
        value = t.pop(at + src)
        if value is not _MISSING:
            defaults[ours] = value
            t.notes.append(f"`{dotted(at + src)}` -> every `{dotted(at + ('env', ours))}`")
    envs = t.get(at + ("env",))
    if defaults and envs is _MISSING and create:
        envs = [{}]
        t.put(at + ("env",), envs, at + ("env",))
    for env in envs if isinstance(envs, list) else []:
        for key, value in defaults.items():
            if not (key == "num_examples" and value == -1):  # upstream's "all" is our None
                env.setdefault(key, value)


def _online_eval(t: Translator, ev: Key) -> None:
    """`[orchestrator.eval]` of either generation onto ours (docs/rl.md, "Online evals")."""
    if not isinstance(t.get(ev), dict):
        return
    _sampling(t, ev + ("sampling",))
    for name in ("source", "envs", "env"):
        _env_list(t, ev + (name,), ev + ("env",), eval_item=True)
    _per_env_defaults(t, ev, create=False)
    t.leave_out(ev + ("eval_base_model",), "the policy before step 1 is always evaluated here", lambda v: v is True)
    t.refuse(ev + ("eval_base_model",), "skipping the eval of the policy before step 1 is not supported")
    for name in ("skip_eval_on_resume", "skip_eval_on_restart"):
        t.leave_out(ev + (name,), "a resumed run does not evaluate its resumed step again here", lambda v: v is True)
        t.refuse(ev + (name,), "re-evaluating the resumed step is not supported")
    t.refuse(ev + ("select",), "example selection other than `limit`")


def _validation(t: Translator, at: Key) -> None:
    """The earlier generation's `[val]`: a sample of the training environments, evaluated every `interval` steps;
    here an online eval of each training environment's first `num_examples` tasks, named `<env>-val`."""
    val = t.pop(at + ("val",))
    if val is _MISSING:
        return
    if not isinstance(val, dict) or set(val) - {"num_examples", "rollouts_per_example", "interval"}:
        t.refusals.append(
            f"`{dotted(at + ('val',))}` (from {t.origin}): options other than num_examples, "
            "rollouts_per_example and interval"
        )
        return
    envs = t.get(at + ("env",))
    envs = envs if isinstance(envs, list) else [{"id": "reverse-text"}]
    extra = {k: val[k] for k in ("num_examples", "rollouts_per_example", "interval") if k in val}
    extra.setdefault("num_examples", 16)
    extra.setdefault("interval", 10)
    validation = [
        {
            **{k: e[k] for k in ("id", "args", "harness") if k in e},
            "name": f"{e.get('name', e.get('id', 'reverse-text'))}-val",
            **extra,
        }
        for e in envs
    ]
    current = t.get(at + ("eval", "env"))
    t.pop(at + ("eval", "env"))
    t.put(at + ("eval", "env"), (current if isinstance(current, list) else []) + validation, at + ("val",))
    t.notes.append(
        f"`[{dotted(at + ('val',))}]` -> an online eval of each training environment's first "
        f"{extra['num_examples']} tasks every {extra['interval']} steps (`[[{dotted(at + ('eval', 'env'))}]]` named "
        "`<env>-val`; upstream sampled its eval split)"
    )


def _model(t: Translator, at: Key, seq_len_to: Key | None) -> None:
    """A trainer's (or sft's) `[model]` table."""
    m = at + ("model",)
    if seq_len_to is not None:
        t.rename(m + ("seq_len",), seq_len_to)
    for name in ("ac", "compile"):
        value = t.get(m + (name,))
        if isinstance(value, dict):
            freq, fullgraph = value.get("freq", 1), value.get("fullgraph", False)
            if set(value) - {"freq", "fullgraph"} or freq != 1 or fullgraph:
                t.refusals.append(
                    f"`{dotted(m + (name,))}` (from {t.origin}): only every-layer activation checkpointing and "
                    "per-layer compile (`freq = 1`, `fullgraph = false`) are supported"
                )
                continue
            t.rename(m + (name,), m + (name,), convert=lambda _: True, why="a table means on")
    t.refuse(m + ("ac_offloading",), "activation offloading is not supported", when=_is_on)
    t.rename(m + ("experimental", "lora"), m + ("lora",))
    t.refuse(m + ("lora", "modules_to_save"), "LoRA `modules_to_save` is not supported", when=bool)
    t.leave_out(m + ("lora", "modules_to_save"), "empty", when=lambda v: not v)
    t.rename(m + ("fsdp_cpu_offload",), m + ("cpu_offload",))
    t.rename(m + ("optim_cpu_offload",), at + ("optim", "cpu_offload"))
    t.leave_out(m + ("cp_style",), "context parallelism is Ulysses attention here", lambda v: v == "ulysses")
    t.refuse(m + ("cp_style",), "ring-attention context parallelism (ours: Ulysses)")
    t.leave_out(m + ("reshard_after_forward",), "our FSDP2 always reshards after forward", when=lambda v: v is True)
    t.refuse(m + ("reshard_after_forward",), "keeping parameters gathered after forward is not supported")
    for name, feature in (
        ("ep", "MoE expert parallelism"),
        ("tp", "tensor parallelism in the trainer"),
        ("dp_replicate", "replicated data parallelism (HSDP)"),
    ):
        t.leave_out(m + (name,), "1 is ours", when=lambda v: v == 1)
        t.refuse(m + (name,), f"{feature} is not supported")
    t.leave_out(
        m + ("impl",),
        "the Hugging Face implementation runs here (same math, no custom kernels)",
        when=lambda v: v in ("auto", "hf", "liger_kernel", "custom"),
    )
    for name in ("optimization_dtype", "reduce_dtype"):
        t.leave_out(m + (name,), "master weights and gradient reduction are float32 here", lambda v: v == "float32")
        t.refuse(m + (name,), "low-precision master weights or gradient reduction are not supported")
    t.leave_out(m + ("moe_use_grouped_mm",), "a MoE kernel choice; no effect here")
    t.leave_out(m + ("load_using_meta",), "a loading shortcut; the weights are the same")
    t.rename(m + ("fused_lm_head_token_chunk_size",), m + ("logprob_chunk",), why="positions per LM-head chunk")
    attn = t.get(m + ("attn",))
    if attn in ("flash_attention_3", "flash_attention_4", "fa3", "fa4", "auto"):
        t.rename(m + ("attn",), m + ("attn",), convert=lambda _: "sdpa", why="same attention, another kernel")
    if t.has(m + ("cp",)) and t.get(m + ("cp",)) != 1:
        t.notes.append(f"`{dotted(m + ('cp',))}`: context parallelism runs Ulysses attention here (upstream: ring)")
    t.refuse(m + ("debug",), "the debug model options (truncated layers, random init: use `model.random_init`)")
    for name in ("fp8", "float8", "mxfp8"):
        t.refuse(m + (name,), "FP8 training is not supported")


def _trainer(t: Translator, at: Key) -> None:
    _model(t, at, at + ("seq_len",))
    t.rename(at + ("async_level",), at + ("max_async_level",))
    t.refuse(at + ("data", "fake"), "fake data in the RL trainer (use `bench`)", when=_is_on)
    for name in ("memory_profiler_path", "trace_path"):
        t.refuse(at + (name,), "profiler traces are not supported (see benchmarks/)")
    t.refuse(at + ("heartbeat",), "heartbeat URLs are not supported")
    t.leave_out(at + ("wandb", "log_extras"), "the trainer logs no samples")
    t.leave_out(at + ("dist_timeout_seconds",), "our collectives time out after at most 300 s", lambda v: v <= 300)
    t.refuse(at + ("dist_timeout_seconds",), "collective timeouts above 300 s (ours are capped at 300)")
    optim = t.get(at + ("optim", "type"))
    t.refuse(at + ("optim", "type"), f"the {optim!r} optimizer (ours: adamw, sgd)", lambda v: v not in ("adamw", "sgd"))
    for name in ("skip_optimizer", "skip_gather_master_weights", "skip_progress", "skip_scheduler", "skip_dataloader"):
        t.refuse(at + ("ckpt", name), "loading part of a checkpoint (`skip_*`)", bool)
        t.leave_out(at + ("ckpt", name), "off", lambda v: not v)
    t.leave_out(at + ("weight_broadcast", "adapter_only"), "a LoRA run sends only its adapter here", bool)
    t.refuse(at + ("loss", "teacher_tau"), "a teacher model (distillation) is not supported yet", bool)
    t.leave_out(at + ("loss", "teacher_tau"), "0: no teacher", lambda v: not v)
    for name in ("use_routing_replay", "recompute_logprobs", "enable_router_replay"):
        t.refuse(at + (name,), "MoE router replay is not supported", when=bool)
        t.leave_out(at + (name,), "off", when=lambda v: not v)


_VLLM_KEYS: dict[str, Key] = {
    "model": ("model", "name"),
    "served_model_name": ("model", "served_name"),
    "trust_remote_code": ("model", "trust_remote_code"),
    "dtype": ("model", "dtype"),
    "max_model_len": ("model", "max_model_len"),
    "enforce_eager": ("model", "enforce_eager"),
    "tensor_parallel_size": ("parallel", "tp"),
    "data_parallel_size": ("parallel", "dp"),
    "gpu_memory_utilization": ("gpu_memory_utilization",),
    "max_num_seqs": ("max_num_seqs",),
    "seed": ("seed",),
    "max_loras": ("lora", "max_loras"),
    "max_lora_rank": ("lora", "max_lora_rank"),
    "host": ("server", "host"),
    "port": ("server", "port"),
}
_CLIENT_SIDE = "tool calls and reasoning are parsed client-side by the renderer here"


def _inference(t: Translator, at: Key) -> None:
    vllm = at + ("vllm",)
    for name, ours in _VLLM_KEYS.items():
        t.rename(vllm + (name,), at + ours)
    for src in (vllm, at + ("model",), at):
        for name in ("tool_call_parser", "enable_auto_tool_choice", "reasoning_parser"):
            t.leave_out(src + (name,), _CLIENT_SIDE)
        t.leave_out(src + ("enable_lora",), "adapters are enabled by `[inference.lora]`", lambda v: not v)
        t.rename(src + ("enable_lora",), at + ("lora",), convert=lambda _: {}, why="a `[lora]` table enables it")
        t.leave_out(src + ("max_cpu_loras",), "adapters are kept in CPU memory as vLLM's default allows")
        t.leave_out(src + ("api_server_count",), "one API server", lambda v: v == 1)
        t.refuse(src + ("rope_scaling",), "RoPE scaling overrides are not supported", when=_is_on)
        t.leave_out(src + ("rope_scaling",), "unset", when=lambda v: not _is_on(v))
        t.refuse(src + ("kv_cache_dtype",), "FP8 KV caches are not supported", lambda v: str(v).startswith("fp8"))
        t.refuse(src + ("quantization",), "quantized serving (FP8, NVFP4, ...) is not supported", when=_is_on)
    for name in ("max_loras", "max_lora_rank"):
        t.rename(at + (name,), at + ("lora", name))
    t.leave_out(at + ("backend",), "vLLM", lambda v: v == "vllm")
    t.refuse(at + ("backend",), "serving backends other than vLLM (Dynamo, SGLang)")
    t.leave_out(at + ("renderer",), "the renderer is the orchestrator's (`orchestrator.model.renderer`)")
    t.refuse(at + ("enable_return_routed_experts",), "MoE router replay is not supported", bool)
    for name, feature in (
        ("pd", "prefill/decode disaggregation"),
        ("disaggregation", "prefill/decode disaggregation"),
        ("router", "an inference router (vllm-router, llm-d)"),
        ("kv_offload", "KV-cache offload"),
        ("dynamo", "NVIDIA Dynamo serving"),
    ):
        t.refuse(at + (name,), f"{feature} is not supported")
        t.refuse(vllm + (name,), f"{feature} is not supported")


def _resume(t: Translator, at: Key) -> None:
    """2026's `[resume]` (empty: the latest checkpoint; `step = n`) -> `ckpt.resume_step`."""
    resume = t.get(at + ("resume",))
    if resume is _MISSING:
        return
    if resume is True:
        resume = {}
    if not isinstance(resume, dict) or set(resume) - {"step"}:
        t.refuse(
            at + ("resume",),
            "resuming from another run's checkpoint directory (`resume.dir`); copy it into "
            "this run's `checkpoints/` and set `ckpt.resume_step`",
        )
        return
    step = resume.get("step")
    t.rename(
        at + ("resume",),
        at + ("ckpt", "resume_step"),
        convert=lambda _: -1 if step is None else step,
        why="the latest checkpoint" if step is None else "",
    )


def _slurm(t: Translator, at: Key) -> None:
    """2026's `[slurm]` and multi-node `[deployment]` -> our `[slurm]` (deploy/slurm/rl.sbatch)."""
    dep, slurm = at + ("deployment",), at + ("slurm",)
    if t.get(dep + ("type",)) == "multi_node":
        t.pop(dep + ("type",))
        if t.get(dep + ("num_infer_nodes",)) in (0, _MISSING):
            t.refusals.append(f"`{dotted(dep)}` (from {t.origin}): a multi-node run without inference nodes")  # fmt: skip
        if t.refusals:
            return
        train, infer = t.pop(dep + ("num_train_nodes",)), t.pop(dep + ("num_infer_nodes",))
        if not isinstance(train, int) or not isinstance(infer, int) or train < 1 or infer < 1:
            raise ConfigError(
                f"{t.origin}: a multi-node `deployment` needs num_train_nodes >= 1 and num_infer_nodes >= 1"
            )
        t.put(slurm + ("nodes",), train + infer, dep + ("num_train_nodes",))
        t.put(slurm + ("inference_nodes",), infer, dep + ("num_infer_nodes",))
        t.notes.append(f"multi-node `deployment` -> `slurm.nodes = {train + infer}`, `slurm.inference_nodes = {infer}`")
        t.refuse(dep + ("num_infer_replicas",), "several inference replicas behind a router", lambda v: v != 1)
        t.leave_out(dep + ("num_infer_replicas",), "one replica")
        t.refuse(dep + ("nodes_per_fsdp_group",), "FSDP islands (HSDP) are not supported")
        t.leave_out(dep + ("orchestrator_on_inference",), "the orchestrator runs on inference node 0 here")
    elif t.get(dep + ("type",)) == "single_node":
        t.leave_out(dep + ("type",), "one node")
    if not t.has(slurm):
        t.leave_out(dep + ("gpus_per_node",), "a run on this host uses `trainer_gpu_ids` / `inference_gpu_ids`")
        return
    t.rename(dep + ("gpus_per_node",), slurm + ("gpus_per_node",))
    t.leave_out(slurm + ("project_dir",), "the job runs in the directory `rl` was called from", lambda v: v == ".")
    t.refuse(slurm + ("project_dir",), "a project directory other than the current one")
    t.refuse(slurm + ("template_path",), "custom SLURM templates (ours: deploy/slurm/rl.sbatch)")
    t.refuse(slurm + ("pre_run_command",), "a command before the run (put it in a wrapper of `sbatch`: `slurm.sbatch`)")
    t.leave_out(slurm + ("launch_modelexpress",), "no NIXL weight transfer here")
    t.leave_out(slurm + ("cleanup_grace_period",), "the job stops as soon as a node's run fails")
    t.leave_out(slurm + ("shared_fs",), "the output dir must be on a shared filesystem here", lambda v: v is True)
    t.refuse(slurm + ("shared_fs",), "node-local virtual environments")


def _rl(t: Translator, at: Key) -> None:
    t.rename(at + ("monitors", "wandb"), at + ("wandb",))
    t.refuse(at + ("monitors",), "monitors other than W&B (use `tensorboard` for a local one)")
    t.refuse(
        at + ("deployment", "num_infer_gpus"),
        "a run without an inference server of its own (here: "
        "`--no-inference` and the servers' URLs in `orchestrator.client.base_url`)",
        lambda v: v == 0,
    )
    t.refuse(at + ("k8s",), "Kubernetes settings in the run's config (use the Helm chart, deploy/helm)")
    if t.refusals:
        return
    for name in ("num_train_gpus", "num_infer_gpus"):
        count = t.get(at + ("deployment", name))
        if count is not _MISSING and (not isinstance(count, int) or count < 1):
            raise ConfigError(f"{t.origin}: `deployment.{name}` must be a positive integer, got {count!r}")
    infer = t.pop(at + ("deployment", "num_infer_gpus"))
    train = t.pop(at + ("deployment", "num_train_gpus"))
    if infer is not _MISSING or train is not _MISSING:
        infer = 1 if infer is _MISSING else infer
        train = 1 if train is _MISSING else train
        t.put(at + ("inference_gpu_ids",), list(range(infer)), ("deployment", "num_infer_gpus"))
        t.put(at + ("trainer_gpu_ids",), list(range(infer, infer + train)), ("deployment", "num_train_gpus"))
        t.notes.append(
            f"`deployment.num_infer_gpus`/`num_train_gpus` -> `inference_gpu_ids = {list(range(infer))}`, "
            f"`trainer_gpu_ids = {list(range(infer, infer + train))}` (on CPU: {train} trainer rank(s))"
        )
    t.refuse(at + ("deployment", "num_teacher_gpus"), "a teacher server (distillation) is not supported yet")
    t.refuse(at + ("teacher_gpu_ids",), "a teacher server (distillation) is not supported yet")
    t.refuse(at + ("teacher_inference",), "a teacher server (distillation) is not supported yet")
    _slurm(t, at)
    t.rename(at + ("async_level",), at + ("max_async_level",))
    t.leave_out(at + ("max_model_len",), "upstream never read it")
    _resume(t, at)


def _sft(t: Translator, at: Key) -> None:
    _model(t, at, at + ("seq_len",))
    data = at + ("data",)
    t.rename(data + ("seq_len",), at + ("seq_len",))
    t.rename(data + ("batch_size",), at + ("batch_size",))
    t.rename(data + ("micro-batch-size",), data + ("micro_batch_size",))
    micro = t.pop(data + ("micro_batch_size",))
    if micro is not _MISSING:
        seq_len = t.get(at + ("seq_len",))
        if not isinstance(seq_len, int):
            raise ConfigError(f"{t.origin}: `data.micro_batch_size` needs `seq_len` (tokens per micro-batch here)")
        t.put(at + ("micro_batch_tokens",), micro * seq_len, data + ("micro_batch_size",))
        t.notes.append(
            f"`data.micro_batch_size` = {micro} -> `micro_batch_tokens` = {micro * seq_len} (samples x seq_len: "
            "micro-batches are packed by tokens here)"
        )
    fake = t.get(data + ("fake",))
    t.refuse(data + ("fake",), "variable-length fake SFT data (ours: full rows)", lambda v: v == "variable")
    if isinstance(fake, str) and fake != "variable":  # the earlier `fake = "fixed"`: full rows of random tokens
        t.pop(data + ("fake",))
        t.put(data + ("type",), "fake", data + ("fake",))
        t.notes.append(f'`data.fake = {fake!r}` -> `data.type = "fake"`')
    elif isinstance(fake, dict):
        t.pop(data + ("fake",))
        t.put(data + ("type",), "fake", data + ("fake",))
        for name in ("batch_size", "seq_len"):
            if name in fake:
                t.put(at + (name,), fake.pop(name), data + ("fake", name))
        if fake:
            t.refusals.append(f"`{dotted(data + ('fake',))}` (from {t.origin}): fake-data options {sorted(fake)}")
        t.notes.append('`[data.fake]` -> `data.type = "fake"`')
    sources = t.get(data + ("source",))
    if isinstance(sources, list) and len(sources) == 1 and isinstance(sources[0], dict):
        source = dict(sources[0])
        t.pop(data + ("source",))
        for theirs, ours in (("dataset", "name"), ("name", "name"), ("split", "split")):
            if theirs in source:
                t.put(data + (ours,), source.pop(theirs), data + ("source", "0", theirs))
        if source:
            t.refusals.append(f"`{dotted(data + ('source',))}` (from {t.origin}): dataset options {sorted(source)}")
        t.notes.append(f"`[[{dotted(data + ('source',))}]]` -> `{dotted(data + ('name',))}`")
    t.refuse(data + ("source",), "several SFT datasets in one run (mix them into one dataset)")
    t.rename(at + ("renderer",), data + ("renderer",))
    t.refuse(
        at + ("eval",),
        'evals during `sft` as a table (`[[eval.source]]`, `interval`, sampling): here `eval = "eval.toml"` names an '
        "`eval` config file, which evaluates each `weights/step_n` export (`weights_interval`) while sft trains",
        lambda v: isinstance(v, dict),  # a path is our own key
    )
    t.refuse(at + ("slurm",), "SLURM submission of `sft` from its config (use `sbatch` with `torchrun ... sft`)")
    t.leave_out(at + ("deployment", "type"), "one node", lambda v: v == "single_node")
    t.leave_out(at + ("deployment", "gpus_per_node"), "sft's ranks are torchrun's `--nproc-per-node` here")
    t.leave_out(at + ("inference",), "only used by evals during sft", when=lambda v: v == {})
    for name in ("num_train_gpus", "num_infer_gpus"):
        t.leave_out(at + ("deployment", name), "sft's ranks are torchrun's `--nproc-per-node` here")
    t.rename(at + ("monitors", "wandb"), at + ("wandb",))
    _resume(t, at)


def _eval(t: Translator, at: Key) -> None:
    model = t.get(at + ("model",))
    if isinstance(model, str):
        t.rename(at + ("model",), at + ("model", "name"))
    t.rename(at + ("renderer",), at + ("model", "renderer"))
    _sampling(t, at + ("sampling",))
    for name in ("source", "environment"):
        _env_list(t, at + (name,), at + ("env",), eval_item=True)
    _env_list(t, at + ("env",), at + ("env",), eval_item=True)
    _per_env_defaults(t, at, create=True)
    concurrency = t.get(at + ("concurrency",))
    if isinstance(concurrency, dict) and set(concurrency) <= {"min_inflight", "max_inflight", "initial_inflight"}:
        most = concurrency.get("max_inflight") or concurrency.get("initial_inflight")
        t.pop(at + ("concurrency",))
        if isinstance(most, int) and most >= 1:
            envs = t.get(at + ("env",))
            group = max([e.get("rollouts_per_example", 1) for e in envs] if isinstance(envs, list) else [1])
            t.put(at + ("max_concurrent",), max(1, -(-most // group)), at + ("concurrency",))
            t.notes.append(
                f"`concurrency.max_inflight` = {most} rollouts -> `max_concurrent` = {max(1, -(-most // group))} "
                "groups (eval keeps a fixed number in flight)"
            )
    t.refuse(at + ("select",), "example selection other than `limit`")
    t.refuse(at + ("save", "hf"), "pushing results to the Hugging Face hub is not supported", when=_is_on)
    t.refuse(at + ("save", "env_hub"), "uploading results to the Environments Hub is not supported", when=bool)


ROLES: dict[str, Callable[[Translator, Key], None]] = {
    "rl": _rl,
    "trainer": _trainer,
    "orchestrator": _orchestrator,
    "inference": _inference,
    "sft": _sft,
    "eval": _eval,
}


CKPT_SECTIONS: list[Key] = [(), ("trainer",), ("orchestrator",)]


def _same_key_other_meaning(t: Translator, empty_ckpt: list[Key]) -> None:
    """Keys both systems spell alike but read differently, in a file that is in upstream's spelling: we adopt
    upstream's meaning where ours has it, and say so. `empty_ckpt`: where the file had an empty `[ckpt]`."""
    for at in empty_ckpt:
        if isinstance(t.get(at + ("ckpt",)), dict) and not t.has(at + ("ckpt", "interval")):
            t.put(at + ("ckpt", "interval"), 0, at + ("ckpt",))
            t.notes.append(f"empty `[{dotted(at + ('ckpt',))}]` -> `interval = 0`: saved after the last step only")


def _sections_win_over_seq_len(t: Translator) -> None:
    """In an upstream `rl` file, a section's own `seq_len` wins over the shared one, which fills only the others."""
    shared = t.get(("seq_len",))
    own = [at for at in (("trainer",), ("orchestrator",)) if t.has(at + ("seq_len",))]
    if isinstance(shared, int) and own:
        t.pop(("seq_len",))
        for at in (("trainer",), ("orchestrator",)):
            if at not in own:
                t.put(at + ("seq_len",), shared, ("seq_len",))
        t.notes.append(
            f"`seq_len` = {shared} fills the sections that set none ({', '.join(dotted(a) for a in own)} set their own)"
        )


def translate(entrypoint: str, data: dict, origin: str) -> tuple[dict, list[str]]:
    """`data` (one file's values, already placed where they load) with upstream's spellings in ours; returns it
    with one note per translation. Raises `ConfigError` naming every refused key's feature."""
    t = Translator(data, origin)
    empty_ckpt = [at for at in CKPT_SECTIONS if t.get(at + ("ckpt",)) == {}]
    for at, role in FRAMES.get(entrypoint, {}).items():
        if at == () or t.has(at):
            if at and not isinstance(t.get(at), dict):
                continue
            ROLES[role](t, at)
            _common(t, at)
    if t.notes:  # this file is in upstream's spelling
        if entrypoint == "rl":
            _sections_win_over_seq_len(t)
        _same_key_other_meaning(t, empty_ckpt)
    if t.refusals:
        raise ConfigError("not supported here:\n  " + "\n  ".join(t.refusals))
    return t.data, t.notes
