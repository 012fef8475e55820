"""Task sampling and group admission for the orchestrator.

The orchestrator owns the task objects; the buffer only deals in `(env_name, task_idx)` pairs with
`task_idx` in `0..env_sizes[env] - 1`, plus the rewards of finished groups. It decides two things:

- which task to roll out next: an environment drawn by its ratio, then an active task of it as the environment's
  sampler picks it (`standard`: uniformly at random; `difficulty_pool`: weighted by the pool of its latest group
  mean reward, see curriculum.py);
- whether a finished group goes into training (online difficulty filtering), and whether its task is
  retired for good because it has become too easy or too hard to teach anything (thresholds).

Sampling is O(number of envs) per call whatever the number of tasks: each env keeps its active tasks in
a list plus a position map, so a task is retired in O(1) by swapping it with the last one and popping.

An environment of size None is an infinite (procedural) taskset: every draw is a new task (index 0, 1, 2, ...
in generation order), never retired; mixed with other environments it needs a `ratio`.
"""

import math
import random
from typing import Any, Literal

from loguru import logger

from prime_rl.config.curriculum import UNSEEN, DifficultyPoolSampler, SamplerConfig
from prime_rl.config.orchestrator import BufferConfig
from prime_rl.orchestrator.curriculum import DifficultyPools

GroupStatus = Literal["kept", "filtered_easy", "filtered_hard"]

_COUNTERS = ("filtered/easy", "filtered/hard", "retired/easy", "retired/hard")


def group_status(rewards: list[float], online_difficulty_filtering: bool) -> GroupStatus:
    """Whether a group is trained on: all-solved and all-failed groups teach nothing and are filtered."""
    if online_difficulty_filtering:
        if min(rewards) >= 1.0:
            return "filtered_easy"
        if max(rewards) <= 0.0:
            return "filtered_hard"
    return "kept"


