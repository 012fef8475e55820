"""Advantage estimators: hand-derived values, exact zeros for equal-reward groups, the batch stage, the running
mean baseline, config dispatch.

Notation: G the group size, r the rewards of one group, L the completion lengths in tokens, B the batch.
"""

import math

import numpy as np
import pytest
from pydantic import ValidationError

from prime_rl.orchestrator.advantage import (
    AdvantageConfig,
    RunningMean,
    compute_advantages,
    group_has_signal,
    grpo_advantages,
    normalize_batch_advantages,
    opo_advantages,
    reinforce_advantages,
    rloo_advantages,
    zero_advantage_groups,
)

F64 = np.float64

# Two groups of G=4 with different content.
REWARDS = [[1.0, 0.0, 0.0, 1.0], [2.0, 0.0, 0.0, 0.0]]
LENGTHS = [[1, 3, 2, 2], [4, 1, 1, 2]]
# Equal-reward groups; 0.1 * 3 / 3 is not 0.1 in floating point, so r - mean would leave rounding noise.
CONSTANT = [[0.1, 0.1, 0.1], [0.7, 0.7, 0.7], [1.0, 0.0, 1.0]]


def t(values, dtype=F64):
    return np.array(values, dtype=dtype)


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
    close(opo_advantages(t(REWARDS), np.array(LENGTHS)), expected)


def test_opo_equal_lengths_is_grpo():
    # Equal L: b = L·Σr / (G·L) = mean(r).
    rewards = t([[0.3, 1.0, 0.0, 0.5], [2.0, 0.0, 0.0, 0.0]])
    close(opo_advantages(rewards, np.full((2, 4), 7)), grpo_advantages(rewards).tolist())


@pytest.mark.parametrize("bad", [0, -2])
def test_opo_non_positive_length_raises(bad):
    with pytest.raises(ValueError, match="positive"):
        opo_advantages(t(REWARDS), np.array([[1, 3, bad, 2], [4, 1, 1, 2]]))


def test_equal_rewards_give_exact_zeros():
    rewards = t(CONSTANT)
    lengths = np.array([[1, 5, 2], [3, 3, 9], [1, 1, 1]])
    results = [
        grpo_advantages(rewards),
        grpo_advantages(rewards, std_normalize=True),
        grpo_advantages(rewards, std_normalize=True, eps=0.0),  # 0/0 would be NaN without the guard
        rloo_advantages(rewards),
        opo_advantages(rewards, lengths),
    ]
    for adv in results:
        assert not np.isnan(adv).any()
        assert (adv[:2] == 0).all()  # bitwise exact zeros
        assert (adv[2] != 0).all()  # the mixed group keeps its signal


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
    g = np.random.default_rng(0)
    rewards = g.random((5, 6))
    lengths = g.integers(1, 100, (5, 6))
    # Σ_i (r_i - mean) = 0, and rloo is a constant multiple of that.
    assert np.abs(grpo_advantages(rewards).sum(axis=1)).max() <= 1e-12
    assert np.abs(grpo_advantages(rewards, std_normalize=True).sum(axis=1)).max() <= 1e-12
    assert np.abs(rloo_advantages(rewards).sum(axis=1)).max() <= 1e-12
    # Σ_i L_i (r_i - b) = Σ L r - b Σ L = 0 by the definition of b.
    weighted = (lengths * opo_advantages(rewards, lengths)).sum(axis=1)
    assert np.abs(weighted).max() <= 1e-10  # L up to 99 scales the rounding


def test_compute_advantages_dispatch():
    rewards, lengths = t(REWARDS), np.array(LENGTHS)
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
    assert grpo_advantages(t(REWARDS, np.float32)).dtype == np.float32
    close(grpo_advantages(np.array([[1, 0]])), [[0.5, -0.5]])


def test_config():
    config = AdvantageConfig()
    assert (config.estimator, config.std_normalize, config.eps, config.baseline_decay) == ("grpo", False, 1e-6, 0.9)
    with pytest.raises(ValidationError, match="std_normalize applies to the grpo estimator only, not rloo"):
        AdvantageConfig(estimator="rloo", std_normalize=True)
    with pytest.raises(ValidationError, match="baseline_decay"):
        AdvantageConfig(estimator="reinforce_mean", baseline_decay=1.0)  # 1 would never forget the first batch
    with pytest.raises(ValidationError):
        AdvantageConfig(estimator="ppo")
    with pytest.raises(ValidationError):
        AdvantageConfig(unknown=1)
    assert all(field.description for field in AdvantageConfig.model_fields.values())


# ---------------------------------------------------------------------------------------------------------
# Estimators without a group baseline, and the batch stage.


