"""Per-rollout advantages from rewards: a per-group stage, then a batch stage.

The orchestrator samples `rollouts_per_example` completions per prompt (a group) and scores each one. An
estimator turns rewards into one scalar advantage per rollout; the trainer multiplies it into the policy gradient.

1. Per group (`compute_advantages`, on rewards of shape [num_groups, group_size]):
   - group baselines: `grpo` (r - group mean, optionally / group std), `rloo` (leave-one-out mean), `opo`
     (length-weighted mean), and the group-centring step of `reinforce_pp_baseline` and `gpg`. They remove the
     prompt's difficulty from the signal without a learned value function.
   - no group baseline: `reinforce` (A = r), `reinforce_mean` (r - a running mean of past batches' rewards,
     `RunningMean`), and `reinforce_pp` (A = r before its batch stage).
2. Per batch (`normalize_batch_advantages`, once per step on every group of the batch): `reinforce_pp` subtracts
   the batch mean and divides by the batch std, `reinforce_pp_baseline` divides by the batch std, `gpg` scales by
   the share of rollouts that carry a signal. The other estimators pass through unchanged.

Exact zeros: with a group-baseline estimator (`GROUP_BASELINE`) a group whose rewards are all equal carries no
learning signal and gets advantages of exactly 0 (never NaN, never rounding noise), before and after the batch
stage. Without a group baseline a constant group keeps a signal (`reinforce`: unless its rewards are 0), so
`group_has_signal` decides per estimator which groups `filter_zero_advantage` may drop.

All functions keep the rewards' floating dtype (ints become float64). NumPy, not torch: the orchestrator never
imports torch (its memory).
"""

import numpy as np

from prime_rl.orchestrator.config import AdvantageConfig

GROUP_BASELINE = ("grpo", "rloo", "opo", "reinforce_pp_baseline", "gpg")
"""Estimators that subtract a baseline built from the group itself: a constant group gets exactly 0."""

BATCH_CENTERED = ("reinforce_mean", "reinforce_pp")
"""Estimators whose baseline is only known when the batch is assembled: no group can be judged signal-less when
it arrives, so `filter_zero_advantage` is refused with them."""


def _as_rewards(rewards: np.ndarray) -> np.ndarray:
    rewards = np.asarray(rewards)
    if rewards.ndim != 2:
        raise ValueError(f"rewards must have shape [num_groups, group_size], got {tuple(rewards.shape)}")
    if not np.issubdtype(rewards.dtype, np.floating):
        rewards = rewards.astype(np.float64)
    return rewards


def _constant_groups(rewards: np.ndarray) -> np.ndarray:
    """[num_groups] bool: True where every reward in the group equals the first one."""
    return (rewards == rewards[:, :1]).all(axis=1)


def _zero_constant_groups(advantages: np.ndarray, rewards: np.ndarray) -> np.ndarray:
    # r - mean(r) of equal rewards can be off by one ulp (e.g. three 0.1s); force those groups to exact 0.
    return np.where(_constant_groups(rewards)[:, None], np.zeros_like(advantages), advantages)


def grpo_advantages(rewards: np.ndarray, std_normalize: bool = False, eps: float = 1e-6) -> np.ndarray:
    """GRPO: `A_i = r_i - mean(group)`, optionally divided by `std(group) + eps`.

    The plain mean baseline (Dr. GRPO) keeps the gradient scale tied to the reward scale and does not
    up-weight nearly-solved or nearly-failed prompts; `std_normalize` gives the original GRPO form.
    The std is the population std (unbiased=False): the group is the whole set being normalised, so
    with eps=0 every non-constant group gets unit RMS advantage for any group size, and a group of
    one is defined (std 0, advantage 0) instead of NaN.
    """
    rewards = _as_rewards(rewards)
    advantages = rewards - rewards.mean(axis=1, keepdims=True)
    if std_normalize:
        advantages = advantages / (rewards.std(axis=1, keepdims=True) + eps)
    return _zero_constant_groups(advantages, rewards)


def rloo_advantages(rewards: np.ndarray) -> np.ndarray:
    """RLOO: `A_i = r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean(group))`.

    The baseline of each sample excludes the sample itself, so it is independent of that sample's
    action and the gradient estimate is unbiased (the group mean is biased by a factor (G-1)/G).
    A group of one has no other sample to compare with: advantage 0, no signal (as for a constant group).
    """
    rewards = _as_rewards(rewards)
    group_size = rewards.shape[1]
    if group_size < 2:
        return np.zeros_like(rewards)
    advantages = (group_size / (group_size - 1)) * (rewards - rewards.mean(axis=1, keepdims=True))
    return _zero_constant_groups(advantages, rewards)


