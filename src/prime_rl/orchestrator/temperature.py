"""Sampling temperature per environment, raised while its groups' rewards stop varying (MinRL's temperature
scaling by reward spread).

A group whose rollouts all score the same (all solved, all failed) gives a group baseline nothing to compare: its
advantages are 0. Sampling that environment hotter spreads the rollouts out again. After each finished group the
environment's temperature is multiplied by `up` if the group's reward std is at most `std_threshold`, else by
`down`, and kept within [min, max]; groups started later sample at the new value, and each of their samples
records it (`TrainingSample.temperature`), so the trainer scores them at the temperature they were drawn with.

The update is per finished group, in the order groups finish, and the groups in flight were started at earlier
values: with many groups in flight the temperature reacts a few groups late, which the bounds keep harmless.
"""

import statistics

from prime_rl.orchestrator.config import TrainSamplingConfig


def reward_spread(rewards_by_seat: dict[str, list[float]]) -> float:
    """A group's reward spread: the population std of its rewards, per seat (seats do not share a baseline), the
    largest over seats."""
    return max(statistics.pstdev(rewards) for rewards in rewards_by_seat.values())


def next_temperature(
    temperature: float, spread: float, threshold: float, up: float, down: float, low: float, high: float
) -> float:
    """The temperature after a group with reward std `spread`: times `up` up to `high` when it is at most
    `threshold` (the rewards did not vary), else times `down` down to `low`."""
    if spread <= threshold:
        return min(temperature * up, high)
    return max(temperature * down, low)


class TemperatureController:
    """One temperature per environment (environments differ in how often their rewards stop varying)."""

    def __init__(self, sampling: TrainSamplingConfig, envs: list[str]):
        if sampling.temperature_scaling is None:
            raise ValueError("TemperatureController needs sampling.temperature_scaling")
        self.config = sampling.temperature_scaling
        self.low, self.high = sampling.min_temperature, self.config.max_temperature
        self.temperatures = {env: sampling.temperature for env in envs}

    def temperature(self, env: str) -> float:
        """The temperature a group of `env` started now samples at."""
        return self.temperatures[env]

    def observe(self, env: str, rewards_by_seat: dict[str, list[float]]) -> None:
        """A group of `env` finished with these rewards (per seat)."""
        c = self.config
        spread = reward_spread(rewards_by_seat)
        self.temperatures[env] = next_temperature(
            self.temperatures[env], spread, c.std_threshold, c.up, c.down, self.low, self.high
        )

    def metrics(self) -> dict[str, float]:
        return {f"sampling/temperature/{env}": t for env, t in self.temperatures.items()}

    def state_dict(self) -> dict:
        return {"temperatures": dict(self.temperatures)}

    def load_state_dict(self, state: dict) -> None:
        """Restore a `state_dict` of the same environments; a temperature outside this config's bounds is clamped
        into them (the bounds may have changed between runs)."""
        saved = state["temperatures"]
        if set(saved) != set(self.temperatures):
            raise ValueError(
                f"the checkpoint's temperature scaling has environments {sorted(saved)}, this run has "
                f"{sorted(self.temperatures)}"
            )
        self.temperatures = {env: min(max(float(t), self.low), self.high) for env, t in saved.items()}
