"""The advantage-range gate: its band on hand-computed advantages, and that the scheduler replaces a rejected group."""

import asyncio

import pytest
from scheduler_stand_ins import FourTasks, PoolServers, RecordingWorkers

from prime_rl.config.curriculum import AdvantageRangeGate
from prime_rl.orchestrator.config import AdvantageConfig, OrchestratorConfig
from prime_rl.orchestrator.gate import group_advantages, in_band, rejects
from prime_rl.orchestrator.messages import RolloutResult
from prime_rl.orchestrator.samples import SampleTokens


def rollout(reward: float, seat: str = "agent", acted: bool = True, truncated: bool = False) -> RolloutResult:
    samples = [SampleTokens([1, 2], [False, True], [0.0, -1.0], [0, 0])] if acted else []
    return RolloutResult(reward=reward, samples=samples, seat=seat, truncated=truncated)


def gate(low: float, high: float) -> AdvantageRangeGate:
    return AdvantageRangeGate(low=low, high=high)


def test_band_is_inclusive_and_needs_every_advantage_inside():
    assert in_band([0.0, 0.0], 0.0, 0.0)
    assert in_band([-0.05, 0.05], -0.05, 0.05)  # both ends belong to the band
    assert not in_band([-0.05, 0.0625], -0.05, 0.05)  # one advantage outside: the group carries signal
    assert not in_band([], -1.0, 1.0)  # nothing to judge: admitted


def test_advantages_are_the_estimators_per_seat():
    grpo = AdvantageConfig()
    # grpo: r - mean. Rewards 1, 0, 0, 0: mean 0.25 -> 0.75, -0.25, -0.25, -0.25.
    assert group_advantages([rollout(r) for r in (1.0, 0.0, 0.0, 0.0)], grpo) == [0.75, -0.25, -0.25, -0.25]
    # rloo: r - mean of the others. Rewards 1, 0, 0 -> 1 - 0, 0 - 0.5, 0 - 0.5.
    rloo = AdvantageConfig(estimator="rloo")
    assert group_advantages([rollout(r) for r in (1.0, 0.0, 0.0)], rloo) == [1.0, -0.5, -0.5]
    # Seats are their own groups: first 1, 0 (mean 0.5) and second 0.5, 0.5 (no signal), interleaved.
    mixed = [rollout(1.0, "first"), rollout(0.5, "second"), rollout(0.0, "first"), rollout(0.5, "second")]
    assert group_advantages(mixed, grpo) == [0.5, 0.0, -0.5, 0.0]


@pytest.mark.parametrize(
    ("rewards", "low", "high", "rejected"),
    [
        ([1.0, 1.0, 1.0, 1.0], 0.0, 0.0, True),  # all equal: every advantage 0
        ([1.0, 0.0, 0.0, 0.0], 0.0, 0.0, False),  # 0.75, -0.25, ...
        ([1.0, 0.0, 0.0, 0.0], -0.25, 0.75, True),  # the band holds all four
        ([1.0, 0.0, 0.0, 0.0], -0.25, 0.5, False),  # 0.75 lies above it
        ([1.0, 0.75, 0.75, 0.5], -0.25, 0.25, True),  # mean 0.75: 0.25, 0, 0, -0.25, both ends inside
        ([1.0, 0.5], -0.125, 0.125, False),  # +-0.25
    ],
)
def test_gate_rejects_groups_whose_advantages_all_lie_in_the_band(rewards, low, high, rejected):
    assert rejects(gate(low, high), [rollout(r) for r in rewards], AdvantageConfig(), False) is rejected


def test_only_trained_rollouts_are_judged():
    # Seat `second` never acted (no samples): its advantages 0.5, -0.5 are not trained and do not save the group;
    # the trained seat `first` has rewards 1, 1: advantages 0, 0 -> rejected by the zero band.
    group = [rollout(1.0, "first"), rollout(1.0, "first"), rollout(1.0, "second", False), rollout(0.0, "second", False)]
    assert rejects(gate(0.0, 0.0), group, AdvantageConfig(), False)
    # Truncated rollouts are masked (`mask_truncated_completions`): 1, 0 -> +-0.5, but only the untruncated 0.5 counts.
    group = [rollout(1.0), rollout(0.0, truncated=True)]
    assert not rejects(gate(0.0, 0.25), group, AdvantageConfig(), False)  # -0.5 is trained and outside
    assert not rejects(gate(0.0, 0.25), group, AdvantageConfig(), True)  # 0.5 alone, outside
    assert rejects(gate(0.0, 0.5), group, AdvantageConfig(), True)  # 0.5 alone, inside; -0.5 masked
    assert not rejects(gate(0.0, 0.5), group, AdvantageConfig(), False)


def test_a_rejected_group_is_counted_and_replaced():
    """Two groups in flight (batch 4, groups of 2). Group 0 ends with rewards 1, 0.5 (advantages +-0.25, inside
    the band [-0.25, 0.25]): rejected, counted, and the next top-up starts one replacement, group 2. Group 1 ends
    with rewards 1, 0 (+-0.5) and is accepted."""
    from prime_rl.orchestrator.buffer import Buffer, BufferConfig
    from prime_rl.orchestrator.messages import GroupDone
    from prime_rl.orchestrator.scheduler import Scheduler

    config = OrchestratorConfig(
        batch_size=4,
        rollouts_per_example=2,
        env=[{"id": "e", "gate": {"type": "advantage_range", "low": -0.25, "high": 0.25}}],  # fmt: skip
    )
    workers = RecordingWorkers()
    scheduler = Scheduler(config, Buffer(BufferConfig(), {"e": 4}), {"e": FourTasks()}, PoolServers(), workers)
    asyncio.run(scheduler.top_up(1))
    assert [r.id for r in workers.requests] == [0, 1]
    scheduler.on_done(GroupDone(id=0, rollouts=[rollout(1.0), rollout(0.5)]))
    assert scheduler.finished == [] and scheduler.stats.gate_rejected == {"e": 1} and scheduler.stats.filtered == 1
    assert scheduler.liveness.wasted == {"rejected by the gate": 1}
    asyncio.run(scheduler.top_up(1))
    assert [r.id for r in workers.requests] == [0, 1, 2]  # one replacement for the one rejected
    scheduler.on_done(GroupDone(id=1, rollouts=[rollout(1.0), rollout(0.0)]))
    assert [g.id for g in scheduler.finished] == [1] and scheduler.stats.gate_rejected == {"e": 1}


def test_without_a_gate_the_same_group_is_accepted():
    from prime_rl.orchestrator.buffer import Buffer, BufferConfig
    from prime_rl.orchestrator.messages import GroupDone
    from prime_rl.orchestrator.scheduler import Group, Scheduler

    config = OrchestratorConfig(batch_size=4, rollouts_per_example=2, env=[{"id": "e"}])
    scheduler = Scheduler(
        config, Buffer(BufferConfig(), {"e": 4}), {"e": FourTasks()}, PoolServers(), RecordingWorkers()
    )
    assert scheduler.gates == {}
    asyncio.run(scheduler._submit(Group(0, "e", 0, {}, 0, "u")))
    scheduler.on_done(GroupDone(id=0, rollouts=[rollout(1.0), rollout(0.5)]))
    assert [g.id for g in scheduler.finished] == [0] and scheduler.stats.gate_rejected == {}
