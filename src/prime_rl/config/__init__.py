from prime_rl.config.base import BaseConfig, EntrypointConfig, LogConfig

__all__ = ["BaseConfig", "EntrypointConfig", "LogConfig"]
