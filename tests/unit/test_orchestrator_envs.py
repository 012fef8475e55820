"""Environment loading (every v1 shape, seats left as their author pinned them), lazy tasks, per-seat advantages,
the liveness rules, and the sampling checks of training."""

import sys
from pathlib import Path

import pytest
import verifiers.v1 as vf

from prime_rl.orchestrator.buffer import Buffer, BufferConfig
from prime_rl.orchestrator.config import EnvConfig, OrchestratorConfig
from prime_rl.orchestrator.envs import env_config_data, load_env, load_tasks
from prime_rl.orchestrator.messages import RolloutResult
from prime_rl.orchestrator.orchestrator import batch_samples
from prime_rl.orchestrator.results import untrainable_sampling
from prime_rl.orchestrator.samples import SampleTokens
from prime_rl.orchestrator.scheduler import Group, Liveness, StallError

sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))  # the test environments


def test_a_multi_agent_env_without_an_agent_field_loads_with_its_seats_as_pinned():
    """Seats get a local runtime, the token cap and our default harness only where their author set none; a seat
    that pins its own keeps it (the referee's harness, runtime and smaller cap); env options come from env_args."""
    spec = EnvConfig(id="vf-seats-env", env_args={"rounds": 2, "player": {"max_turns": 3}})
    assert env_config_data(spec, 512) == {
        "taskset": {"id": "vf-seats-env"},
        "player": {
            "max_total_tokens": 512,
            "runtime": {"type": "subprocess"},
            "harness": {"id": "prime-chat"},
            "max_turns": 3,
        },
        "referee": {"max_total_tokens": 32},
        "rounds": 2,
    }
    env = load_env(spec, 512)
    assert type(env).__name__ == "SeatsEnv" and env.config.rounds == 2
    player, referee = env.config.player, env.config.referee
    assert (player.harness.id, player.runtime.type, player.max_total_tokens, player.max_turns) == (
        "prime-chat", "subprocess", 512, 3,
    )  # fmt: skip
    assert (referee.harness.id, referee.runtime.type, referee.max_total_tokens) == ("null", "subprocess", 32)


def test_a_seat_cap_below_seq_len_is_kept_and_one_above_is_lowered():
    assert env_config_data(EnvConfig(id="vf-seats-env"), 16)["referee"]["max_total_tokens"] == 16
    assert env_config_data(EnvConfig(id="vf-seats-env"), 64)["referee"]["max_total_tokens"] == 32


def test_single_agent_tasksets_keep_their_own_harness_or_get_prime_chat():
    assert env_config_data(EnvConfig(id="reverse-text", args={"num_tasks": 5}), 128) == {
        "taskset": {"id": "reverse-text", "num_tasks": 5},
        "agent": {"max_total_tokens": 128, "runtime": {"type": "subprocess"}, "harness": {"id": "prime-chat"}},
    }
    assert env_config_data(EnvConfig(id="guess-number"), 128)["agent"]["harness"] == {"id": "guess-number"}
    assert env_config_data(EnvConfig(id="reverse-text", harness="null"), 128)["agent"]["harness"] == {"id": "null"}


def test_a_bad_env_option_names_the_environment():
    with pytest.raises(RuntimeError, match="(?s)environment .vf-seats-env.*rounds"):
        load_env(EnvConfig(id="vf-seats-env", env_args={"rounds": "many"}), 512)


def test_an_infinite_taskset_is_read_only_as_far_as_it_is_used():
    import vf_endless_env

    vf_endless_env.GENERATED.clear()
    tasks = load_tasks([EnvConfig(id="vf-endless-env")], 512)["vf-endless-env"]
    assert tasks.size is None and vf_endless_env.GENERATED == []  # nothing generated up front
    assert [t["answer"] for t in tasks.first(2)] == ["a", "bb"]  # peeking does not use tasks up
    assert [tasks.next()["answer"] for _ in range(3)] == ["a", "bb", "ccc"]
    assert vf_endless_env.GENERATED == [0, 1, 2]
    tasks.skip(2)  # a resumed run continues the stream
    assert tasks.next()["answer"] == "fff" and tasks.drawn == 6  # task 5: "f" * (1 + 5 % 3)
    # eval's num_examples caps a taskset to a finite list
    capped = load_tasks([EnvConfig(id="vf-endless-env")], 512, {"vf-endless-env": 4})["vf-endless-env"]
    assert capped.size == 4


