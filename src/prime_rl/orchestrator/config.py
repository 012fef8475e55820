"""The orchestrator's config: defined in `prime_rl.config.orchestrator`, where the LoRA trainer reads a run's config
without importing the orchestrator; re-exported here, its home for the orchestrator, `rl` and `eval`."""

from prime_rl.config.orchestrator import (
    AdapterConfig,
    AdvantageConfig,
    BufferConfig,
    ClientConfig,
    ClientModelConfig,
    EnvConfig,
    EnvSpec,
    LogExtrasConfig,
    OrchestratorConfig,
    SamplingConfig,
    TemperatureScalingConfig,
    TrainSamplingConfig,
)

__all__ = [
    "AdapterConfig",
    "AdvantageConfig",
    "BufferConfig",
    "ClientConfig",
    "ClientModelConfig",
    "EnvConfig",
    "EnvSpec",
    "LogExtrasConfig",
    "OrchestratorConfig",
    "SamplingConfig",
    "TemperatureScalingConfig",
    "TrainSamplingConfig",
]