def ragged(actual, expected, tol=1e-12):
    """Ragged lists of lists equal in shape and, element-wise, within `tol` (rounding of a few float64 ops)."""
    assert [len(g) for g in actual] == [len(g) for g in expected]
    return [x for g in actual for x in g] == pytest.approx([x for g in expected for x in g], abs=tol, rel=tol)


def batch_stage(groups, estimator, tokens=None, eps=0.0):
    """`normalize_batch_advantages` on ragged groups given as lists; eps=0 so results are the exact formulas."""
    config = AdvantageConfig(estimator=estimator, eps=eps)
    tokens = [t(w) for w in tokens] if tokens is not None else None
    return [g.tolist() for g in normalize_batch_advantages([t(g) for g in groups], config, tokens)]


def test_reinforce_is_the_reward_minus_a_constant_baseline():
    close(reinforce_advantages(t(REWARDS)), REWARDS)
    # b = 0.5: [1, 0, 0, 1] -> [0.5, -0.5, -0.5, 0.5]; [2, 0, 0, 0] -> [1.5, -0.5, -0.5, -0.5]
    close(reinforce_advantages(t(REWARDS), 0.5), [[0.5, -0.5, -0.5, 0.5], [1.5, -0.5, -0.5, -0.5]])
    # No group baseline: a constant group keeps its signal (every rollout of an always-solved prompt reinforced).
    close(reinforce_advantages(t(CONSTANT)), CONSTANT, tol=0)
    close(compute_advantages(t(REWARDS), None, AdvantageConfig(estimator="reinforce_mean"), baseline=0.5),
          [[0.5, -0.5, -0.5, 0.5], [1.5, -0.5, -0.5, -0.5]])  # fmt: skip
    close(compute_advantages(t(REWARDS), None, AdvantageConfig(estimator="reinforce")), REWARDS, tol=0)
    close(compute_advantages(t(REWARDS), None, AdvantageConfig(estimator="reinforce_pp")), REWARDS, tol=0)
    for estimator in ("reinforce_pp_baseline", "gpg"):  # their group stage is the group mean
        close(
            compute_advantages(t(REWARDS), None, AdvantageConfig(estimator=estimator)),
            grpo_advantages(t(REWARDS)).tolist(),
        )


def test_reinforce_pp_normalises_over_the_whole_batch():
    # B = [1, 0, 0, 1, 2, 0, 0, 0]: mean 4/8 = 0.5, deviations [0.5, -0.5, -0.5, 0.5, 1.5, -0.5, -0.5, -0.5],
    # population var = (7 · 0.25 + 2.25) / 8 = 0.5, std 1/√2 -> deviations · √2.
    s = math.sqrt(2)
    assert ragged(
        batch_stage(REWARDS, "reinforce_pp"), [[s / 2, -s / 2, -s / 2, s / 2], [1.5 * s, -s / 2, -s / 2, -s / 2]]
    )
    # Ragged groups [1, 0] and [1, 1, 1]: mean 0.8, deviations [0.2, -0.8, 0.2, 0.2, 0.2], var (4·0.04 + 0.64)/5 =
    # 0.16, std 0.4 -> [0.5, -2, 0.5, 0.5, 0.5]: the constant group gets a (positive) signal from the batch.
    assert ragged(batch_stage([[1.0, 0.0], [1.0, 1.0, 1.0]], "reinforce_pp"), [[0.5, -2.0], [0.5, 0.5, 0.5]])
    # eps = 1e-6: ±0.5 / (0.5 + 1e-6) for [1, 0] (mean 0.5, std 0.5).
    assert ragged(batch_stage([[1.0, 0.0]], "reinforce_pp", eps=1e-6), [[0.5 / 0.500001, -0.5 / 0.500001]])
    # A batch of equal rewards (0.1 · 4 / 4 is not 0.1 in floating point): exact zeros, not NaN or noise.
    assert batch_stage([[0.1, 0.1, 0.1], [0.1]], "reinforce_pp") == [[0.0, 0.0, 0.0], [0.0]]


def test_reinforce_pp_baseline_divides_group_centred_rewards_by_the_batch_std():
    # Group stage (r - group mean): [1, 0] -> [0.5, -0.5]; [2, 0, 0, 0] -> [1.5, -0.5 ×3]; [0.7, 0.7] -> [0, 0].
    groups = [[1.0, 0.0], [2.0, 0.0, 0.0, 0.0], [0.7, 0.7]]
    centred = [grpo_advantages(t([g]))[0].tolist() for g in groups]
    assert centred == [[0.5, -0.5], [1.5, -0.5, -0.5, -0.5], [0.0, 0.0]]
    # Batch: mean 0 (each group sums to 0), population var = (0.25 · 5 + 2.25) / 8 = 3.5 / 8 = 7/16, std √7/4.
    k = 4 / math.sqrt(7)
    result = batch_stage(centred, "reinforce_pp_baseline")
    assert ragged(result[:2], [[0.5 * k, -0.5 * k], [1.5 * k, -0.5 * k, -0.5 * k, -0.5 * k]])
    assert result[2] == [0.0, 0.0]  # the constant group stays exactly 0 (no batch mean subtracted)
    assert batch_stage([[0.0, 0.0]], "reinforce_pp_baseline") == [[0.0, 0.0]]  # no signal: 0, not 0 / (0 + eps=0)


