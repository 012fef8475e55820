"""Config sections several entry points share: one definition per concept.

Each process extends `ModelConfig` with what only it needs (the trainer its FSDP options, the inference server
its vLLM options, the orchestrator its renderer); `rl` and the processes share one `CheckpointConfig`, and one
`BenchConfig` that the trainer extends with its fake data.
"""

from typing import Literal

from pydantic import Field

from prime_rl.config.base import BaseConfig


class ModelConfig(BaseConfig):
    name: str = "Qwen/Qwen3-0.6B"
    """Hugging Face model id or local model directory (weights, config and tokenizer, via `from_pretrained`)."""

    trust_remote_code: bool = False
    """Allow custom model or tokenizer code from the model directory or hub."""


class ServedModelConfig(ModelConfig):
    served_name: str | None = None
    """The model's name in API requests (vLLM's `--served-model-name`); default: `name`."""

    @property
    def api_name(self) -> str:
        return self.served_name or self.name


class CheckpointConfig(BaseConfig):
    interval: int = Field(50, ge=0)
    """Save a checkpoint every this many steps and after the last one (trainer and orchestrator alike, so every
    step that is kept can be resumed from); 0: only after the last one."""

    keep_last: int | None = Field(None, ge=1)
    """Keep only this many most recent checkpoints (None: keep all)."""

    keep_interval: int | None = Field(None, ge=1)
    """Also keep every checkpoint whose step is a multiple of this, whatever `keep_last` says."""

    resume_step: int | None = Field(None, ge=-1)
    """Resume from this step's checkpoint; -1 = the latest complete one; None = start fresh."""

    save_async: bool = False
    """Trainer and sft: write checkpoint files in a background thread; training continues once the state is staged."""

    @property
    def resuming(self) -> bool:
        return self.resume_step is not None

    def due(self, step: int, max_steps: int | None) -> bool:
        """Whether `step` is saved: one rule for trainer and orchestrator, so every kept step has both halves."""
        return (self.interval > 0 and step % self.interval == 0) or step == max_steps

    def kept(self, steps: list[int]) -> set[int]:
        """Of the saved checkpoint steps (ascending), those `keep_last` and `keep_interval` keep."""
        if self.keep_last is None:
            return set(steps)
        keep = set(steps[-self.keep_last :])
        if self.keep_interval:
            keep |= {s for s in steps if s % self.keep_interval == 0}
        return keep


class WeightBroadcastConfig(BaseConfig):
    """How each new policy reaches the inference servers. Trainer and orchestrator must agree (`rl` shares one)."""

    type: Literal["filesystem", "nccl", "gloo"] = "filesystem"
    """`filesystem`: the trainer writes `broadcasts/step_n/` and every server reads it. `nccl` / `gloo`: trainer rank 0
    broadcasts the weights layer by layer to every inference worker over a torch.distributed group (NCCL between
    GPUs; gloo over TCP from host memory, any device); only checkpoint steps and the last step are still written."""

    host: str = "127.0.0.1"
    """Address of trainer rank 0 as the servers and the orchestrator reach it; its store listens on this address only
    (authenticated by the run secret, `PRIME_RL_SECRET`)."""

    port: int | None = Field(None, ge=1, le=65535)
    """Port of that store. None: `rl` picks a free one on one host, `deployment.master_port + 1` on several; set it
    when trainer and orchestrator start without `rl`."""

    timeout: float = Field(120.0, gt=0, le=300)
    """Seconds starting a transfer (members joining, the header) and each layer's broadcast may take before the
    transfer fails. At most 300: the other trainer ranks wait for rank 0 in a collective meanwhile, and NCCL's own
    collective timeout is 600 s."""

    @property
    def in_memory(self) -> bool:
        return self.type != "filesystem"

    def require_port(self) -> int:
        """The store's port; a clear error when an in-memory broadcast was configured without one."""
        if self.port is None:
            raise ValueError(
                "weight_broadcast.port is not set: the trainer and the orchestrator must be given the same one "
                "(`rl` picks a free one when it starts both on one host)"
            )
        return self.port


class BenchConfig(BaseConfig):
    steps: int = Field(5, ge=2)
    """Steps to run (the first is shown in the table but left out of the summary: it includes warm-up)."""
