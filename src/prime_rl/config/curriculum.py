"""Curricula: which task of an environment is rolled out next (`sampler`) and which finished groups are trained on
(`gate`), set for every environment in `[orchestrator.buffer]` and per environment in `[[orchestrator.env]]`.

One typed config per sampler and per gate, told apart by `type` (upstream prime-rl's spelling). Rules and a worked
example: docs/algorithms.md, "Curricula"; the code: orchestrator/curriculum.py and orchestrator/gate.py.
"""

from typing import Annotated, Literal

from pydantic import Field, model_validator

from prime_rl.config import BaseConfig

UNSEEN = "unseen"
"""The pool of tasks without a finished group yet (a reserved pool name)."""


class StandardSampler(BaseConfig):
    """Every active task of the environment equally likely."""

    type: Literal["standard"] = "standard"
    """`standard`: a uniformly random active task."""


class DifficultyPool(BaseConfig):
    """A band of latest group mean rewards and the sampling weight of each task in it."""

    threshold: float
    """Largest latest group mean reward in this pool (inclusive); the pool with the highest threshold also takes
    every reward above it."""

    weight: float = Field(ge=0)
    """Relative sampling weight of each task in the pool (0: its tasks are not drawn while they are in it)."""


def default_pools() -> dict[str, DifficultyPool]:
    return {
        "hard": DifficultyPool(threshold=0.25, weight=0.2),
        "normal": DifficultyPool(threshold=0.75, weight=1.0),
        "easy": DifficultyPool(threshold=1.0, weight=0.2),
    }


class DifficultyPoolSampler(BaseConfig):
    """Tasks weighted by the pool their latest group mean reward falls in: a task is drawn with probability
    proportional to its pool's weight (`unseen_weight` before its first group)."""

    type: Literal["difficulty_pool"] = "difficulty_pool"
    """`difficulty_pool`: tasks weighted by the pool of their latest group mean reward."""

    pools: dict[str, DifficultyPool] = Field(default_factory=default_pools)
    """Pools by name (default hard <= 0.25 weight 0.2, normal <= 0.75 weight 1, easy <= 1 weight 0.2)."""

    unseen_weight: float = Field(1.0, ge=0)
    """Sampling weight of a task that has no finished group yet (pool `unseen`)."""

    @model_validator(mode="after")
    def _check(self) -> "DifficultyPoolSampler":
        if not self.pools:
            raise ValueError("difficulty_pool sampler: configure at least one pool")
        if UNSEEN in self.pools:
            raise ValueError(f"difficulty_pool sampler: pool name {UNSEEN!r} is reserved for tasks not yet seen")
        thresholds = [p.threshold for p in self.pools.values()]
        if len(set(thresholds)) != len(thresholds):
            raise ValueError(f"difficulty_pool sampler: pool thresholds must differ, got {thresholds}")
        if not any(p.weight > 0 for p in self.pools.values()):
            raise ValueError("difficulty_pool sampler: at least one pool needs a positive weight")
        return self

    def ordered(self) -> list[tuple[str, float]]:
        """(name, threshold) by ascending threshold: the order a reward is matched against."""
        return sorted(((name, p.threshold) for name, p in self.pools.items()), key=lambda item: item[1])


SamplerConfig = Annotated[StandardSampler | DifficultyPoolSampler, Field(discriminator="type")]
"""One of the task samplers, by `type`."""


class AdvantageRangeGate(BaseConfig):
    """Reject a finished group whose trained advantages all lie in [low, high]: it teaches (almost) nothing, and a
    replacement group is started in its place."""

    type: Literal["advantage_range"] = "advantage_range"
    """`advantage_range`: reject a group whose advantages all lie within the band."""

    low: float = 0.0
    """Lower end of the rejected band (inclusive)."""

    high: float = 0.0
    """Upper end of the rejected band (inclusive); the default [0, 0] rejects groups whose advantages are all 0."""

    @model_validator(mode="after")
    def _check(self) -> "AdvantageRangeGate":
        if self.low > self.high:
            raise ValueError(f"advantage_range gate: low ({self.low}) must be <= high ({self.high})")
        return self


GateConfig = Annotated[AdvantageRangeGate, Field(discriminator="type")]
"""One of the admission gates, by `type`."""
