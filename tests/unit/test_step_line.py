"""The orchestrator's step line: a multi-seat environment shows each seat's mean reward (a zero-sum game's mean over
its seats is always 0, which would read as "not learning")."""

from loguru import logger

from prime_rl.orchestrator.messages import RolloutResult
from prime_rl.orchestrator.orchestrator import log_step, seat_line
from prime_rl.orchestrator.scheduler import Group


def group(env: str, *seats_rewards: tuple[str, float]) -> Group:
    rollouts = [RolloutResult(reward=reward, samples=[], seat=seat) for seat, reward in seats_rewards]
    return Group(0, env, 0, {}, 0, "u", rollouts=rollouts)


def test_seat_line_shows_multi_seat_envs_only():
    groups = [
        group("nim", ("first", 1.0), ("second", -1.0), ("first", 0.0), ("second", 0.0)),
        group("nim", ("first", 1.0), ("second", -1.0)),
        group("reverse-text", ("agent", 0.25), ("agent", 0.75)),
    ]
    assert seat_line(groups) == "nim first 0.6667 second -0.6667"
    assert seat_line(groups[2:]) == ""


def test_the_step_line_carries_the_seats_after_the_reward():
    metrics = {
        "reward/mean": 0.0, "seq_len/mean": 10, "tokens_per_s": 1, "rollouts_per_s": 1, "async_lag/max": 0,
        "async_lag/mean": 0, "time/wait_for_weights": 0, "time/update_weights": 0, "errors": 0, "dropped/stale": 0,
        "dropped/too_long": 0, "dropped/failed": 0, "filtered": 0,
    }  # fmt: skip
    lines = []
    sink = logger.add(lines.append, format="{message}")
    try:
        logged = []
        monitor = type("Monitor", (), {"log": lambda self, step, m: logged.append(step)})()
        log_step(3, metrics, monitor, "nim first 0.5000 second -0.5000")
        log_step(4, metrics, monitor)
    finally:
        logger.remove(sink)
    assert lines[0].startswith("step 3 | reward 0.0000 (nim first 0.5000 second -0.5000) | seq 10 |")
    assert lines[1].startswith("step 4 | reward 0.0000 | seq 10 |") and logged == [3, 4]