def test_buffer_draws_new_tasks_from_an_infinite_env_and_resumes_its_stream():
    buffer = Buffer(BufferConfig(seed=0), {"endless": None, "finite": 3}, {"endless": 1.0, "finite": 1.0})
    draws = [buffer.sample_task() for _ in range(40)]
    endless = [idx for env, idx in draws if env == "endless"]
    assert endless == list(range(len(endless))) and 10 < len(endless) < 30  # each draw a new task, in order
    assert buffer.add_group("endless", endless[-1], [1.0] * 4) == "kept"
    state = buffer.state_dict()
    restored = Buffer(BufferConfig(seed=0), {"endless": None, "finite": 3}, {"endless": 1.0, "finite": 1.0})
    restored.load_state_dict(state)
    assert restored.drawn("endless") == len(endless)
    assert [restored.sample_task() for _ in range(10)] == [buffer.sample_task() for _ in range(10)]
    with pytest.raises(ValueError, match="infinite tasksets: set a `ratio`"):
        Buffer(BufferConfig(), {"endless": None, "finite": 3})


def sample(n: int) -> SampleTokens:
    return SampleTokens([1] * n, [False] + [True] * (n - 1), [0.0] + [-1.0] * (n - 1), [0] * n)


def test_advantages_are_per_seat_and_idle_seats_join_the_baseline_untrained():
    """Self-play: seat `first` rewards [1, 0, 1], seat `second` [0, 1, 0] where its third rollout never acted.
    RLOO per seat (G = 3, factor 3/2): first mean 2/3 -> [1/2, -1, 1/2]; second mean 1/3 -> [-1/2, 1, -1/2]."""
    first = [RolloutResult(reward=r, samples=[sample(4)], seat="first") for r in (1.0, 0.0, 1.0)]
    second = [RolloutResult(reward=r, samples=[sample(3)], seat="second") for r in (0.0, 1.0)]
    second.append(RolloutResult(reward=0.0, samples=[], seat="second"))
    group = Group(0, "nim", 0, {}, 0, "u", rollouts=first + second)
    config = OrchestratorConfig(advantage={"estimator": "rloo"}, rollouts_per_example=3, batch_size=3)
    samples, advantages, singletons = batch_samples([group], config)
    assert advantages == pytest.approx([0.5, -1.0, 0.5, -0.5, 1.0, -0.5])
    assert len(samples) == 5 and singletons == 0  # the idle rollout has no sample
    assert [s.advantages[0] for s in samples] == pytest.approx([0.5, -1.0, 0.5, -0.5, 1.0])
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0, 0.0, 1.0]  # the rollout's own reward, for a critic


def test_a_seat_with_one_surviving_rollout_gets_zero_and_is_counted():
    group = Group(0, "e", 0, {}, 0, "u", rollouts=[RolloutResult(reward=1.0, samples=[sample(3)])])
    config = OrchestratorConfig(advantage={"estimator": "rloo"}, rollouts_per_example=4, batch_size=4)
    samples, advantages, singletons = batch_samples([group], config)
    assert advantages == [0.0] and singletons == 1 and samples[0].advantages == [0.0] * 3


def test_samples_carry_the_temperature_their_seat_sampled_with():
    rollouts = [RolloutResult(reward=float(i), samples=[sample(3)], temperature=0.7) for i in range(2)]
    samples, _, _ = batch_samples([Group(0, "e", 0, {}, 0, "u", rollouts=rollouts)], OrchestratorConfig())
    assert {s.temperature for s in samples} == {0.7}


def too_long(n: int) -> RolloutResult:
    return RolloutResult(reward=0.0, samples=[sample(n)])


