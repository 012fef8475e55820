"""Config of the `trainer` entry point."""

from typing import Literal

from pydantic import Field, model_validator

from prime_rl.config import BaseConfig, EntrypointConfig
from prime_rl.trainer.loss import LossConfig
from prime_rl.trainer.optim import AdamWConfig, ConstantSchedulerConfig, OptimizerConfig, SchedulerConfig


class ModelConfig(BaseConfig):
    name: str = "Qwen/Qwen3-0.6B"
    """Hugging Face model id or local directory (loaded with `from_pretrained`)."""

    random_init: bool = False
    """Use only the architecture and tokenizer of `name` and start from random weights (seeded by `seed`)."""

    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Compute dtype of the sharded parameters; master weights, gradients and their reduction stay float32."""

    attn: Literal["sdpa", "flash_attention_2", "eager"] = "sdpa"
    """Attention kernel. Packed samples never attend to each other: position ids restart per sample, which
    `sdpa`/`eager` turn into a block-diagonal mask and `flash_attention_2` into varlen attention."""

    ac: bool = False
    """Activation checkpointing of every decoder layer (recompute activations in backward: less memory)."""

    compile: bool = False
    """`torch.compile` each decoder layer."""

    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory (FSDP2 CPUOffloadPolicy)."""

    trust_remote_code: bool = False
    """Allow custom model code from the model directory or hub."""


class CheckpointConfig(BaseConfig):
    interval: int = Field(50, ge=1)
    """Save a full checkpoint every this many steps (and after the last step)."""

    keep_last: int | None = Field(None, ge=1)
    """Keep only this many most recent checkpoints (None: keep all)."""

    keep_interval: int | None = Field(None, ge=1)
    """Also keep every checkpoint whose step is a multiple of this, whatever `keep_last` says."""

    resume_step: int | None = Field(None, ge=-1)
    """Resume from this step's checkpoint; -1 = the latest complete one; None = start fresh."""

    save_async: bool = False
    """Write checkpoint files in a background thread; training continues once the state is staged."""


class BenchConfig(BaseConfig):
    steps: int = Field(5, ge=2)
    """Steps to run on fake data (the first is reported but excluded from the averages)."""

    samples: int = Field(8, ge=1)
    """Samples per step."""

    variable_length: bool = False
    """Draw sample lengths uniformly from [seq_len/8, seq_len] instead of using exactly seq_len."""


class TrainerConfig(EntrypointConfig):
    model: ModelConfig = ModelConfig()
    """The model to train."""

    loss: LossConfig = LossConfig()
    """Objective, importance-ratio masking and KL shaping."""

    optim: OptimizerConfig = AdamWConfig()
    """Optimizer (`type = "adamw"` or `"sgd"`)."""

    scheduler: SchedulerConfig = ConstantSchedulerConfig()
    """Learning-rate schedule (`type = "constant"`, `"linear"` or `"cosine"`)."""

    ckpt: CheckpointConfig | None = None
    """Resumable checkpoints (`--ckpt` enables with defaults)."""

    bench: BenchConfig | None = None
    """Benchmark on fake data instead of training on rollouts (`--bench` enables); prints a summary table."""

    seq_len: int = Field(2048, ge=1)
    """Maximum tokens per packed row; a sample longer than this is an error."""

    max_steps: int | None = Field(None, ge=1)
    """Stop after this step (None: run until stopped)."""

    max_async_level: int = Field(2, ge=0)
    """How many steps inference may lag behind; decides which published weights must be kept."""

    batch_timeout: float | None = Field(None, gt=0)
    """Seconds to wait for a step's batch before failing (None: wait forever)."""

    seed: int = 0
    """Seed for random initialisation and fake data."""

    @model_validator(mode="after")
    def _check(self) -> "TrainerConfig":
        if self.ckpt is not None and self.ckpt.resume_step is not None and self.bench is not None:
            raise ValueError("--bench runs on fake data and cannot resume from a checkpoint")
        return self
