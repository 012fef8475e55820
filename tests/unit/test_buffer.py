"""Task buffer: env ratios, online difficulty filtering, retirement, exhaustion, exact state round trips."""

import json
import math

import pytest
from pydantic import ValidationError

from prime_rl.orchestrator.buffer import Buffer, BufferConfig


def counts(buffer: Buffer, n: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for _ in range(n):
        env, _task = buffer.sample_task()
        out[env] = out.get(env, 0) + 1
    return out


# Binomial tolerance for a fraction p estimated from n draws: sd = sqrt(p(1-p)/n); 4 sd is a ~6e-5 flake rate.
def tolerance(p: float, n: int) -> float:
    return 4 * math.sqrt(p * (1 - p) / n)


def test_ratio_3_to_1():
    # p=0.75, n=4000: sd = sqrt(0.75 * 0.25 / 4000) ≈ 0.0068, so 4 sd ≈ 0.027.
    buffer = Buffer(BufferConfig(seed=1), {"a": 10, "b": 1000}, env_ratios={"a": 3.0, "b": 1.0})
    n = 4000
    frac_a = counts(buffer, n).get("a", 0) / n
    assert abs(frac_a - 0.75) < tolerance(0.75, n)


def test_default_is_proportional_to_size():
    # 100 vs 300 tasks: p(a) = 0.25, n=4000, sd ≈ 0.0068.
    buffer = Buffer(BufferConfig(seed=2), {"a": 100, "b": 300})
    n = 4000
    frac_a = counts(buffer, n).get("a", 0) / n
    assert abs(frac_a - 0.25) < tolerance(0.25, n)


def test_tasks_are_uniform_within_env():
    buffer = Buffer(BufferConfig(seed=3), {"a": 4})
    n = 4000
    per_task = [0] * 4
    for _ in range(n):
        env, task = buffer.sample_task()
        assert env == "a" and 0 <= task < 4
        per_task[task] += 1
    for c in per_task:
        assert abs(c / n - 0.25) < tolerance(0.25, n)


def test_same_seed_same_sequence_different_seed_differs():
    def seq(seed):
        buffer = Buffer(BufferConfig(seed=seed), {"a": 50, "b": 70}, {"a": 1.0, "b": 2.0})
        return [buffer.sample_task() for _ in range(200)]

    assert seq(7) == seq(7)
    assert seq(7) != seq(8)


@pytest.mark.parametrize(
    ("rewards", "expected"),
    [
        ([1.0, 1.0, 1.0], "filtered_easy"),
        ([0.0, 0.0, 0.0], "filtered_hard"),
        ([1.0, 0.0, 1.0], "kept"),
        ([0.5, 0.5, 0.5], "kept"),  # zero advantage, but left to the advantage-side filter
    ],
)
def test_online_difficulty_filtering(rewards, expected):
    buffer = Buffer(BufferConfig(online_difficulty_filtering=True), {"a": 3})
    assert buffer.add_group("a", 0, rewards) == expected
    m = buffer.metrics()
    assert m["filtered/easy"] == (expected == "filtered_easy")
    assert m["filtered/hard"] == (expected == "filtered_hard")


@pytest.mark.parametrize("rewards", [[1.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
def test_filtering_disabled_always_keeps(rewards):
    buffer = Buffer(BufferConfig(), {"a": 3})
    assert buffer.add_group("a", 0, rewards) == "kept"
    assert buffer.metrics()["filtered/easy"] == buffer.metrics()["filtered/hard"] == 0


def test_thresholds_retire_and_stop_sampling():
    config = BufferConfig(seed=4, easy_threshold=0.9, hard_threshold=0.1)
    buffer = Buffer(config, {"a": 5, "b": 3})
    assert buffer.add_group("a", 2, [1.0, 1.0, 0.8]) == "kept"  # mean 0.93 >= 0.9: easy
    assert buffer.add_group("b", 0, [0.0, 0.2, 0.0]) == "kept"  # mean 0.07 <= 0.1: hard
    assert buffer.add_group("a", 3, [0.5, 0.5]) == "kept"  # stays active
    m = buffer.metrics()
    assert (m["retired/easy"], m["retired/hard"]) == (1, 1)
    assert (m["pool/active"], m["pool/easy"], m["pool/hard"]) == (6, 1, 1)
    assert (m["pool/active/a"], m["pool/active/b"]) == (4, 2)
    seen = {buffer.sample_task() for _ in range(3000)}
    assert ("a", 2) not in seen and ("b", 0) not in seen
    assert seen == {("a", 0), ("a", 1), ("a", 3), ("a", 4), ("b", 1), ("b", 2)}


def test_retired_task_group_in_flight_changes_no_pool():
    buffer = Buffer(BufferConfig(online_difficulty_filtering=True, easy_threshold=1.0), {"a": 2})
    assert buffer.add_group("a", 0, [1.0, 1.0]) == "filtered_easy"
    assert buffer.add_group("a", 0, [1.0, 1.0]) == "filtered_easy"
    m = buffer.metrics()
    assert (m["filtered/easy"], m["retired/easy"], m["pool/easy"], m["pool/active"]) == (2, 1, 1, 1)


def test_env_without_active_tasks_is_skipped():
    buffer = Buffer(BufferConfig(easy_threshold=0.5), {"a": 2, "b": 2}, {"a": 100.0, "b": 1.0})
    buffer.add_group("a", 0, [1.0])
    buffer.add_group("a", 1, [1.0])
    assert {buffer.sample_task()[0] for _ in range(100)} == {"b"}


def test_exhaustion_raises():
    buffer = Buffer(BufferConfig(easy_threshold=0.8, hard_threshold=0.2), {"a": 1, "b": 1})
    buffer.add_group("a", 0, [1.0])
    buffer.add_group("b", 0, [0.0])
    with pytest.raises(RuntimeError, match=r"every task .* retired.*easy_threshold=0.8.*hard_threshold=0.2"):
        buffer.sample_task()


def test_reset_step_metrics_keeps_pools():
    buffer = Buffer(BufferConfig(online_difficulty_filtering=True, hard_threshold=0.0), {"a": 3})
    buffer.add_group("a", 1, [0.0, 0.0])
    buffer.reset_step_metrics()
    m = buffer.metrics()
    assert (m["filtered/hard"], m["retired/hard"], m["pool/hard"], m["pool/active"]) == (0, 0, 1, 2)


@pytest.mark.parametrize(
    ("ratios", "match"),
    [
        ({"a": 1.0}, "missing"),
        ({"a": 1.0, "b": 1.0, "c": 1.0}, "unknown"),
        ({"a": 1.0, "b": 0.0}, "positive"),
        ({"a": 1.0, "b": -2.0}, "positive"),
        ({"a": 1.0, "b": math.inf}, "positive"),
    ],
)
def test_bad_ratios(ratios, match):
    with pytest.raises(ValueError, match=match):
        Buffer(BufferConfig(), {"a": 1, "b": 1}, ratios)


def test_bad_thresholds():
    with pytest.raises(ValidationError, match="must be > hard_threshold"):
        BufferConfig(easy_threshold=0.3, hard_threshold=0.3)
    BufferConfig(easy_threshold=0.3)  # one side alone is fine


def test_bad_inputs():
    with pytest.raises(ValueError, match="at least one"):
        Buffer(BufferConfig(), {})
    with pytest.raises(ValueError, match="at least one"):
        Buffer(BufferConfig(), {"a": 0})
    buffer = Buffer(BufferConfig(), {"a": 2})
    with pytest.raises(ValueError, match="unknown environment"):
        buffer.add_group("z", 0, [1.0])
    with pytest.raises(ValueError, match="out of range"):
        buffer.add_group("a", 2, [1.0])
    with pytest.raises(ValueError, match="no rewards"):
        buffer.add_group("a", 0, [])
    with pytest.raises(ValueError, match="non-finite"):
        buffer.add_group("a", 0, [math.nan])


def make_buffer() -> Buffer:
    config = BufferConfig(seed=11, online_difficulty_filtering=True, easy_threshold=0.75, hard_threshold=0.25)
    return Buffer(config, {"a": 40, "b": 25}, {"a": 1.0, "b": 1.0})


def drive(buffer: Buffer, steps: int) -> list[tuple[str, int, str]]:
    """Sample and report groups whose rewards are a deterministic function of the task, retiring some."""
    out = []
    for _ in range(steps):
        env, task = buffer.sample_task()
        reward = (task % 5) / 4  # 0, 0.25, 0.5, 0.75, 1: retires hard/easy for 0, 1, 3, 4 mod 5
        out.append((env, task, buffer.add_group(env, task, [reward, reward])))
    return out


def test_state_round_trip_continues_identically():
    k, m = 30, 40
    uninterrupted = make_buffer()
    drive(uninterrupted, k)
    # Through JSON, as a checkpoint would store it.
    state = json.loads(json.dumps(uninterrupted.state_dict()))
    metrics_at_save = uninterrupted.metrics()

    resumed = make_buffer()
    resumed.load_state_dict(state)
    assert resumed.metrics() == metrics_at_save
    assert drive(resumed, m) == drive(uninterrupted, m)
    assert resumed.metrics() == uninterrupted.metrics()
    assert resumed.state_dict() == uninterrupted.state_dict()


def test_load_rejects_other_envs():
    state = make_buffer().state_dict()
    with pytest.raises(ValueError, match="environments"):
        Buffer(BufferConfig(), {"a": 40}).load_state_dict(state)
    with pytest.raises(ValueError, match="tasks"):
        Buffer(BufferConfig(), {"a": 40, "b": 26}).load_state_dict(state)


def test_large_env_sampling():
    # 100k tasks per env with many retirements; swap-pop keeps every call O(envs), not O(tasks).
    buffer = Buffer(BufferConfig(seed=5, easy_threshold=1.0), {"a": 100_000, "b": 100_000})
    for i in range(0, 100_000, 2):
        buffer.add_group("a", i, [1.0])
    assert buffer.metrics()["pool/active/a"] == 50_000
    for _ in range(20_000):
        env, task = buffer.sample_task()
        assert env == "b" or task % 2 == 1
