"""Credit of the training algorithms other than `grpo` (config/algorithm.py): one advantage per rollout.

`grpo` is the estimator family of `advantage.py`. The others, one function each:

- `max_rl_advantages`: `(r - mean) / mean` per group and seat, 0 where the mean is not positive.
- `RaeBaselines`: reward minus the seat's running baseline, read before the reward is folded in.
- `hierarchical_advantages`: solvers against the other attempts at the same proposed problem (their episode),
  proposers against the other proposals for the same source task (their group).

NumPy and floats only: the orchestrator never imports torch. Formulas and worked examples: docs/algorithms.md.
"""

from __future__ import annotations

import re

import numpy as np

from prime_rl.orchestrator.advantage import seat_members


def max_rl_advantages(rewards: np.ndarray) -> np.ndarray:
    """MaxRL on one group's (one seat's) rewards: `A_i = (r_i - m) / m` with m their mean; all 0 if `m <= 0` (no
    success to learn from) or the rewards are equal (exactly 0, not rounding noise)."""
    rewards = np.asarray(rewards, dtype=np.float64)
    mean = rewards.mean() if rewards.size else 0.0
    if mean <= 0 or bool((rewards == rewards[0]).all()):
        return np.zeros_like(rewards)
    return (rewards - mean) / mean


class RaeBaselines:
    """RAE's baselines of one environment, one per seat: an exponential mean of the seat's earlier rewards, 0 before
    any.

    `advantage` reads the baseline, then folds the reward in (`b <- decay * b + (1 - decay) * r`), so a rollout is
    never compared with a baseline that already contains its own reward. Rollouts are taken in batch order, once per
    batch: a checkpoint at step n holds exactly the baselines batch n+1 starts from."""

    def __init__(self, decay: float):
        self.decay = decay
        self.values: dict[str, float] = {}

    def advantage(self, seat: str, reward: float) -> float:
        before = self.values.get(seat, 0.0)
        self.values[seat] = self.decay * before + (1 - self.decay) * reward
        return reward - before

    def state_dict(self) -> dict:
        return {"decay": self.decay, "values": dict(self.values)}

    def load_state_dict(self, state: dict) -> None:
        """Restore a `state_dict`; the decay must match the one its baselines were built with."""
        if state["decay"] != self.decay:
            raise ValueError(
                f"algo.decay is {self.decay}, the checkpoint's RAE baselines were built with {state['decay']}"
            )
        self.values = {k: float(v) for k, v in state["values"].items()}


NUMBERED_SEAT = re.compile(r"^(.*)_\d+$")


def agent_of(seat: str) -> str:
    """The agent a seat plays: `solver_2` plays `solver`; a seat without a number is its own agent."""
    match = NUMBERED_SEAT.match(seat)
    return match.group(1) if match else seat


def hierarchical_advantages(
    seats: list[str], episodes: list[int], rewards: list[float], episode_agents: list[str]
) -> list[float]:
    """Hierarchical GRPO over one group's rollouts (one entry per rollout: its seat, episode and reward).

    A rollout of an `episode_agents` agent is compared with that agent's rollouts in the same episode (the attempts
    at one proposed problem); any other with its agent's rollouts across the group (the proposals for one source
    task). `A = r - mean(comparison)`, and 0 for a comparison of one rollout or of equal rewards."""
    buckets: dict[tuple[str, int | None], list[int]] = {}
    for i, (seat, episode) in enumerate(zip(seats, episodes, strict=True)):
        agent = agent_of(seat)
        buckets.setdefault((agent, episode if agent in episode_agents else None), []).append(i)
    advantages = [0.0] * len(rewards)
    for members in buckets.values():
        values = [rewards[i] for i in members]
        if len(members) < 2 or len(set(values)) == 1:
            continue
        mean = sum(values) / len(values)
        for i in members:
            advantages[i] = rewards[i] - mean
    return advantages


def group_advantages(
    algo, seats: list[str], episodes: list[int], rewards: list[float], rae: RaeBaselines | None
) -> list[float]:
    """One group's advantages (one per rollout, in order) under `algo`, any algorithm but `grpo` (`advantage.py`);
    `rae`: the environment's baselines, for `rae`."""
    if algo.type == "max_rl":
        advantages = [0.0] * len(rewards)
        for idx in seat_members(seats):  # each seat its own comparison, as grpo's
            for i, a in zip(idx, max_rl_advantages(np.array([rewards[i] for i in idx])).tolist(), strict=True):
                advantages[i] = a
        return advantages
    if algo.type == "rae":
        if rae is None:
            raise ValueError("rae needs its baselines (RaeBaselines)")
        return [rae.advantage(seat, reward) for seat, reward in zip(seats, rewards, strict=True)]
    if algo.type == "hierarchical_grpo":
        return hierarchical_advantages(seats, episodes, rewards, algo.episode_agents)
    if algo.type in ("opd", "opsd", "sft"):  # no reward credit: a teacher's log-probs or tokens are the signal
        return [0.0] * len(rewards)
    raise ValueError(f"no credit for algorithm {algo.type!r} here")


def group_has_signal(algo, seats: list[str], episodes: list[int], rewards: list[float]) -> bool:
    """Whether a finished group can get a non-zero advantage under `algo` (not `grpo`), judged when it arrives
    (`filter_zero_advantage`): RAE's baselines move, so any group may."""
    if algo.type in ("rae", "opd", "opsd", "sft"):  # moving baselines; a teacher's log-probs or tokens
        return True
    if algo.type == "max_rl":
        return any(max_rl_advantages(np.array([rewards[i] for i in idx])).any() for idx in seat_members(seats))
    return any(a != 0 for a in hierarchical_advantages(seats, episodes, rewards, algo.episode_agents))
