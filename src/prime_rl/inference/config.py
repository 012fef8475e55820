"""Config of the `inference` entry point: the fields users set most, mapped onto vLLM's arguments.

Anything vLLM accepts that is not here can be passed on the command line as is (`--max-num-batched-tokens 4096`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from prime_rl.config import BaseConfig, EntrypointConfig, ServedModelConfig, WeightBroadcastConfig


class InferenceModelConfig(ServedModelConfig):
    """`name` is also the base weights `/reload_weights` restores."""

    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Weight and activation dtype (vLLM `--dtype`)."""

    max_model_len: int | None = None
    """Context length (prompt + completion); default: the model's own."""

    enforce_eager: bool = False
    """Skip torch.compile / CUDA graphs: faster start, slower generation."""


class ServerConfig(BaseConfig):
    host: str = "127.0.0.1"
    """Address to bind; use 0.0.0.0 to serve other machines."""

    port: int = Field(8000, ge=1, le=65535)
    """TCP port."""

    api_key: SecretStr | None = None
    """If set, every route but /health, /ping and /version needs `Authorization: Bearer <key>`; unset, the run
    secret (`PRIME_RL_SECRET`) is the token when there is one."""

    allow_unauthenticated: bool = False
    """Serve on a non-loopback `host` with no API key and no run secret (anyone reaching the port may swap the
    weights); without it such a server refuses to start."""

    attachable: bool = False
    """Outlive runs: `rl --attach` and `eval --attach` use this server instead of starting one (a card with its keys
    under ~/.cache/prime-rl/servers; a fresh secret of its own unless one is given). docs/inference.md"""


class ParallelConfig(BaseConfig):
    tp: int = Field(1, ge=1)
    """Tensor-parallel size (GPUs per model replica)."""

    dp: int = Field(1, ge=1)
    """Data-parallel size (model replicas behind this server)."""


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32 accepts for `--max-lora-rank`."""


class LoRAConfig(BaseConfig):
    max_loras: int = Field(8, ge=1)
    """Adapters in one batch, and (unless `--max-cpu-loras` says more) adapters the server holds at once."""

    max_lora_rank: int = Field(16, ge=1)
    """Largest adapter rank that can be loaded: one of 1, 8, 16, 32, 64, 128, 256, 320, 512."""

    @field_validator("max_lora_rank")
    @classmethod
    def _vllm_rank(cls, rank: int) -> int:
        if rank not in VLLM_LORA_RANKS:
            raise ValueError(f"vLLM accepts only {', '.join(map(str, VLLM_LORA_RANKS))}")
        return rank


class InferenceConfig(EntrypointConfig):
    model: InferenceModelConfig = InferenceModelConfig()
    """The model to serve."""

    server: ServerConfig = ServerConfig()
    """HTTP server settings."""

    parallel: ParallelConfig = ParallelConfig()
    """Parallelism across GPUs."""

    lora: LoRAConfig | None = None
    """Runtime LoRA adapters (`--lora` enables with defaults)."""

    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """Fraction of GPU memory vLLM may take (lower it when the trainer shares the GPU)."""

    max_num_seqs: int | None = Field(None, ge=1)
    """Sequences the engine runs at once (vLLM `--max-num-seqs`); default: vLLM's (128 on CPU). `rl` sets it to the
    rollouts its orchestrators keep in flight, which on CPU also sizes the KV cache (`kv_cache_gib`)."""

    kv_cache_gib: int | None = Field(None, ge=1)
    """CPU only: KV cache size in GiB (`VLLM_CPU_KVCACHE_SPACE`); default: room for `--max-num-seqs` sequences of
    `max_model_len` tokens (docs/inference.md)."""

    seed: int = 0
    """Sampling seed of the engine."""

    allowed_weight_roots: list[Path] | None = None
    """Directories `/update_weights` may load from; default: `output_dir`."""

    weight_broadcast: WeightBroadcastConfig = WeightBroadcastConfig()
    """Where the trainer's weight-broadcast store is (`type` gloo/nccl, `host`, `port`; `rl` shares its own): a
    `/update_weights` broadcast request names only the transfer, never an address."""

    @model_validator(mode="after")
    def _broadcast_port(self) -> InferenceConfig:
        if self.weight_broadcast.in_memory:
            self.weight_broadcast.require_port()
        return self

    @property
    def weight_roots(self) -> list[Path]:
        """Where weights may be loaded from: the configured roots, else `output_dir` (read late, so a launcher that
        moves `output_dir` moves the default with it)."""
        return self.allowed_weight_roots or [self.output_dir]

    def vllm_args(self) -> list[str]:
        """Our fields as vLLM CLI arguments (extra user flags are appended after these and win)."""
        m = self.model
        args = [
            "--model", m.name,
            "--served-model-name", m.api_name,
            "--dtype", m.dtype,
            "--host", self.server.host,
            "--port", str(self.server.port),
            "--tensor-parallel-size", str(self.parallel.tp),
            "--data-parallel-size", str(self.parallel.dp),
            "--gpu-memory-utilization", str(self.gpu_memory_utilization),
            "--seed", str(self.seed),
            # The trainer's importance ratio needs the logprobs of the distribution actually sampled
            # from (after temperature), not of the raw logits.
            "--logprobs-mode", "processed_logprobs",
            # Token-in/token-out generation (`/inference/v1/generate`), used by the verifiers train client.
            "--enable-scale-out",
            # Our weight-swap methods, mixed into every worker.
            "--worker-extension-cls", "prime_rl.inference.worker.WeightSwapExtension",
        ]  # fmt: skip
        if m.max_model_len is not None:
            args += ["--max-model-len", str(m.max_model_len)]
        if self.max_num_seqs is not None:
            args += ["--max-num-seqs", str(self.max_num_seqs)]
        if m.enforce_eager:
            args.append("--enforce-eager")
        if m.trust_remote_code:
            args.append("--trust-remote-code")
        if self.server.api_key is not None:
            args += ["--api-key", self.server.api_key.get_secret_value()]
        if self.lora is not None:
            args += ["--enable-lora", "--max-loras", str(self.lora.max_loras)]
            args += ["--max-lora-rank", str(self.lora.max_lora_rank)]
            # The names of loaded adapters live in the API server process: with several (vLLM's default under data
            # parallelism) a load would reach one of them only.
            args += ["--api-server-count", "1"]
        return args