def test_gpg_scales_by_the_share_of_the_batch_with_signal():
    centred = [[0.5, -0.5], [1.5, -0.5, -0.5, -0.5], [0.0, 0.0]]
    # Rollouts: B = 8, M = 2 in the signal-less group -> alpha = 8 / 6 = 4/3.
    a = 4 / 3
    assert ragged(batch_stage(centred, "gpg"), [[0.5 * a, -0.5 * a], [2.0, -0.5 * a, -0.5 * a, -0.5 * a], [0, 0]])
    # Loss tokens [3, 1], [1, 1, 1, 1], [2, 4]: 14 in all, 8 with signal -> alpha = 14 / 8 = 7/4.
    tokens = [[3, 1], [1, 1, 1, 1], [2, 4]]
    b = 7 / 4
    assert ragged(
        batch_stage(centred, "gpg", tokens), [[0.5 * b, -0.5 * b], [1.5 * b, -0.5 * b, -0.5 * b, -0.5 * b], [0, 0]]
    )
    assert batch_stage(centred[:2], "gpg") == centred[:2]  # every group has signal: alpha 1
    assert batch_stage([[0.0, 0.0]], "gpg") == [[0.0, 0.0]]  # no signal at all: zeros, no division by 0


def test_estimators_without_a_batch_stage_pass_through():
    groups = [t([0.5, -0.5]), t([1.0])]
    for estimator in ("grpo", "rloo", "opo", "reinforce", "reinforce_mean"):
        assert normalize_batch_advantages(groups, AdvantageConfig(estimator=estimator)) is groups


def test_which_groups_can_carry_a_signal_per_estimator():
    for estimator in ("grpo", "rloo", "opo", "reinforce_pp_baseline", "gpg"):  # group baseline: rewards must differ
        assert [group_has_signal(r, estimator) for r in ([1.0, 1.0], [0.0, 0.0], [1.0, 0.0])] == [False, False, True]
    # A = r: only an all-zero group has nothing to reinforce.
    assert [group_has_signal(r, "reinforce") for r in ([1.0, 1.0], [0.0, 0.0], [1.0, 0.0])] == [True, False, True]
    for estimator in ("reinforce_mean", "reinforce_pp"):  # the baseline comes with the batch
        assert group_has_signal([0.0, 0.0], estimator)


def test_running_mean_is_a_bias_corrected_exponential_mean_of_batch_means():
    mean = RunningMean(decay=0.5)
    assert mean.value("a") == 0.0  # before any batch: plain REINFORCE
    mean.update({"a": 1.0})
    assert mean.value("a") == 1.0  # sum 1, weight 1: the first batch's mean, not (1 - decay) of it
    mean.update({"a": 0.0, "b": 2.0})
    # a: (0.5 · 1 + 0) / (0.5 + 1) = 1/3; b starts now: 2
    assert (mean.value("a"), mean.value("b")) == (pytest.approx(1 / 3), 2.0)
    mean.update({"a": 1.0})
    # a: batch means 1, 0, 1 weighted 0.25, 0.5, 1 -> 1.25 / 1.75 = 5/7; b had no rollouts in this batch: unchanged
    assert (mean.value("a"), mean.value("b")) == (pytest.approx(5 / 7), 2.0)
    last = RunningMean(decay=0.0)
    last.update({"a": 1.0})
    last.update({"a": 0.25})
    assert last.value("a") == 0.25  # decay 0: the previous batch's mean


def test_running_mean_state_round_trips_and_continues_identically():
    import json

    mean = RunningMean(decay=0.9)
    for m in (0.2, 0.7, 0.4):
        mean.update({"a": m, "b": 1 - m})
    restored = RunningMean(decay=0.9)
    restored.load_state_dict(json.loads(json.dumps(mean.state_dict())))
    for m in (0.9, 0.1):
        mean.update({"a": m})
        restored.update({"a": m})
    assert (restored.value("a"), restored.value("b")) == (mean.value("a"), mean.value("b"))  # bitwise
    with pytest.raises(ValueError, match="baseline_decay is 0.5, the checkpoint's running mean was built with 0.9"):
        RunningMean(decay=0.5).load_state_dict(mean.state_dict())
