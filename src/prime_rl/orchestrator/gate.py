"""The advantage-range admission gate: a finished group whose trained advantages all lie in a band teaches (almost)
nothing, so the scheduler rejects it and starts a replacement, as online difficulty filtering does for groups whose
rewards are all 0 or all 1.

The advantages are the ones the batch gives the group's rollouts: `compute_advantages` with the run's
`AdvantageConfig`, per seat of the group (as `batch_samples` in orchestrator.py), judged when the group arrives. For
`reinforce_pp_baseline` and `gpg` that is before the batch stage rescales them (the band is in reward units there);
estimators whose baseline comes from the batch are refused with a gate by the config. Only rollouts that are trained
on count: those with sampled tokens, not masked as truncated. A group without any is admitted (nothing to judge).
"""

import numpy as np

from prime_rl.config.curriculum import AdvantageRangeGate
from prime_rl.config.orchestrator import AdvantageConfig
from prime_rl.orchestrator.advantage import compute_advantages, seat_members
from prime_rl.orchestrator.messages import RolloutResult


def group_advantages(rollouts: list[RolloutResult], config: AdvantageConfig) -> list[float]:
    """Each rollout's advantage within its group, in order: one `compute_advantages` call per seat (a seat's
    rollouts are their own group; opo's lengths are each rollout's loss tokens, at least 1)."""
    advantages = [0.0] * len(rollouts)
    for idx in seat_members([r.seat for r in rollouts]):
        rewards = np.array([[rollouts[i].reward for i in idx]], dtype=np.float64)
        lengths = np.array([[max(1, sum(sum(s.loss_mask) for s in rollouts[i].samples)) for i in idx]])
        for i, value in zip(idx, compute_advantages(rewards, lengths, config)[0].tolist(), strict=True):
            advantages[i] = value
    return advantages


def in_band(advantages: list[float], low: float, high: float) -> bool:
    """Whether there are advantages and every one lies in [low, high] (both ends included)."""
    return bool(advantages) and all(low <= a <= high for a in advantages)


def rejects(
    gate: AdvantageRangeGate, rollouts: list[RolloutResult], advantage: AdvantageConfig, mask_truncated: bool
) -> bool:
    """Whether `gate` rejects the group of `rollouts`: the advantages of its trained rollouts all lie in its band."""
    advantages = group_advantages(rollouts, advantage)
    trained = [
        a for a, r in zip(advantages, rollouts, strict=True) if r.samples and not (mask_truncated and r.truncated)
    ]
    return in_band(trained, gate.low, gate.high)
