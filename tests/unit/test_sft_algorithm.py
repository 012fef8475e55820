"""`sft` (hard distillation): a frozen teacher samples an environment's groups, the policy trains with ce on its tokens.

The scheduler sends such a group to the teacher (its URL and model name, no policy gate, outside the policy servers'
load), never ages it out of a batch, and retries a failed one at the teacher without blaming a policy server; the
batch trains its sampled tokens with weight-1 ce and nothing else; the workers hold the teacher's own key."""

import asyncio

import pytest
from scheduler_stand_ins import FourTasks, PoolServers, RecordingWorkers
from test_batch_advantages import group, rollout

from prime_rl.orchestrator.buffer import Buffer, BufferConfig
from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.orchestrator.messages import GroupDone, RolloutResult
from prime_rl.orchestrator.orchestrator import batch_samples
from prime_rl.orchestrator.samples import SampleTokens
from prime_rl.orchestrator.scheduler import Scheduler
from prime_rl.orchestrator.worker import worker_tokens

TEACHER = {"name": "big-teacher", "base_url": "http://10.0.0.9:8001/v1", "api_key_var": "MY_TEACHER_KEY"}


def teacher_rollout(reward: float, label: int = 7) -> RolloutResult:
    """A teacher's rollout: vLLM labels its tokens with the teacher's own weights' version (here `step_7`)."""
    return RolloutResult(
        reward=reward, samples=[SampleTokens([1, 2, 3], [False, True, True], [0.0, -1, -2], [label] * 3)]
    )


def sft_scheduler(**overrides) -> tuple[Scheduler, RecordingWorkers]:
    config = OrchestratorConfig(
        batch_size=2,
        rollouts_per_example=2,
        env=[{"id": "e", "algo": {"type": "sft", "teacher": TEACHER}}],
        **overrides,
    )
    workers = RecordingWorkers()
    return Scheduler(config, Buffer(BufferConfig(), {"e": 4}), {"e": FourTasks()}, PoolServers(), workers), workers


def test_a_teacher_samples_the_group_and_it_never_goes_stale():
    scheduler, workers = sft_scheduler()
    asyncio.run(scheduler.top_up(1))
    request = workers.requests[0]
    assert (request.base_url, request.model, request.policy_gate) == (TEACHER["base_url"], "big-teacher", None)
    assert scheduler.servers.load == {"u": 0}  # the policy server carries none of it
    scheduler.on_done(GroupDone(id=request.id, rollouts=[teacher_rollout(1.0), teacher_rollout(0.0)]))
    [accepted] = scheduler.finished
    assert accepted.frozen and accepted.version == 0  # its tokens' `step_7` is the teacher's, not a policy step
    # Five policy steps later, at k = 0, a policy group started at step 0 would be dropped; the teacher's is trained.
    scheduler.servers.version = 5
    batch = asyncio.run(scheduler.collect(6))
    assert batch == [accepted] and scheduler.stats.dropped_stale == 0


def test_a_failed_teacher_group_is_retried_at_the_teacher_without_blaming_a_policy_server():
    scheduler, workers = sft_scheduler()
    asyncio.run(scheduler.top_up(1))
    first = workers.requests[0]
    failed = RolloutResult(reward=0.0, samples=[], error="ConnectError", retryable=True)
    scheduler.on_done(GroupDone(id=first.id, rollouts=[failed]))
    assert scheduler.servers.failed == [] and scheduler.stats.errors == 1
    asyncio.run(scheduler.top_up(1))
    retry = next(r for r in workers.requests[1:] if r.id == first.id)
    assert retry.base_url == TEACHER["base_url"] and retry.model == "big-teacher"


def test_an_sft_sample_trains_the_teachers_tokens_with_ce_alone():
    """Env `text` runs sft: its sample's rl mask is off, its ce weights are 1 exactly on the sampled tokens, it names
    no policy version and is scored at temperature 1 (the policy's plain softmax, whatever the teacher sampled at);
    env `game` (grpo) is unchanged (advantages +-0.5, no ce)."""
    cfg = OrchestratorConfig(
        env=[
            {"id": "reverse-text", "name": "text", "algo": {"type": "sft", "teacher": TEACHER}},
            {"id": "nim", "name": "game"},
        ],
        rollouts_per_example=2,
        batch_size=4,
        sampling={"temperature": 0.7},
    )
    groups = [group("text", rollout(1.0), rollout(0.0)), group("game", rollout(1.0), rollout(0.0))]
    samples, advantages, _ = batch_samples(groups, cfg)
    assert advantages == [0.0, 0.0, 0.5, -0.5]
    imitated, played = samples[0], samples[2]
    mask = rollout(1.0).samples[0].loss_mask
    assert imitated.loss_mask == [False] * len(mask) and imitated.ce_weights == [float(m) for m in mask]
    assert any(imitated.ce_weights) and imitated.policy_versions == [] and imitated.temperature == 1.0
    assert played.loss_mask == mask and played.ce_weights == [] and played.temperature == 0.7


def test_workers_hold_the_teachers_own_key_and_never_hand_it_the_run_token(monkeypatch):
    monkeypatch.setenv("PRIME_API_KEY_X", "policy-token")
    monkeypatch.setenv("MY_TEACHER_KEY", "teacher-token")
    client = {"api_key_var": "PRIME_API_KEY_X"}
    sft = {"id": "reverse-text", "algo": {"type": "sft", "teacher": TEACHER}}
    config = OrchestratorConfig(client=client, env=[sft])
    assert worker_tokens(config) == {"PRIME_API_KEY_X": "policy-token", "MY_TEACHER_KEY": "teacher-token"}
    monkeypatch.delenv("MY_TEACHER_KEY")  # unset: the teacher gets no token at all, not the run's
    assert worker_tokens(config) == {"PRIME_API_KEY_X": "policy-token"}
    served = {"id": "reverse-text", "algo": {"type": "sft", "teacher": TEACHER | {"api_key_var": "PRIME_API_KEY_X"}}}
    assert worker_tokens(OrchestratorConfig(client=client, env=[served])) == {"PRIME_API_KEY_X": "policy-token"}


def test_sft_without_a_teacher_names_the_fix():
    alone = OrchestratorConfig(env=[{"id": "reverse-text", "algo": {"type": "sft"}}])  # `rl` may fill it
    with pytest.raises(ValueError, match=r"reverse-text: algo sft needs a teacher: .*`\[teacher\]` in rl"):
        Scheduler(
            alone, Buffer(BufferConfig(), {"reverse-text": 4}), {"reverse-text": FourTasks()}, PoolServers(), None
        )
