"""The difficulty-pool task sampler: which active task of one environment is rolled out next, weighted by how hard
its latest group found it.

Each task sits in one pool: `unseen` until a group of it finishes, then the first pool (by ascending threshold)
whose threshold is >= the group's mean reward, the highest one for anything above. A draw picks a pool with
probability proportional to `weight x tasks in it` and then a uniformly random task of that pool: the same as
drawing each task with probability proportional to its pool's weight, in O(number of pools) per draw. A task's
next group moves it to the pool of that group's mean (its latest result, not an average of all of them).

The buffer (buffer.py) owns the environments, the retirement of tasks and the random number generator; this
module only keeps the pools of one environment's active tasks. Config: config/curriculum.py; docs/algorithms.md,
"Curricula", has a worked example.
"""

import hashlib
import json
import random
from typing import Any

from loguru import logger

from prime_rl.config.curriculum import UNSEEN, DifficultyPoolSampler


def pool_for(reward: float, ordered: list[tuple[str, float]]) -> str:
    """The pool of a task whose latest group mean is `reward`, given (name, threshold) by ascending threshold:
    the first whose threshold is >= reward, else the last (it takes everything above)."""
    for name, threshold in ordered:
        if reward <= threshold:
            return name
    return ordered[-1][0]


def pick(weights: list[float], u: float) -> int:
    """Index drawn with probability proportional to `weights` (>= 0, one positive) for `u` uniform in [0, 1):
    the first index whose running sum exceeds `u x total`; the last positive one absorbs float rounding."""
    target = u * sum(weights)
    chosen = -1
    for i, weight in enumerate(weights):
        if weight <= 0:
            continue
        chosen = i
        target -= weight
        if target < 0:
            break
    assert chosen >= 0, "pick needs a positive weight"
    return chosen


def state_digest(state: dict[str, Any]) -> str:
    """First 12 hex digits of the SHA-256 of a pools `state_dict` as JSON with sorted keys: names the whole state
    (every latest mean, every pool's member order) in a log line, which a reader of the checkpoint can recompute."""
    return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()[:12]


class DifficultyPools:
    """The pools of one finite environment's active tasks (`size` tasks, all active and unseen at the start).

    Pool members are kept in lists with a position map (O(1) moves by swap-and-pop); the lists' order decides which
    task a draw picks, so the state keeps them in order and a resumed run draws exactly the same tasks."""

    def __init__(self, config: DifficultyPoolSampler, size: int):
        self.config = config
        self._ordered = config.ordered()
        self._names = [UNSEEN, *(name for name, _ in self._ordered)]
        self._weights = [config.unseen_weight, *(config.pools[name].weight for name, _ in self._ordered)]
        self.size = size
        self.rewards: list[float | None] = [None] * size
        """Each task's latest group mean reward (None: no group yet)."""
        self._members: dict[str, list[int]] = {name: [] for name in self._names}
        self._members[UNSEEN] = list(range(size))
        self._where: list[tuple[str, int] | None] = [(UNSEEN, i) for i in range(size)]  # None: retired

    def pool(self, task: int) -> str | None:
        """The pool task `task` is in (None once retired)."""
        where = self._where[task]
        return None if where is None else where[0]

    def observe(self, task: int, mean_reward: float) -> None:
        """A group of `task` finished with this mean reward: it moves to that reward's pool (if still active)."""
        self.rewards[task] = mean_reward
        if self._where[task] is not None:
            self._remove(task)
            self._add(task, pool_for(mean_reward, self._ordered))

    def retire(self, task: int) -> None:
        """The buffer retired `task` (too easy or too hard for good): it is drawn no more."""
        if self._where[task] is not None:
            self._remove(task)
            self._where[task] = None

    def total_weight(self) -> float:
        """Sum of the active tasks' weights: 0 when no task can be drawn."""
        return sum(w * len(self._members[n]) for n, w in zip(self._names, self._weights, strict=True))

    def draw(self, rng: random.Random) -> int:
        """A task, with probability proportional to its pool's weight: a pool by `weight x members`, then a
        uniformly random member (two draws from `rng`)."""
        sizes = [w * len(self._members[n]) for n, w in zip(self._names, self._weights, strict=True)]
        members = self._members[self._names[pick(sizes, rng.random())]]
        return members[rng.randrange(len(members))]

    def sizes(self) -> dict[str, int]:
        """Active tasks per pool, `unseen` first."""
        return {name: len(self._members[name]) for name in self._names}

    def summary(self) -> str:
        """Active tasks per pool and the state's digest, for the line a resumed run logs: `unseen 3, hard 1, ... (state
        <state_digest>)`."""
        sizes = ", ".join(f"{name} {n}" for name, n in self.sizes().items())
        return f"{sizes} (state {state_digest(self.state_dict())})"

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable: the latest rewards (null: unseen) and each pool's members in their current order."""
        return {"rewards": list(self.rewards), "pools": {name: list(m) for name, m in self._members.items()}}

    def load_state_dict(self, state: dict[str, Any], active: list[int]) -> None:
        """Restore a `state_dict` whose pools hold exactly the `active` tasks. With the same pool names and
        thresholds the saved member order is kept (the next draws are the ones the saved run would have made);
        otherwise every active task is placed by its saved reward under the new thresholds (and a warning says so)."""
        rewards = state["rewards"]
        if len(rewards) != self.size:
            raise ValueError(f"difficulty pools saved for {len(rewards)} tasks, this environment has {self.size}")
        self.rewards = [None if r is None else float(r) for r in rewards]
        saved = {name: [int(t) for t in members] for name, members in state["pools"].items()}
        if sorted(t for members in saved.values() for t in members) != sorted(active):
            raise ValueError("the saved difficulty pools do not hold exactly the environment's active tasks")
        expected = {t: UNSEEN if self.rewards[t] is None else pool_for(self.rewards[t], self._ordered) for t in active}
        if set(saved) != set(self._names) or any(expected[t] != name for name, m in saved.items() for t in m):
            logger.warning("difficulty pools changed since the checkpoint: tasks re-placed by their latest rewards")
            saved = {name: [t for t in sorted(active) if expected[t] == name] for name in self._names}
        self._members = saved
        self._where = [None] * self.size
        for name, members in saved.items():
            for i, task in enumerate(members):
                self._where[task] = (name, i)

    def _remove(self, task: int) -> None:
        name, slot = self._where[task]
        members = self._members[name]
        last = members[-1]
        members[slot] = last
        self._where[last] = (name, slot)
        members.pop()

    def _add(self, task: int, name: str) -> None:
        self._where[task] = (name, len(self._members[name]))
        self._members[name].append(task)