def test_liveness_ends_a_run_whose_rollouts_are_all_too_long_naming_the_cause():
    liveness = Liveness(stall_timeout=60, unusable_limit=3, seq_len=8)
    liveness.unusable([too_long(9), too_long(12)])
    liveness.usable()  # a usable group resets the streak
    liveness.unusable([too_long(9)])
    liveness.unusable([RolloutResult(reward=0.0, samples=[], error="RuntimeError: boom")])
    with pytest.raises(StallError) as e:
        liveness.unusable([too_long(10)])
    message = str(e.value)
    assert "no usable rollout in the last 3 groups (3 rollouts)" in message
    assert (
        "2 with no sampled token within seq_len=8 (the longest 10 tokens)" in message
        and "1 failed, e.g. 'RuntimeError: boom'" in message
    )


def test_scheduler_trains_a_rollout_longer_than_seq_len_on_its_first_seq_len_tokens():
    """As upstream prime-rl: a 7-token rollout under seq_len 5 is kept cut to 5 tokens and marked truncated (so
    `mask_truncated_completions` can mask it); one whose context alone fills seq_len has nothing to train and is
    dropped as too long; a rollout that fits is untouched."""
    import asyncio

    from scheduler_stand_ins import RecordingWorkers, StandInServers

    from prime_rl.orchestrator.messages import GroupDone
    from prime_rl.orchestrator.scheduler import Scheduler

    config = OrchestratorConfig(seq_len=5, filter_zero_advantage=False)
    scheduler = Scheduler(config, Buffer(BufferConfig(), {"e": 4}), {}, StandInServers(), RecordingWorkers())
    asyncio.run(scheduler._submit(Group(0, "e", 0, {}, 0, "u")))
    long = SampleTokens([1] * 7, [False] * 3 + [True] * 4, [0.0] * 3 + [-1.0] * 4, [-1] * 3 + [0] * 4)
    prompt_fills = SampleTokens([1] * 7, [False] * 6 + [True], [0.0] * 6 + [-1.0], [-1] * 6 + [0])
    rollouts = [RolloutResult(1.0, [long]), RolloutResult(0.0, [prompt_fills]), RolloutResult(0.5, [sample(4)])]
    scheduler.on_done(GroupDone(id=0, rollouts=rollouts))
    (group,) = scheduler.finished
    assert [r.reward for r in group.rollouts] == [1.0, 0.5]
    cut, fits = group.rollouts
    assert (
        cut.truncated and cut.samples[0].token_ids == [1] * 5 and cut.samples[0].loss_mask == [False] * 3 + [True] * 2
    )
    assert not fits.truncated and fits.samples == [sample(4)]
    assert (scheduler.stats.cut_to_seq_len, scheduler.stats.dropped_too_long) == (1, 1)
    masked = OrchestratorConfig(seq_len=5, mask_truncated_completions=True)
    samples, _, _ = batch_samples([group], masked)
    assert [any(s.loss_mask) for s in samples] == [False, True]


def test_liveness_stall_clock_restarts_on_progress(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("prime_rl.orchestrator.scheduler.time.monotonic", lambda: now[0])
    liveness = Liveness(stall_timeout=60, unusable_limit=3, seq_len=8)
    liveness.wasted["filtered"] += 5
    now[0] += 59
    liveness.check({})
    now[0] += 2
    with pytest.raises(StallError, match="no group accepted for 61s .* finished but not accepted: 5 filtered"):
        liveness.check({})
    liveness.progress()
    liveness.check({})


def test_training_refuses_distributions_the_trainer_does_not_score():
    ok = vf.SamplingConfig(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0)
    assert untrainable_sampling(ok) is None
    assert "top_p=0.9" in untrainable_sampling(vf.SamplingConfig(temperature=1.0, top_p=0.9))
    assert "top_k=20" in untrainable_sampling(vf.SamplingConfig(temperature=1.0, top_k=20))
    assert "greedy" in untrainable_sampling(vf.SamplingConfig(temperature=0.0))


@pytest.mark.parametrize(
    ("sampling", "needle"),
    [({"temperature": 0}, "temperature must be > 0"), ({"top_p": 0.9}, "top_p = 0.9: training samples")],
)
def test_training_sampling_is_refused_at_config_time(sampling, needle):
    with pytest.raises(ValueError, match=needle):
        OrchestratorConfig(sampling=sampling)
