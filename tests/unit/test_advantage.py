"""Advantage estimators: hand-derived values, exact zeros for equal-reward groups, config dispatch.

Notation: G the group size, r the rewards of one group, L the completion lengths in tokens.
"""

import math

import pytest
import torch
from pydantic import ValidationError

from prime_rl.orchestrator.advantage import (
    AdvantageConfig,
    compute_advantages,
    grpo_advantages,
    opo_advantages,
    rloo_advantages,
    zero_advantage_groups,
)

F64 = torch.float64

# Two groups of G=4 with different content.
REWARDS = [[1.0, 0.0, 0.0, 1.0], [2.0, 0.0, 0.0, 0.0]]
LENGTHS = [[1, 3, 2, 2], [4, 1, 1, 2]]
# Equal-reward groups; 0.1 * 3 / 3 is not 0.1 in floating point, so r - mean would leave rounding noise.
CONSTANT = [[0.1, 0.1, 0.1], [0.7, 0.7, 0.7], [1.0, 0.0, 1.0]]


def t(values, dtype=F64):
    return torch.tensor(values, dtype=dtype)


def close(actual, expected, tol=1e-12):
    """Element-wise comparison of a [num_groups, group_size] tensor with nested lists."""
    assert list(actual.shape) == [len(expected), len(expected[0])]
    flat = [x for row in expected for x in row]
    assert actual.flatten().tolist() == pytest.approx(flat, abs=tol, rel=tol)


def test_grpo_mean_baseline():
    # [1, 0, 0, 1]: mean 0.5 -> [0.5, -0.5, -0.5, 0.5]
    # [2, 0, 0, 0]: mean 0.5 -> [1.5, -0.5, -0.5, -0.5]
    close(grpo_advantages(t(REWARDS)), [[0.5, -0.5, -0.5, 0.5], [1.5, -0.5, -0.5, -0.5]])


def test_grpo_std_normalize():
    # [1, 0, 0, 1]: population var = 4 * 0.25 / 4 = 0.25, std 0.5 -> ±0.5 / (0.5 + 1e-6)
    # [2, 0, 0, 0]: population var = (1.5² + 3 * 0.5²) / 4 = 3/4, std √3/2 -> [1.5, -0.5 ×3] / (√3/2 + 1e-6)
    s = math.sqrt(3) / 2
    a, b = 0.5 / (0.5 + 1e-6), 1 / (s + 1e-6)
    close(grpo_advantages(t(REWARDS), std_normalize=True), [[a, -a, -a, a], [1.5 * b, -0.5 * b, -0.5 * b, -0.5 * b]])
    # eps=0: [1, -1, -1, 1] and [1.5, -0.5 ×3] · 2/√3 = [√3, -1/√3 ×3]
    r3 = math.sqrt(3)
    close(grpo_advantages(t(REWARDS), std_normalize=True, eps=0.0), [[1, -1, -1, 1], [r3, -1 / r3, -1 / r3, -1 / r3]])
    # [1, 0]: mean 0.5, std 0.5 -> [0.5 / 0.500001, -0.5 / 0.500001]
    close(grpo_advantages(t([[1.0, 0.0]]), std_normalize=True), [[0.5 / 0.500001, -0.5 / 0.500001]])


def test_rloo_leave_one_out():
    # G=4: G/(G-1) = 4/3 times the grpo values.
    # [1, 0, 0, 1]: 4/3 · [0.5, -0.5, -0.5, 0.5] = ±2/3; directly: 1 - (0+0+1)/3 = 2/3 ✓
    # [2, 0, 0, 0]: 4/3 · [1.5, -0.5 ×3] = [2, -2/3 ×3]; directly: 2 - 0 = 2, 0 - 2/3 = -2/3 ✓
    c = 2 / 3
    close(rloo_advantages(t(REWARDS)), [[c, -c, -c, c], [2.0, -c, -c, -c]])


def test_rloo_group_of_one_gets_zero_advantage():
    # No other rollout to build a leave-one-out baseline from: no learning signal, like a constant group
    # (a group that lost all but one rollout to errors must not end the run).
    assert rloo_advantages(t([[1.0], [0.0]])).tolist() == [[0.0], [0.0]]
    assert grpo_advantages(t([[1.0]])).tolist() == [[0.0]]


def test_opo_length_weighted_baseline():
    # [1, 0] with L [1, 3]: b = (1·1 + 0·3) / 4 = 0.25 -> [0.75, -0.25]
    close(opo_advantages(t([[1.0, 0.0]]), t([[1, 3]])), [[0.75, -0.25]])
    # [1, 0, 0, 1] with L [1, 3, 2, 2]: b = (1 + 0 + 0 + 2) / 8 = 3/8 -> [5/8, -3/8, -3/8, 5/8]
    # [2, 0, 0, 0] with L [4, 1, 1, 2]: b = 8 / 8 = 1 -> [1, -1, -1, -1]
    expected = [[5 / 8, -3 / 8, -3 / 8, 5 / 8], [1.0, -1.0, -1.0, -1.0]]
    close(opo_advantages(t(REWARDS), torch.tensor(LENGTHS)), expected)


