"""The orchestrator's config: defined in `prime_rl.config.orchestrator`, where the LoRA trainer reads a run's config
without importing the orchestrator; re-exported here, its home for the orchestrator, `rl` and `eval`."""

from prime_rl.config.orchestrator import (
    EVAL_ENV_PREFIX,
    AdapterConfig,
    AdvantageConfig,
    BufferConfig,
    ClientConfig,
    ClientModelConfig,
    EnvConfig,
    EnvSpec,
    EvalEnvConfig,
    LogExtrasConfig,
    OnlineEvalConfig,
    OnlineEvalEnvConfig,
    OrchestratorConfig,
    RolloutEnv,
    SamplingConfig,
    TemperatureScalingConfig,
    TrainSamplingConfig,
)

__all__ = [
    "EVAL_ENV_PREFIX",
    "AdapterConfig",
    "AdvantageConfig",
    "BufferConfig",
    "ClientConfig",
    "ClientModelConfig",
    "EnvConfig",
    "EnvSpec",
    "EvalEnvConfig",
    "LogExtrasConfig",
    "OnlineEvalConfig",
    "OnlineEvalEnvConfig",
    "OrchestratorConfig",
    "RolloutEnv",
    "SamplingConfig",
    "TemperatureScalingConfig",
    "TrainSamplingConfig",
]
