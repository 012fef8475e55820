from prime_rl.config.base import BaseConfig, EntrypointConfig, LogConfig
from prime_rl.config.sections import (
    BenchConfig,
    CheckpointConfig,
    ModelConfig,
    ServedModelConfig,
    WeightBroadcastConfig,
)

__all__ = [
    "BaseConfig",
    "BenchConfig",
    "CheckpointConfig",
    "EntrypointConfig",
    "LogConfig",
    "ModelConfig",
    "ServedModelConfig",
    "WeightBroadcastConfig",
]