def opo_advantages(rewards: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """OPO: `A_i = r_i - b` with the length-weighted baseline `b = sum_j r_j L_j / sum_j L_j`.

    `lengths` ([num_groups, group_size]) are completion lengths in tokens. With a sequence-level
    policy gradient whose per-sequence gradient norm grows with its length (OPO's assumption), this
    is the variance-minimising constant baseline; with equal lengths it is exactly GRPO's mean.
    """
    rewards = _as_rewards(rewards)
    lengths = np.asarray(lengths)
    if lengths.shape != rewards.shape:
        raise ValueError(f"lengths shape {tuple(lengths.shape)} must match rewards shape {tuple(rewards.shape)}")
    if not bool((lengths > 0).all()):
        raise ValueError("opo needs every completion length to be positive")
    lengths = lengths.astype(rewards.dtype)
    baseline = (rewards * lengths).sum(axis=1, keepdims=True) / lengths.sum(axis=1, keepdims=True)
    return _zero_constant_groups(rewards - baseline, rewards)


def reinforce_advantages(rewards: np.ndarray, baseline: float = 0.0) -> np.ndarray:
    """REINFORCE: `A_i = r_i - b` with a constant `b` that does not depend on the group (0: no baseline).

    Unbiased for any `b` that does not depend on the sampled actions; a good `b` (the expected reward, e.g. a
    running mean of past rewards) lowers the variance. No group is compared with itself, so a constant group keeps
    its signal: every rollout of a prompt that always scores 1 is reinforced.
    """
    rewards = _as_rewards(rewards)
    return rewards - baseline


def compute_advantages(
    rewards: np.ndarray, lengths: np.ndarray | None, config: AdvantageConfig, baseline: float = 0.0
) -> np.ndarray:
    """The per-group stage: advantages of shape [num_groups, group_size] with the estimator chosen by `config`.

    `lengths` is only needed by `opo`, `baseline` (the running mean of past rewards) only by `reinforce_mean`.
    `reinforce_pp`, `reinforce_pp_baseline` and `gpg` are finished by `normalize_batch_advantages`. Dropping groups
    without signal is the caller's choice (`group_has_signal`).
    """
    estimator = config.estimator
    if estimator == "grpo":
        return grpo_advantages(rewards, std_normalize=config.std_normalize, eps=config.eps)
    if estimator in ("reinforce_pp_baseline", "gpg"):
        return grpo_advantages(rewards)
    if estimator == "rloo":
        return rloo_advantages(rewards)
    if estimator == "opo":
        if lengths is None:
            raise ValueError("the opo estimator needs completion lengths")
        return opo_advantages(rewards, lengths)
    if estimator in ("reinforce", "reinforce_pp"):
        return reinforce_advantages(rewards)
    if estimator == "reinforce_mean":
        return reinforce_advantages(rewards, baseline)
    raise ValueError(f"unknown advantage estimator {estimator!r}")


def reinforce_pp_advantages(advantages: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Reinforce++ (Hu et al. 2025, arXiv:2501.03262): `A = (r - mean_batch) / (std_batch + eps)` over every
    rollout of the batch, given `advantages` = r.

    A global baseline and scale instead of GRPO's per-prompt ones: the per-prompt std up-weights prompts that are
    nearly always solved or failed, and a per-prompt mean is a biased baseline for small groups; the batch's are
    stable. Normalised per rollout (one scalar each), not per token as in OpenRLHF, where long completions weigh
    more. Population std (unbiased=False), as GRPO's. A batch whose rewards are all equal gets exact zeros.
    """
    if bool((advantages == advantages[:1]).all()):
        return np.zeros_like(advantages)
    return (advantages - advantages.mean()) / (advantages.std() + eps)


def reinforce_pp_baseline_advantages(advantages: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Reinforce++-baseline: `A = (r - mean_group) / (std_batch + eps)`, given `advantages` = r - mean_group for
    every rollout of the batch.

    The paper (and OpenRLHF) also subtract the batch mean after the group mean. Every group's centred rewards sum
    to 0, so that batch mean is 0 up to rounding and subtracting it would only turn the exact zeros of constant
    groups into rounding noise (which `filter_zero_advantage` and the trainer's statistics rely on): it is left out.
    The group mean keeps the per-prompt baseline; the batch std (population) sets one scale for all prompts instead
    of GRPO's per-group one, which blows up groups with a small spread.
    """
    if not bool((advantages != 0).any()):  # no signal anywhere: 0, also with eps = 0
        return np.zeros_like(advantages)
    return advantages / (advantages.std() + eps)


def gpg_advantages(groups: list[np.ndarray], tokens: list[np.ndarray] | None = None) -> list[np.ndarray]:
    """GPG (Chu et al. 2025, arXiv:2504.02546): `A = alpha * (r - mean_group)`, given `groups` = r - mean_group,
    with `alpha = B / (B - M)`: B rollouts in the batch, M of them in groups whose advantages are all 0.

    Signal-less groups (all solved or all failed) still count in the loss's normaliser and so dilute the gradient
    of the others by (B - M) / B; alpha undoes that. The trainer divides the loss by the step's loss tokens, not its
    rollouts, so with `tokens` (each rollout's loss tokens, shaped like `groups`) B and M count tokens, which undoes
    exactly that dilution; without, they count rollouts as in the paper. A batch without any signal keeps its zeros
    (alpha 1). With `filter_zero_advantage` no signal-less group reaches the batch, alpha is 1 and GPG is Dr. GRPO.
    """
    weights = tokens if tokens is not None else [np.ones_like(g) for g in groups]
    total = sum(float(w.sum()) for w in weights)
    signal = sum(float(w.sum()) for g, w in zip(groups, weights, strict=True) if bool((g != 0).any()))
    alpha = total / signal if signal else 1.0
    return [g * alpha for g in groups]


def normalize_batch_advantages(
    groups: list[np.ndarray], config: AdvantageConfig, tokens: list[np.ndarray] | None = None
) -> list[np.ndarray]:
    """The batch stage, applied once per step to the per-group advantages of every group (or seat) in the batch.

    `groups` may differ in size (groups that lost rollouts, seats); the result has the same shapes. Statistics are
    over rollouts, each counted once; `tokens` (loss tokens per rollout, shaped like `groups`) only weighs `gpg`'s
    alpha. Estimators without a batch stage return `groups` unchanged.
    """
    estimator = config.estimator
    if estimator not in ("reinforce_pp", "reinforce_pp_baseline", "gpg") or not groups:
        return groups
    if estimator == "gpg":
        return gpg_advantages(groups, tokens)
    flat = np.concatenate([g.ravel() for g in groups])
    if estimator == "reinforce_pp":
        flat = reinforce_pp_advantages(flat, config.eps)
    else:
        flat = reinforce_pp_baseline_advantages(flat, config.eps)
    parts = np.split(flat, np.cumsum([g.size for g in groups])[:-1])
    return [part.reshape(g.shape) for part, g in zip(parts, groups, strict=True)]


def seat_members(seats: list[str]) -> list[list[int]]:
    """The indices of each seat's rollouts in a group (`seats`: each rollout's seat), seats in order of appearance: in
    a multi-agent environment every seat is its own group for advantages."""
    members: dict[str, list[int]] = {}
    for i, seat in enumerate(seats):
        members.setdefault(seat, []).append(i)
    return list(members.values())


def group_has_signal(rewards: list[float], estimator: str) -> bool:
    """Whether the rewards of one group (one seat of it) can carry a learning signal, judged when the group arrives:
    with a group baseline only if they differ; for `reinforce` only if one is non-zero (A = r). The batch-centred
    estimators (`BATCH_CENTERED`) give a constant group a non-zero advantage in general: always True."""
    if estimator in GROUP_BASELINE:
        return len(set(rewards)) > 1
    if estimator == "reinforce":
        return any(r != 0 for r in rewards)
    return True


class RunningMean:
    """`reinforce_mean`'s baseline: an exponential running mean of the mean reward of past batches, one per
    environment (environments differ in reward scale).

    Updated once per step, after the batch is built, so the baseline of batch n is a function of batches 1..n-1
    only: it does not depend on the order in which groups finished, and a checkpoint at step n holds exactly the
    baseline that batch n+1 uses. Bias-corrected like Adam's moments: the value is `sum_k decay^(n-k) m_k /
    sum_k decay^(n-k)` over the batch means m_k seen so far, so after the first batch it is that batch's mean rather
    than `(1 - decay)` of it. Before any batch it is 0 (the first batch is plain REINFORCE).
    """

    def __init__(self, decay: float):
        self.decay = decay
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}

    def value(self, env: str) -> float:
        weight = self.weights.get(env, 0.0)
        return self.sums[env] / weight if weight > 0 else 0.0

    def update(self, batch_means: dict[str, float]) -> None:
        """Fold in one batch: the mean reward of each environment that had rollouts in it."""
        for env, mean in batch_means.items():
            self.sums[env] = self.decay * self.sums.get(env, 0.0) + mean
            self.weights[env] = self.decay * self.weights.get(env, 0.0) + 1.0

    def state_dict(self) -> dict:
        return {"decay": self.decay, "sums": dict(self.sums), "weights": dict(self.weights)}

    def load_state_dict(self, state: dict) -> None:
        """Restore a `state_dict`. The decay must match: the saved sums were built with the saved one."""
        if state["decay"] != self.decay:
            raise ValueError(
                f"advantage.baseline_decay is {self.decay}, the checkpoint's running mean was built with "
                f"{state['decay']}"
            )
        self.sums = {k: float(v) for k, v in state["sums"].items()}
        self.weights = {k: float(v) for k, v in state["weights"].items()}


def zero_advantage_groups(advantages: np.ndarray, atol: float = 0.0) -> np.ndarray:
    """[num_groups] bool: True where every advantage of the group has |A| <= atol (no learning signal).

    Such groups only cost compute in the trainer, so the orchestrator may drop them.
    """
    advantages = np.asarray(advantages)
    if advantages.ndim != 2:
        raise ValueError(f"advantages must have shape [num_groups, group_size], got {tuple(advantages.shape)}")
    return (np.abs(advantages) <= atol).all(axis=1)