class Buffer:
    """Samples tasks across environments and retires the ones that stopped giving signal.

    `env_ratios` (owned by the env configs, hence not in `BufferConfig`) weights the environments;
    they are normalised and must be positive with exactly the env names as keys. Without them an env
    is picked in proportion to its number of active tasks, i.e. uniformly over all active tasks.
    `samplers` (per env, also from the env configs) picks the task within an env; default `config.sampler`.
    """

    def __init__(
        self,
        config: BufferConfig,
        env_sizes: dict[str, int | None],
        env_ratios: dict[str, float] | None = None,
        samplers: dict[str, SamplerConfig] | None = None,
    ):
        if not env_sizes:
            raise ValueError("the buffer needs at least one environment")
        for env, size in env_sizes.items():
            if size is not None and size < 1:
                raise ValueError(f"environment {env!r} has {size} tasks; every environment needs at least one")
        infinite = [env for env, size in env_sizes.items() if size is None]
        if infinite and len(env_sizes) > 1 and env_ratios is None:
            raise ValueError(f"environments {infinite} have infinite tasksets: set a `ratio` on every environment")
        self.config = config
        self.env_sizes = dict(env_sizes)
        self._envs = list(env_sizes)
        self._ratios = _normalised_ratios(env_ratios, self._envs) if env_ratios is not None else None
        self._rng = random.Random(config.seed)
        # Per env: active task indices (any order) and each task's position in it (-1 once retired).
        self._active = {env: list(range(size or 0)) for env, size in env_sizes.items()}
        self._position = {env: list(range(size or 0)) for env, size in env_sizes.items()}
        # Per infinite env: tasks drawn so far (the next draw is task number `drawn`).
        self._drawn = dict.fromkeys(infinite, 0)
        # Per env, in retirement order.
        self._easy: dict[str, list[int]] = {env: [] for env in self._envs}
        self._hard: dict[str, list[int]] = {env: [] for env in self._envs}
        self._counters = dict.fromkeys(_COUNTERS, 0)
        # Per env with a difficulty-pool sampler: the pools of its active tasks.
        self._pools: dict[str, DifficultyPools] = {}
        for env in self._envs:
            sampler = (samplers or {}).get(env, config.sampler)
            if isinstance(sampler, DifficultyPoolSampler):
                if env in self._drawn:
                    raise ValueError(f"environment {env!r} has an infinite taskset: the difficulty_pool sampler needs "
                                     "a finite one (every task's latest reward)")  # fmt: skip
                self._pools[env] = DifficultyPools(sampler, env_sizes[env])

    def sample_task(self) -> tuple[str, int]:
        """Env chosen with probability proportional to its ratio (None: to its number of *active* tasks),
        among envs that still have active tasks; then a uniformly random active task of that env (with
        replacement across calls)."""
        total = 0.0
        for i, env in enumerate(self._envs):
            if self._has_tasks(env):
                total += self._env_weight(i, env)
        if total <= 0.0:
            zero = f" or in difficulty pools of weight 0 ({sorted(self._pools)})" if self._pools else ""
            raise RuntimeError(
                f"every task of every environment was retired{zero} (easy_threshold="
                f"{self.config.easy_threshold}, hard_threshold={self.config.hard_threshold}); nothing left to "
                "sample: loosen or unset the thresholds"
            )
        target = self._rng.random() * total
        chosen = None
        for i, env in enumerate(self._envs):
            if not self._has_tasks(env):
                continue
            chosen = env  # The last eligible env also absorbs float rounding at the top of the range.
            target -= self._env_weight(i, env)
            if target < 0.0:
                break
        assert chosen is not None
        if chosen in self._drawn:
            self._drawn[chosen] += 1
            return chosen, self._drawn[chosen] - 1
        if chosen in self._pools:
            return chosen, self._pools[chosen].draw(self._rng)
        active = self._active[chosen]
        return chosen, active[self._rng.randrange(len(active))]

    def add_group(self, env: str, task_idx: int, rewards: list[float]) -> GroupStatus:
        """Record a finished group's rewards: "kept", or "filtered_easy" / "filtered_hard" (do not train on it).

        A mean reward >= `easy_threshold` (<= `hard_threshold`) retires the task into the easy (hard)
        pool, whatever the filtering outcome. A group of an already retired task (sampled before its
        retirement, still in flight) is still classified but changes no pool.
        """
        self._check_task(env, task_idx)
        if not rewards:
            raise ValueError(f"group of task {task_idx} of {env!r} has no rewards")
        if not all(math.isfinite(r) for r in rewards):
            raise ValueError(f"group of task {task_idx} of {env!r} has non-finite rewards: {rewards}")
        status = group_status(rewards, self.config.online_difficulty_filtering)
        if status == "filtered_easy":
            self._counters["filtered/easy"] += 1
        elif status == "filtered_hard":
            self._counters["filtered/hard"] += 1

        if env not in self._drawn and self._position[env][task_idx] >= 0:
            mean = sum(rewards) / len(rewards)
            if env in self._pools:
                self._pools[env].observe(task_idx, mean)
            easy, hard = self.config.easy_threshold, self.config.hard_threshold
            if easy is not None and mean >= easy:
                self._retire(env, task_idx)
                self._easy[env].append(task_idx)
                self._counters["retired/easy"] += 1
            elif hard is not None and mean <= hard:
                self._retire(env, task_idx)
                self._hard[env].append(task_idx)
                self._counters["retired/hard"] += 1
        return status

    def metrics(self) -> dict[str, float]:
        """Filter / retirement counts since the last `reset_step_metrics`, and current pool sizes."""
        out = {name: float(count) for name, count in self._counters.items()}
        out["pool/active"] = float(sum(len(a) for a in self._active.values()))
        out["pool/easy"] = float(sum(len(e) for e in self._easy.values()))
        out["pool/hard"] = float(sum(len(h) for h in self._hard.values()))
        for env in self._envs:
            if env in self._drawn:
                out[f"tasks_drawn/{env}"] = float(self._drawn[env])
            else:
                out[f"pool/active/{env}"] = float(len(self._active[env]))
        return out

    def curriculum_metrics(self) -> dict[str, float]:
        """Active tasks per pool of each difficulty-pool environment: `curriculum/<env>/pool/<name>`."""
        return {
            f"curriculum/{env}/pool/{name}": float(n)
            for env, pools in self._pools.items()
            for name, n in pools.sizes().items()
        }

    def reset_step_metrics(self) -> None:
        self._counters = dict.fromkeys(_COUNTERS, 0)

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: per env its pools, the RNG state and the step counters.

        The active list is stored in its current order (not rebuilt from the retired lists on load)
        because swap-pop retirement makes that order depend on the retirement history, and the order
        decides which task a given random draw picks.
        """
        version, internal, gauss_next = self._rng.getstate()
        return {
            "envs": {
                env: {
                    "size": self.env_sizes[env],
                    "active": list(self._active[env]),
                    "easy": list(self._easy[env]),
                    "hard": list(self._hard[env]),
                    **({"drawn": self._drawn[env]} if env in self._drawn else {}),
                    **({"difficulty_pools": self._pools[env].state_dict()} if env in self._pools else {}),
                }
                for env in self._envs
            },
            "rng": [version, list(internal), gauss_next],
            "counters": dict(self._counters),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict`; sampling then continues exactly as it would have without the round trip.

        The environments and their sizes must match the ones this buffer was built with, since task
        indices are only meaningful against the same task lists.
        """
        envs = state["envs"]
        if set(envs) != set(self._envs):
            raise ValueError(f"state has environments {sorted(envs)}, this buffer has {sorted(self._envs)}")
        for env in self._envs:
            env_state = envs[env]
            size = self.env_sizes[env]
            if env_state["size"] != size:
                raise ValueError(f"environment {env!r} has {size} tasks, the state was saved with {env_state['size']}")
            if size is None:
                self._drawn[env] = int(env_state["drawn"])
                continue
            active, easy, hard = list(env_state["active"]), list(env_state["easy"]), list(env_state["hard"])
            if sorted(active + easy + hard) != list(range(size)):
                raise ValueError(f"state of environment {env!r} does not split tasks 0..{size - 1} into pools")
            position = [-1] * size
            for i, task_idx in enumerate(active):
                position[task_idx] = i
            self._active[env], self._position[env] = active, position
            self._easy[env], self._hard[env] = easy, hard
            if env in self._pools:
                saved = env_state.get("difficulty_pools")
                if saved is None:
                    logger.warning(f"checkpoint has no difficulty pools of {env!r}: its active tasks start unseen")
                    empty = dict.fromkeys(self._pools[env].sizes(), [])
                    saved = {"rewards": [None] * size, "pools": {**empty, UNSEEN: active}}
                self._pools[env].load_state_dict(saved, active)
                if "difficulty_pools" in env_state:
                    logger.info(f"difficulty pools of {env} restored: {self._pools[env].summary()}")
        version, internal, gauss_next = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss_next))
        self._counters = {name: int(state["counters"][name]) for name in _COUNTERS}

    def drawn(self, env: str) -> int:
        """Tasks drawn so far from an infinite environment (where a resumed run continues its stream)."""
        return self._drawn[env]

    def _has_tasks(self, env: str) -> bool:
        if env in self._pools:
            return self._pools[env].total_weight() > 0
        return env in self._drawn or bool(self._active[env])

    def _env_weight(self, i: int, env: str) -> float:
        if self._ratios is not None:
            return self._ratios[i]
        return 1.0 if env in self._drawn else float(len(self._active[env]))

    def _check_task(self, env: str, task_idx: int) -> None:
        if env not in self.env_sizes:
            raise ValueError(f"unknown environment {env!r}; known: {self._envs}")
        limit = self._drawn[env] if env in self._drawn else self.env_sizes[env]
        if not 0 <= task_idx < limit:
            raise ValueError(f"task index {task_idx} out of range for {env!r} ({limit} tasks)")

    def _retire(self, env: str, task_idx: int) -> None:
        """O(1) removal from the active list: move the last task into the freed slot."""
        if env in self._pools:
            self._pools[env].retire(task_idx)
        active, position = self._active[env], self._position[env]
        slot = position[task_idx]
        last = active[-1]
        active[slot] = last
        position[last] = slot
        active.pop()
        position[task_idx] = -1


def _normalised_ratios(env_ratios: dict[str, float], envs: list[str]) -> list[float]:
    """Ratios in `envs` order, summing to 1."""
    if set(env_ratios) != set(envs):
        missing, extra = sorted(set(envs) - set(env_ratios)), sorted(set(env_ratios) - set(envs))
        raise ValueError(f"env_ratios keys must be exactly the env names {envs}: missing {missing}, unknown {extra}")
    for env, ratio in env_ratios.items():
        if not (math.isfinite(ratio) and ratio > 0):
            raise ValueError(f"env_ratios[{env!r}] must be a positive finite number, got {ratio}")
    total = sum(env_ratios.values())
    return [env_ratios[env] / total for env in envs]