def test_opo_equal_lengths_is_grpo():
    # Equal L: b = L·Σr / (G·L) = mean(r).
    rewards = t([[0.3, 1.0, 0.0, 0.5], [2.0, 0.0, 0.0, 0.0]])
    close(opo_advantages(rewards, torch.full((2, 4), 7)), grpo_advantages(rewards).tolist())


@pytest.mark.parametrize("bad", [0, -2])
def test_opo_non_positive_length_raises(bad):
    with pytest.raises(ValueError, match="positive"):
        opo_advantages(t(REWARDS), torch.tensor([[1, 3, bad, 2], [4, 1, 1, 2]]))


def test_equal_rewards_give_exact_zeros():
    rewards = t(CONSTANT)
    lengths = torch.tensor([[1, 5, 2], [3, 3, 9], [1, 1, 1]])
    results = [
        grpo_advantages(rewards),
        grpo_advantages(rewards, std_normalize=True),
        grpo_advantages(rewards, std_normalize=True, eps=0.0),  # 0/0 would be NaN without the guard
        rloo_advantages(rewards),
        opo_advantages(rewards, lengths),
    ]
    for adv in results:
        assert not adv.isnan().any()
        assert adv[:2].eq(0).all()  # bitwise exact zeros
        assert adv[2].ne(0).all()  # the mixed group keeps its signal


def test_zero_advantage_groups_flags_equal_reward_groups():
    rewards = t(CONSTANT)
    for config in [AdvantageConfig(), AdvantageConfig(std_normalize=True), AdvantageConfig(estimator="rloo")]:
        flags = zero_advantage_groups(compute_advantages(rewards, None, config))
        assert flags.tolist() == [True, True, False]
    # atol: |A| <= 0.1 counts as zero.
    adv = t([[0.05, -0.05], [0.5, -0.5]])
    assert zero_advantage_groups(adv).tolist() == [False, False]
    assert zero_advantage_groups(adv, atol=0.1).tolist() == [True, False]


def test_sums_vanish():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(5, 6, generator=g, dtype=F64)
    lengths = torch.randint(1, 100, (5, 6), generator=g)
    # Σ_i (r_i - mean) = 0, and rloo is a constant multiple of that.
    assert grpo_advantages(rewards).sum(dim=1).abs().max() <= 1e-12
    assert grpo_advantages(rewards, std_normalize=True).sum(dim=1).abs().max() <= 1e-12
    assert rloo_advantages(rewards).sum(dim=1).abs().max() <= 1e-12
    # Σ_i L_i (r_i - b) = Σ L r - b Σ L = 0 by the definition of b.
    weighted = (lengths * opo_advantages(rewards, lengths)).sum(dim=1)
    assert weighted.abs().max() <= 1e-10  # L up to 99 scales the rounding


def test_compute_advantages_dispatch():
    rewards, lengths = t(REWARDS), torch.tensor(LENGTHS)
    close(compute_advantages(rewards, lengths, AdvantageConfig()), grpo_advantages(rewards).tolist())
    close(
        compute_advantages(rewards, lengths, AdvantageConfig(std_normalize=True, eps=0.0)),
        grpo_advantages(rewards, std_normalize=True, eps=0.0).tolist(),
    )
    close(compute_advantages(rewards, lengths, AdvantageConfig(estimator="rloo")), rloo_advantages(rewards).tolist())
    close(
        compute_advantages(rewards, lengths, AdvantageConfig(estimator="opo")),
        opo_advantages(rewards, lengths).tolist(),
    )
    with pytest.raises(ValueError, match="lengths"):
        compute_advantages(rewards, None, AdvantageConfig(estimator="opo"))


def test_dtype_kept_and_ints_accepted():
    assert grpo_advantages(t(REWARDS)).dtype == F64
    assert grpo_advantages(t(REWARDS, torch.float32)).dtype == torch.float32
    close(grpo_advantages(torch.tensor([[1, 0]])), [[0.5, -0.5]])


def test_config():
    config = AdvantageConfig()
    assert (config.estimator, config.std_normalize, config.eps) == ("grpo", False, 1e-6)
    with pytest.raises(ValidationError):
        AdvantageConfig(estimator="ppo")
    with pytest.raises(ValidationError):
        AdvantageConfig(unknown=1)
    assert all(field.description for field in AdvantageConfig.model_fields.values())
