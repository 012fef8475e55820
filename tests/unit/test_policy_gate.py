"""Groups started before their policy: which group may start gated, and the gate that holds its model calls."""

import asyncio

from prime_rl.orchestrator.buffer import Buffer, BufferConfig
from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.orchestrator.messages import RolloutResult
from prime_rl.orchestrator.patches import PolicyGate
from prime_rl.orchestrator.samples import SampleTokens
from prime_rl.orchestrator.scheduler import Group, Scheduler


class StandInServers:
    """Stands in for `InferenceServers` (which needs live servers): one healthy server serving `version`."""

    def __init__(self, version: int):
        self.load, self.version = {"u": 0}, version

    def least_loaded(self) -> str:
        return "u"

    def model_name(self, version, default):
        return default


class StandInTasks:
    """A finite taskset of three empty tasks (`EnvTasks` reads a real one)."""

    size = 3

    def __getitem__(self, idx: int) -> dict:
        return {}


class RecordingWorkers:
    """Stands in for the rollout workers: keeps the groups and the policy announcements they are sent."""

    def __init__(self):
        self.requests, self.served = [], []

    async def submit(self, request):
        self.requests.append(request)

    async def policy_served(self, step):
        self.served.append(step)


def scheduler(version: int, k: int = 0) -> tuple[Scheduler, RecordingWorkers]:
    """Batches of 16 rollouts, groups of 4: 4 groups in flight."""
    config = OrchestratorConfig(batch_size=16, rollouts_per_example=4, max_async_level=k)
    assert config.groups_in_flight == 4
    tasks = {"e": StandInTasks()}
    workers = RecordingWorkers()
    return Scheduler(config, Buffer(BufferConfig(), {"e": 3}), tasks, StandInServers(version), workers), workers


def finished_group(i: int, rollouts: int = 4) -> Group:
    sample = SampleTokens([1, 2], [False, True], [0.0, -1.0], [0, 0])
    return Group(i, "e", 0, {}, 2, "u", rollouts=[RolloutResult(reward=0.0, samples=[sample])] * rollouts)


def test_the_next_batch_starts_gated_on_the_next_policy_once_nothing_can_run():
    """k = 0, filling batch 3 (it needs pi_2, which the servers serve). Its 4 groups start ungated; while they run
    nothing else starts. Once they finished, the 4 groups of batch 4 start gated on pi_3 (the trainer trains it
    from batch 3 meanwhile), labelled with the policy they will sample with; then nothing more (batch 5 needs pi_4,
    two steps ahead)."""
    s, workers = scheduler(version=2)
    asyncio.run(s.top_up(3))
    assert [r.policy_gate for r in workers.requests] == [None] * 4
    assert s.next_group_gate(3) == -1
    s.finished, s.inflight = list(s.inflight.values()), {}
    for g in s.finished:
        g.rollouts = finished_group(g.id).rollouts
    asyncio.run(s.top_up(3))
    assert [r.policy_gate for r in workers.requests[4:]] == [3] * 4
    assert [g.start_version for g in s.inflight.values()] == [3] * 4
    assert s.next_group_gate(3) == -1


def test_a_batch_short_of_rollouts_gets_an_ungated_group_beside_gated_ones():
    """Batch 3 lost a group (3 of 4 finished) while 4 gated groups wait for pi_3, which needs batch 3: the missing
    group starts ungated although 4 groups are in flight already; a gated group would never finish."""
    s, _ = scheduler(version=2)
    s.finished = [finished_group(i) for i in range(3)]
    s.inflight = {i: Group(i, "e", 0, {}, 3, "u", gate=3) for i in range(10, 14)}
    assert s.next_group_gate(3) is None


def test_a_group_that_lost_rollouts_leaves_room_counted_in_rollouts():
    """Batch 3 has 15 rollouts finished (a group lost one): one more ungated group, not a gated one."""
    s, _ = scheduler(version=2)
    s.finished = [finished_group(0), finished_group(1), finished_group(2), finished_group(3, rollouts=3)]
    assert s.next_group_gate(3) is None


def test_gated_groups_run_once_their_policy_is_served_and_the_workers_hear_it_once():
    s, workers = scheduler(version=2)
    s.inflight = {0: Group(0, "e", 0, {}, 3, "u", gate=3)}
    assert s.gated(s.inflight[0])
    asyncio.run(s.announce_policy())
    s.servers.version = 3
    asyncio.run(s.announce_policy())
    asyncio.run(s.announce_policy())
    assert workers.served == [2, 3]
    assert not s.gated(s.inflight[0])


def test_at_k_1_groups_start_ungated_as_far_as_the_bound_allows():
    """k = 1 with pi_2 served: batches 3 and 4 may use it (8 groups), so the 4 slots all go ungated."""
    s, workers = scheduler(version=2, k=1)
    asyncio.run(s.top_up(3))
    assert [r.policy_gate for r in workers.requests] == [None] * 4


def test_the_gate_holds_a_call_until_its_policy_step_is_served():
    async def main():
        gate = PolicyGate()
        gate.advance(2)
        await asyncio.wait_for(gate.wait(2), 1)  # served already: no wait
        waiting = asyncio.create_task(gate.wait(3))
        cancelled = asyncio.create_task(gate.wait(4))
        await asyncio.sleep(0)
        gate.advance(2)
        await asyncio.sleep(0)
        assert not waiting.done()
        cancelled.cancel()
        gate.advance(3)
        await asyncio.wait_for(waiting, 1)
        assert [step for step, _ in gate.waiters] == [4]
        gate.advance(5)  # a cancelled waiter is dropped without error
        assert gate.waiters == [] and gate.served == 5

    asyncio.run(main())
