"""Temperature scaling by reward spread: the pure update, the per-environment controller and its checkpoint state,
the config's bounds, and the scheduler sending each group at its environment's temperature."""

import asyncio
import json

import pytest
from pydantic import ValidationError
from scheduler_stand_ins import RecordingWorkers, StandInServers

from prime_rl.orchestrator.config import OrchestratorConfig, TrainSamplingConfig
from prime_rl.orchestrator.messages import RolloutResult
from prime_rl.orchestrator.samples import SampleTokens
from prime_rl.orchestrator.temperature import TemperatureController, next_temperature, reward_spread


def step(t, spread, threshold=0.0, up=2.0, down=0.5, low=0.5, high=1.6):
    return next_temperature(t, spread, threshold, up, down, low, high)


def test_temperature_rises_while_rewards_do_not_vary_and_relaxes_when_they_do():
    # Factors 2 and 0.5 keep every value exact in binary floating point. Base = min = 0.5, max = 1.6.
    # constant: 0.5 -> 1.0 -> 2.0 capped 1.6 -> 1.6; varied: 1.6 -> 0.8 -> 0.4 floored 0.5 -> 0.5
    sequence, t = [], 0.5
    for spread in (0.0, 0.0, 0.0, 0.3, 0.3, 0.3):
        t = step(t, spread)
        sequence.append(t)
    assert sequence == [1.0, 1.6, 1.6, 0.8, 0.5, 0.5]


def test_threshold_is_inclusive_and_min_may_lie_below_the_base():
    assert step(0.5, 0.1, threshold=0.1) == 1.0  # std <= threshold: not varying
    assert step(0.5, 0.100001, threshold=0.1) == 0.5
    # min 0.25 below the base 0.5: relaxing cools below the base, down to min.
    assert [step(0.5, 1.0, low=0.25), step(0.25, 1.0, low=0.25)] == [0.25, 0.25]


def test_reward_spread_is_the_largest_per_seat_population_std():
    assert reward_spread({"agent": [1.0, 1.0, 1.0]}) == 0.0
    assert reward_spread({"agent": [1.0, 0.0]}) == 0.5  # population std of [1, 0]
    # Seats do not share a baseline: a varying seat counts even if the other one is constant.
    assert reward_spread({"first": [1.0, 1.0], "second": [0.0, 1.0, 1.0, 0.0]}) == 0.5


def scaling(**values) -> TrainSamplingConfig:
    return TrainSamplingConfig(temperature=values.pop("temperature", 1.0), temperature_scaling=values)


def test_controller_keeps_one_temperature_per_environment():
    # up 1.25, down 0.8 (exact in binary for these products); base 1.0, max 2.0.
    controller = TemperatureController(scaling(up=1.25, down=0.8, max_temperature=2.0), ["math", "code"])
    assert controller.metrics() == {"sampling/temperature/math": 1.0, "sampling/temperature/code": 1.0}
    controller.observe("math", {"agent": [1.0, 1.0]})  # all solved: 1.0 * 1.25
    controller.observe("math", {"agent": [0.0, 0.0]})  # all failed: 1.25 * 1.25
    controller.observe("code", {"agent": [1.0, 0.0]})  # varied, at the base already: stays 1.0
    assert controller.temperature("math") == 1.5625 and controller.temperature("code") == 1.0
    controller.observe("math", {"agent": [1.0, 0.0]})  # 1.5625 * 0.8
    assert controller.metrics() == {"sampling/temperature/math": 1.25, "sampling/temperature/code": 1.0}


