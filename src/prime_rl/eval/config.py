"""Configs of the `eval` and `synthesize` entry points (torch-free, like every config module)."""

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from prime_rl.config import EntrypointConfig
from prime_rl.inference.config import InferenceConfig
from prime_rl.orchestrator.config import ClientConfig, ClientModelConfig, EvalEnvConfig, RolloutEnv, SamplingConfig


class RolloutsConfig(EntrypointConfig):
    """What `eval` and `synthesize` share: a model behind one or more endpoints, environments, sampling."""

    model: ClientModelConfig = ClientModelConfig()
    """The model as the endpoint serves it (name, client-side tokenizer and renderer)."""

    client: ClientConfig = ClientConfig()
    """OpenAI-compatible endpoint(s) (`--client.base-url`, API key from `api_key_var`); ignored with `[inference]`."""

    api: Literal["tokens", "chat"] = "tokens"
    """`tokens`: vLLM's token route (our server; chat template applied client-side, exact token counts);
    `chat`: `/v1/chat/completions` of any OpenAI-compatible endpoint (token counts from its usage report)."""

    inference: InferenceConfig | None = None
    """Serve `model.name` with our inference server for the duration of the run (`--inference`)."""

    attach: bool = False
    """Use the attachable server already on `inference.server.port` (`inference --server.attachable`) instead of
    starting one: checked to serve `model.name`, reset to its base weights, left running at the end."""

    env: list[EvalEnvConfig] = [EvalEnvConfig()]
    """Environments (`[[env]]` tables)."""

    sampling: SamplingConfig = SamplingConfig()
    """Sampling settings of every request."""

    seq_len: int = Field(4096, ge=1)
    """Most tokens a rollout may use in total (prompt and completions)."""

    max_concurrent: int = Field(64, ge=1)
    """Rollout groups in flight at once."""

    max_retries: int = Field(3, ge=0)
    """Times a rollout that failed on the server (connection, 5xx) is retried, with exponential backoff."""

    retry_backoff: float = Field(2.0, ge=0)
    """Seconds before the first retry; doubled for each further one."""

    inference_timeout: float = Field(900.0, gt=0)
    """Seconds to wait for a served model (`[inference]`) to become healthy."""

    def rollout_envs(self) -> dict[str, RolloutEnv]:
        """The environments the in-process worker serves, by name, all with `sampling` (nothing here is trained)."""
        return {e.display_name: RolloutEnv(e, self.sampling, False) for e in self.env}

    @model_validator(mode="after")
    def _check_envs(self):
        names = [e.display_name for e in self.env]
        if not names:
            raise ValueError("env: configure at least one environment")
        if len(set(names)) != len(names):
            raise ValueError(f"env names must be unique, got {names}; set `name` to tell them apart")
        if self.attach and self.inference is None:
            raise ValueError("attach: needs the `[inference]` section (the port of the server and what it serves)")
        if self.inference is not None:
            self.inference.model.name = self.model.name
            self.inference.model.served_name = self.model.served_name
            self.inference.model.trust_remote_code = self.model.trust_remote_code
            self.client.base_url = [f"http://127.0.0.1:{self.inference.server.port}/v1"]
        return self


class EvalConfig(RolloutsConfig):
    weights: dict[str, Path] = {}
    """Further policies to evaluate after the served (base) model, `{label = "dir"}`, in order: a Hugging Face
    directory, or a directory of `step_*` subdirectories (its latest step). Loaded with `/update_weights`."""

    weights_dir: Path | None = None
    """Also evaluate every `step_*` subdirectory of this directory (`outputs/weights`, `outputs/broadcasts`)."""

    follow_until: int | None = Field(None, ge=1)
    """With `weights_dir`: wait for each `step_*` up to this step to appear there and evaluate it, then exit."""

    pass_threshold: float = 1.0
    """A rollout counts as solved for pass@k when its reward is at least this."""

    @model_validator(mode="after")
    def _check_follow(self):
        if self.follow_until is not None and self.weights_dir is None:
            raise ValueError("follow_until needs weights_dir: the directory whose step_* exports to follow")
        return self


class SynthesizeConfig(RolloutsConfig):
    min_reward: float | None = None
    """Keep only rollouts whose reward is at least this (None: keep every rollout without an error)."""
