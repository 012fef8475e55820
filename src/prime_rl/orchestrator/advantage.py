"""Per-rollout advantages from group rewards.

The orchestrator samples `group_size` completions per prompt (a group) and scores each one. An
estimator turns the rewards of a group into one scalar advantage per rollout: the reward minus a
baseline built from the other samples of the same prompt, which removes the prompt's difficulty
from the signal without a learned value function. The trainer multiplies it into the policy gradient.

All functions take `rewards` of shape [num_groups, group_size] and keep its floating dtype (ints
become the default float dtype). A group whose rewards are all equal carries no learning signal
and always gets advantages of exactly 0 (never NaN, never rounding noise), whatever the estimator.
"""

import torch
from torch import Tensor

from prime_rl.orchestrator.config import AdvantageConfig


def _as_rewards(rewards: Tensor) -> Tensor:
    rewards = torch.as_tensor(rewards)
    if rewards.dim() != 2:
        raise ValueError(f"rewards must have shape [num_groups, group_size], got {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    return rewards


def _constant_groups(rewards: Tensor) -> Tensor:
    """[num_groups] bool: True where every reward in the group equals the first one."""
    return (rewards == rewards[:, :1]).all(dim=1)


def _zero_constant_groups(advantages: Tensor, rewards: Tensor) -> Tensor:
    # r - mean(r) of equal rewards can be off by one ulp (e.g. three 0.1s); force those groups to exact 0.
    return torch.where(_constant_groups(rewards)[:, None], torch.zeros_like(advantages), advantages)


def grpo_advantages(rewards: Tensor, std_normalize: bool = False, eps: float = 1e-6) -> Tensor:
    """GRPO: `A_i = r_i - mean(group)`, optionally divided by `std(group) + eps`.

    The plain mean baseline (Dr. GRPO) keeps the gradient scale tied to the reward scale and does not
    up-weight nearly-solved or nearly-failed prompts; `std_normalize` gives the original GRPO form.
    The std is the population std (unbiased=False): the group is the whole set being normalised, so
    with eps=0 every non-constant group gets unit RMS advantage for any group size, and a group of
    one is defined (std 0, advantage 0) instead of NaN.
    """
    rewards = _as_rewards(rewards)
    advantages = rewards - rewards.mean(dim=1, keepdim=True)
    if std_normalize:
        advantages = advantages / (rewards.std(dim=1, keepdim=True, unbiased=False) + eps)
    return _zero_constant_groups(advantages, rewards)


def rloo_advantages(rewards: Tensor) -> Tensor:
    """RLOO: `A_i = r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean(group))`.

    The baseline of each sample excludes the sample itself, so it is independent of that sample's
    action and the gradient estimate is unbiased (the group mean is biased by a factor (G-1)/G).
    A group of one has no other sample to compare with: advantage 0, no signal (as for a constant group).
    """
    rewards = _as_rewards(rewards)
    group_size = rewards.shape[1]
    if group_size < 2:
        return torch.zeros_like(rewards)
    advantages = (group_size / (group_size - 1)) * (rewards - rewards.mean(dim=1, keepdim=True))
    return _zero_constant_groups(advantages, rewards)


def opo_advantages(rewards: Tensor, lengths: Tensor) -> Tensor:
    """OPO: `A_i = r_i - b` with the length-weighted baseline `b = sum_j r_j L_j / sum_j L_j`.

    `lengths` ([num_groups, group_size]) are completion lengths in tokens. With a sequence-level
    policy gradient whose per-sequence gradient norm grows with its length (OPO's assumption), this
    is the variance-minimising constant baseline; with equal lengths it is exactly GRPO's mean.
    """
    rewards = _as_rewards(rewards)
    lengths = torch.as_tensor(lengths, device=rewards.device)
    if lengths.shape != rewards.shape:
        raise ValueError(f"lengths shape {tuple(lengths.shape)} must match rewards shape {tuple(rewards.shape)}")
    if not bool((lengths > 0).all()):
        raise ValueError("opo needs every completion length to be positive")
    lengths = lengths.to(rewards.dtype)
    baseline = (rewards * lengths).sum(dim=1, keepdim=True) / lengths.sum(dim=1, keepdim=True)
    return _zero_constant_groups(rewards - baseline, rewards)


def compute_advantages(rewards: Tensor, lengths: Tensor | None, config: AdvantageConfig) -> Tensor:
    """Advantages of shape [num_groups, group_size] with the estimator chosen by `config`.

    `lengths` is only needed by `opo`. Dropping groups without signal is the caller's choice, with
    `zero_advantage_groups` on the result.
    """
    if config.estimator == "grpo":
        return grpo_advantages(rewards, std_normalize=config.std_normalize, eps=config.eps)
    if config.estimator == "rloo":
        return rloo_advantages(rewards)
    if config.estimator == "opo":
        if lengths is None:
            raise ValueError("the opo estimator needs completion lengths")
        return opo_advantages(rewards, lengths)
    raise ValueError(f"unknown advantage estimator {config.estimator!r}")


def zero_advantage_groups(advantages: Tensor, atol: float = 0.0) -> Tensor:
    """[num_groups] bool: True where every advantage of the group has |A| <= atol (no learning signal).

    Such groups only cost compute in the trainer, so the orchestrator may drop them.
    """
    advantages = torch.as_tensor(advantages)
    if advantages.dim() != 2:
        raise ValueError(f"advantages must have shape [num_groups, group_size], got {tuple(advantages.shape)}")
    return (advantages.abs() <= atol).all(dim=1)
