"""verifiers environments as prime-rl runs them: loading any v1 environment shape, and taking its tasks lazily.

An environment is a taskset plus an `Env` whose config declares one `vf.AgentConfig` field per seat: the single
`agent` of a plain taskset, or several roles of a multi-agent env (self-play seats, a simulated user, a judge).
We never change what an env's author pinned; we only replace verifiers' cloud defaults on every seat: a seat
without its own runtime runs locally (verifiers defaults to a remote sandbox), a seat's tokens are capped at
`seq_len` (the trainer refuses longer samples), and a seat without a harness of its own gets the taskset's
harness, else our in-process `prime-chat` (verifiers' default is a `uv` script per rollout). Every other
environment-level option comes from `env_args`, as verifiers' own `--env.<key>` flags would set it.

Tasks: a finite taskset is read once into JSON task data (the buffer samples and retires tasks by index); an
infinite (procedural) one is read on demand, one new task per group, so a run never generates more tasks than it
rolls out.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from loguru import logger

DEFAULT_HARNESS = "prime-chat"


def _deep_merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        out[key] = _deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def seat_defaults(env, seq_len: int) -> dict[str, dict]:
    """Per seat of the env's config class, what we set on it: local runtime, token cap, default harness."""
    from verifiers.v1 import AgentConfig
    from verifiers.v1.utils.loaders import default_harness_id, env_config_type

    config_cls = env_config_type(env.id, env.env_args.get("id") or "")
    taskset_harness = default_harness_id(env.id)  # the taskset's own harness id, else "bash"
    harness = env.harness or (env.id if taskset_harness == env.id else DEFAULT_HARNESS)
    seats = {}
    for name, field in config_cls.model_fields.items():
        declared = field.default
        if not isinstance(declared, AgentConfig):
            continue
        pinned = declared.model_fields_set
        own_cap = declared.max_total_tokens
        seat: dict[str, Any] = {"max_total_tokens": seq_len if own_cap is None else min(own_cap, seq_len)}
        if "runtime" not in pinned:
            seat["runtime"] = {"type": "subprocess"}
        if declared.harness is None:
            seat["harness"] = {"id": harness}
        seats[name] = seat
    return seats


def env_config_data(env, seq_len: int) -> dict:
    """The verifiers env config for one of our env specs: our seat defaults, then the user's `env_args` on top."""
    data = {"taskset": {"id": env.id, **env.args}, **seat_defaults(env, seq_len)}
    return _deep_merge(data, env.env_args)


def load_env(env, seq_len: int):
    """Load one environment; any failure names the environment and the cause."""
    import verifiers.v1 as vf

    try:
        return vf.load_environment(vf.resolve_env_config(env_config_data(env, seq_len)))
    except Exception as e:
        raise RuntimeError(
            f"environment {env.display_name!r} (id {env.id!r}) failed to load: {type(e).__name__}: {e}"
        ) from e


class EnvTasks:
    """One environment's tasks as JSON task data (what the rollout workers rebuild tasks from).

    Finite tasksets are read in full (`size` tasks, addressed by index); infinite ones are a stream read one task
    at a time by `next()` (`size` is None)."""

    def __init__(self, name: str, taskset, limit: int | None = None):
        self.name = name
        tasks = (t.data.model_dump(mode="json") for t in taskset)
        if not taskset.bounded and limit is None:
            self.items: list[dict] | None = None
            self._stream: Iterator[dict] | None = tasks
            self.drawn = 0
            return
        self.items = list(itertools.islice(tasks, limit))
        self._stream = None
        if not self.items:
            raise RuntimeError(f"environment {name!r} has no tasks")

    @property
    def size(self) -> int | None:
        return None if self.items is None else len(self.items)

    def __getitem__(self, idx: int) -> dict:
        assert self.items is not None, "an infinite taskset has no index"
        return self.items[idx]

    def next(self) -> dict:
        """The next task of an infinite taskset."""
        assert self._stream is not None, "only an infinite taskset is read one task at a time"
        try:
            task = next(self._stream)
        except StopIteration:
            raise RuntimeError(f"environment {self.name!r}: its infinite taskset ran out of tasks") from None
        self.drawn += 1
        return task

    def first(self, count: int) -> list[dict]:
        """The first `count` tasks, without using them up (an infinite stream yields them again)."""
        if self.items is not None:
            return self.items[:count]
        head = list(itertools.islice(self._stream, count))
        self._stream = itertools.chain(head, self._stream)
        return head

    def skip(self, count: int) -> None:
        """Resume an infinite taskset where a checkpoint left it (the tasks before are regenerated, not used)."""
        for _ in range(count):
            self.next()


def load_tasks(envs, seq_len: int, limits: dict[str, int | None] | None = None) -> dict[str, EnvTasks]:
    """Every environment's tasks; `limits` caps how many are read per environment name (eval's num_examples)."""
    tasks = {}
    for env_spec in envs:
        limit = (limits or {}).get(env_spec.display_name)
        env = load_env(env_spec, seq_len)
        tasks[env_spec.display_name] = EnvTasks(env_spec.display_name, env.taskset, limit)
        size = tasks[env_spec.display_name].size
        logger.info(f"environment {env_spec.display_name}: {'infinite taskset' if size is None else f'{size} tasks'}")
    return tasks


def prompt_messages(task: dict) -> list[dict]:
    """The chat messages a task opens with (its system prompt and prompt), as OpenAI JSON."""
    messages = [{"role": "system", "content": task["system_prompt"]}] if task.get("system_prompt") else []
    prompt = task.get("prompt")
    if isinstance(prompt, str):
        messages.append({"role": "user", "content": prompt})
    elif isinstance(prompt, list):
        messages += [m for m in prompt if isinstance(m, dict)]
    return messages


def check_prompts_fit(tasks: dict[str, EnvTasks], model, seq_len: int, max_tokens: int | None) -> None:
    """Refuse, before anything starts, environments whose prompts alone fill `seq_len`: every rollout of them would
    be dropped as too long. Checks the first tasks of each environment, rendered with the model's chat template
    (the renderer may differ by a few scaffold tokens, so only a prompt that leaves no room at all is an error)."""
    from prime_rl.models.tokenizers import load_tokenizer

    try:
        tokenizer = load_tokenizer(model.name, trust_remote_code=model.trust_remote_code)
    except Exception as e:  # a hub id without a hub: the orchestrator's own start will say more
        logger.warning(f"prompt lengths not checked: tokenizer {model.name!r} did not load ({e})")
        return
    for name, env_tasks in tasks.items():
        lengths = []
        for task in env_tasks.first(8):
            messages = prompt_messages(task)
            if messages:
                ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
                lengths.append(len(ids["input_ids"] if hasattr(ids, "keys") else ids))
        if not lengths:
            continue
        longest = max(lengths)
        if longest >= seq_len:
            raise ValueError(
                f"environment {name!r}: its prompts are up to {longest} tokens, which fills seq_len={seq_len} before "
                "the model writes a token, so every rollout would be dropped; raise seq_len"
            )
        if max_tokens is not None and longest + max_tokens > seq_len:
            logger.warning(
                f"environment {name!r}: prompts of up to {longest} tokens + sampling.max_tokens={max_tokens} exceed "
                f"seq_len={seq_len}: a rollout whose reply needs more than the {seq_len - longest} tokens left is dropped "
                "as too long"
            )
