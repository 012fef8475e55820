from prime_rl.config.base import BaseConfig, EntrypointConfig, LogConfig
from prime_rl.config.sections import CheckpointConfig, ModelConfig, ServedModelConfig, WeightBroadcastConfig

__all__ = [
    "BaseConfig",
    "CheckpointConfig",
    "EntrypointConfig",
    "LogConfig",
    "ModelConfig",
    "ServedModelConfig",
    "WeightBroadcastConfig",
]
