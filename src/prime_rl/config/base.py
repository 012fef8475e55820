"""Base classes for every config in prime-rl.

Sub-configs are plain pydantic models (``BaseConfig``); each entry point has one top-level
``EntrypointConfig`` (pydantic-settings) that also reads ``PRIME_*`` environment variables.
Field docstrings are the documentation: ``--help`` prints them.
"""

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict


class BaseConfig(BaseModel):
    """A config section: unknown keys are errors, field docstrings are the docs."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)


class LogConfig(BaseConfig):
    level: Literal["debug", "info", "warning", "error"] = "info"
    """Log level of the console and of the log file under `{output_dir}/logs/`."""

    file: str | None = Field(None, pattern=r"^[\w.-]+\.log$")
    """Name of the log file under `{output_dir}/logs/` (default `<process>.log`): `rl` names one per host when
    several hosts share the output dir."""


class EntrypointConfig(BaseSettings):
    """Top-level config of one entry point.

    Sources, highest first: CLI flags > `@ file.toml` > `PRIME_*` environment variables > defaults.
    The CLI (parsed by pydantic-settings' `CliSettingsSource`) and TOML layers are merged by
    `prime_rl.config.loader` and handed over as init values; this class only adds the environment layer below them.
    """

    model_config = SettingsConfigDict(
        env_prefix="PRIME_",
        env_nested_delimiter="__",
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
    )

    output_dir: Path = Path("outputs")
    """Root of everything a run writes: logs, resolved configs, rollouts, weights, checkpoints."""

    log: LogConfig = LogConfig()
    """Logging settings."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # init values (CLI merged over TOML) win over the environment; no dotenv or secret files.
        return (init_settings, env_settings)