def test_controller_state_round_trips_through_json():
    controller = TemperatureController(scaling(up=1.25, max_temperature=2.0), ["a", "b"])
    controller.observe("a", {"agent": [1.0, 1.0]})
    restored = TemperatureController(scaling(up=1.25, max_temperature=2.0), ["a", "b"])
    restored.load_state_dict(json.loads(json.dumps(controller.state_dict())))
    assert restored.temperatures == {"a": 1.25, "b": 1.0}
    for c in (controller, restored):  # and continues identically
        c.observe("a", {"agent": [0.0, 0.0]})
    assert restored.temperatures == controller.temperatures
    # Bounds narrowed between runs: the saved 1.5625 is clamped to the new max.
    narrowed = TemperatureController(scaling(max_temperature=1.5), ["a", "b"])
    narrowed.load_state_dict(controller.state_dict())
    assert narrowed.temperatures == {"a": 1.5, "b": 1.0}
    with pytest.raises(ValueError, match=r"has environments \['a', 'b'\], this run has \['a'\]"):
        TemperatureController(scaling(), ["a"]).load_state_dict(controller.state_dict())


def test_config_defaults_and_bounds():
    config = OrchestratorConfig()
    assert config.sampling.temperature_scaling is None  # off by default
    on = scaling(temperature=0.8)
    assert on.min_temperature == 0.8  # min defaults to sampling.temperature
    s = on.temperature_scaling
    assert (s.max_temperature, s.std_threshold, s.up, s.down) == (1.5, 0.0, 1.1, 0.95)
    assert scaling(min_temperature=0.5).min_temperature == 0.5
    with pytest.raises(
        ValidationError, match=r"min_temperature \(2.0\) <= sampling.temperature \(2.0\) <= max_temperature \(1.5\)"
    ):
        scaling(temperature=2.0)  # above the default max 1.5
    with pytest.raises(ValidationError, match=r"min_temperature \(1.2\) <= sampling.temperature \(1.0\)"):
        scaling(min_temperature=1.2)
    with pytest.raises(ValidationError, match="up"):
        scaling(up=1.0)  # would never raise the temperature
    with pytest.raises(ValidationError, match="down"):
        scaling(down=1.5)


def test_bare_flag_enables_the_section_with_defaults():
    from prime_rl.config.loader import load_config

    config, _ = load_config(OrchestratorConfig, "orchestrator", ["--sampling.temperature-scaling"])
    assert config.sampling.temperature_scaling is not None and config.sampling.temperature_scaling.up == 1.1
    config, _ = load_config(
        OrchestratorConfig, "orchestrator", ["--sampling.temperature-scaling.max-temperature", "1.2"]
    )
    assert config.sampling.temperature_scaling.max_temperature == 1.2


def rollout(reward: float) -> RolloutResult:
    return RolloutResult(reward=reward, samples=[SampleTokens([1, 2], [False, True], [0.0, -1.0], [0, 0])])


def test_scheduler_sends_each_group_at_its_environments_temperature_and_observes_every_scored_group():
    """Groups of one env: the first goes out at the base 1.0; it finishes all-failed (and is dropped by
    filter_zero_advantage, yet still raises the temperature to 1.25); the next group goes out at 1.25; a varied
    group relaxes it to 1.0 (1.25 * 0.8)."""
    from prime_rl.orchestrator.buffer import Buffer, BufferConfig
    from prime_rl.orchestrator.messages import GroupDone
    from prime_rl.orchestrator.scheduler import Group, Scheduler

    config = OrchestratorConfig(sampling={"temperature_scaling": {"up": 1.25, "down": 0.8}}, filter_zero_advantage=True)
    controller = TemperatureController(config.sampling, ["e"])
    workers = RecordingWorkers()
    buffer = Buffer(BufferConfig(), {"e": 4})
    scheduler = Scheduler(config, buffer, {}, StandInServers(), workers, controller)

    def run(group_id: int, rewards: list[float]) -> None:
        group = Group(group_id, "e", group_id, {}, 0, "u")
        asyncio.run(scheduler._submit(group))
        scheduler.on_done(GroupDone(id=group_id, rollouts=[rollout(r) for r in rewards]))

    run(0, [0.0, 0.0])
    assert scheduler.finished == [] and scheduler.stats.filtered == 1
    run(1, [1.0, 0.0])
    run(2, [1.0, 1.0])
    assert [r.temperature for r in workers.requests] == [1.0, 1.25, 1.0]
    assert [g.temperature for g in scheduler.finished] == [1.25]  # the accepted group records its temperature
    assert controller.temperature("e") == 1.25
