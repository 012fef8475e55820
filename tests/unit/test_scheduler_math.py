"""The off-policy bound's arithmetic (DESIGN section 2)."""

from prime_rl.orchestrator.samples import SampleTokens
from prime_rl.orchestrator.scheduler import Group, min_policy_for, target_batch
from prime_rl.orchestrator.worker import RolloutResult


def test_min_policy_for_batch():
    # k = 0: batch n comes from pi_{n-1}; k = 1: from pi_{n-2}; batch 1 always from the base policy
    assert [min_policy_for(n, 0) for n in (1, 2, 3)] == [0, 1, 2]
    assert [min_policy_for(n, 1) for n in (1, 2, 3, 4)] == [0, 0, 1, 2]
    assert [min_policy_for(n, 2) for n in (1, 2, 3, 4, 5)] == [0, 0, 0, 1, 2]


def test_target_batch_counts_groups_towards_the_batch_being_filled_first():
    # 4 groups per batch; filling batch 5: groups 0-3 are for batch 5, 4-7 for batch 6, ...
    assert [target_batch(5, c, 4) for c in (0, 3, 4, 7, 8)] == [5, 5, 6, 6, 7]


def rollout(*versions):
    sample = SampleTokens([1] * len(versions), [v >= 0 for v in versions], [0.0] * len(versions), list(versions))
    return RolloutResult(reward=0.0, samples=[sample])


def test_group_version_is_the_oldest_reported_token_version():
    group = Group(id=0, env="e", task_idx=0, start_version=3, url="u")
    assert group.version == 3 and group.newest_version == 3  # nothing reported: the start version
    group.rollouts = [rollout(-1, 4, 4), rollout(-1, 4, 5)]
    assert group.version == 4 and group.newest_version == 5
