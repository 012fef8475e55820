"""The off-policy bound's arithmetic (DESIGN section 2)."""

from prime_rl.orchestrator.messages import RolloutResult
from prime_rl.orchestrator.samples import SampleTokens
from prime_rl.orchestrator.scheduler import Group, min_policy_for, seat_rewards, target_batch, trained_rollouts


def test_min_policy_for_batch():
    # k = 0: batch n comes from pi_{n-1}; k = 1: from pi_{n-2}; batch 1 always from the base policy
    assert [min_policy_for(n, 0) for n in (1, 2, 3)] == [0, 1, 2]
    assert [min_policy_for(n, 1) for n in (1, 2, 3, 4)] == [0, 0, 1, 2]
    assert [min_policy_for(n, 2) for n in (1, 2, 3, 4, 5)] == [0, 0, 0, 1, 2]


def test_target_batch_counts_rollouts_towards_the_batch_being_filled_first():
    # batch_size 16 (4 groups of 4); filling batch 5: rollouts 0-15 are for batch 5, 16-31 for batch 6, ...
    assert [target_batch(5, c, 16) for c in (0, 12, 15, 16, 31, 32)] == [5, 5, 5, 6, 6, 7]


def test_a_batch_short_of_rollouts_can_always_start_its_next_group():
    """The k = 0 deadlock: batch 8 of 2 groups x 4 rollouts, one rollout excluded. Nothing in flight, 7 finished
    rollouts. Counted in groups (the old rule) the next group was for batch n + 1, whose policy pi_n cannot exist
    before batch n is written; counted in rollouts it is for batch n."""
    finished = [
        Group(0, "e", 0, {}, 0, "u", rollouts=[rollout(0)] * 4),
        Group(1, "e", 1, {}, 0, "u", rollouts=[rollout(0)] * 3),
    ]
    assert trained_rollouts(finished) == 7
    assert target_batch(3, trained_rollouts(finished), 8) == 3
    assert target_batch(3, len(finished) * 4, 8) == 4  # what counting groups assumed: the batch looked full


def test_seats_without_tokens_count_for_rewards_not_for_the_batch():
    acted, idle = rollout(0, 0), RolloutResult(reward=1.0, samples=[], seat="second")
    group = Group(0, "nim", 0, {}, 0, "u", rollouts=[acted, idle])
    assert trained_rollouts([group]) == 1
    assert seat_rewards(group.rollouts) == {"agent": [0.0], "second": [1.0]}


def rollout(*versions):
    sample = SampleTokens([1] * len(versions), [v >= 0 for v in versions], [0.0] * len(versions), list(versions))
    return RolloutResult(reward=0.0, samples=[sample])


def test_group_version_is_the_oldest_reported_token_version():
    group = Group(id=0, env="e", task_idx=0, task={}, start_version=3, url="u")
    assert group.version == 3 and group.newest_version == 3  # nothing reported: the start version
    group.rollouts = [rollout(-1, 4, 4), rollout(-1, 4, 5)]
    assert group.version == 4 and group.newest_version == 5


class RecordingServers:
    """Stands in for `InferenceServers` (which needs live servers): the load count and which servers were failed."""

    def __init__(self):
        self.load, self.failed = {"u": 1}, []

    def mark_failed(self, url: str, reason: str) -> None:
        self.failed.append((url, reason))


def test_a_server_that_restarted_unnoticed_is_caught_by_its_token_versions():
    """The server came back on base weights between two requests (no request failed): its tokens say policy 0
    although the group started on policy 3. The group is dropped as stale and the server is sent to recovery,
    which loads the current policy before it serves again."""
    from prime_rl.orchestrator.config import OrchestratorConfig
    from prime_rl.orchestrator.messages import GroupDone
    from prime_rl.orchestrator.scheduler import Scheduler

    servers = RecordingServers()
    scheduler = Scheduler(OrchestratorConfig(), buffer=None, tasks={}, servers=servers, workers=None)
    scheduler.inflight[0] = Group(0, "e", 0, {}, start_version=3, url="u")
    scheduler.on_done(GroupDone(id=0, rollouts=[rollout(0, 0), rollout(0, 0)]))
    assert servers.failed == [("u", "served policy 0, expected 3")]
    assert scheduler.stats.dropped_stale == 1 and scheduler.finished == [] and servers.load == {"u": 0}


def test_a_group_whose_server_failed_is_retried_and_the_server_paused():
    """A retryable failure (the server died mid-generation): the server goes to recovery and the group is queued
    to run again (on whichever server is healthy then); once its retries are spent it is dropped."""
    from prime_rl.orchestrator.config import OrchestratorConfig
    from prime_rl.orchestrator.messages import GroupDone
    from prime_rl.orchestrator.scheduler import Scheduler

    servers = RecordingServers()
    scheduler = Scheduler(OrchestratorConfig(max_retries=1), buffer=None, tasks={}, servers=servers, workers=None)
    lost = RolloutResult(reward=0.0, samples=[], error="ProviderError: Connection error.", retryable=True)
    group = Group(0, "e", 0, {}, start_version=0, url="u")
    scheduler.inflight[0] = group
    scheduler.on_done(GroupDone(id=0, rollouts=[lost, lost]))
    assert servers.failed == [("u", "ProviderError: Connection error.")] and scheduler.retry_queue == [group]
    assert scheduler.stats.errors == 2 and scheduler.stats.dropped_failed == 0
    group.attempts, servers.load["u"] = 2, 1  # its second (last allowed) attempt fails too
    scheduler.retry_queue.clear()
    scheduler.inflight[0] = group
    scheduler.on_done(GroupDone(id=0, rollouts=[lost, lost]))
    assert scheduler.retry_queue == [] and scheduler.stats.dropped_failed == 1
