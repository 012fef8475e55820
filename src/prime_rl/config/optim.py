"""Optimizer and learning-rate schedule sections: the trainer's and `sft`'s `optim`/`scheduler`, and a LoRA run's own
in its orchestrator config (`[adapter]`), which the trainer reads."""

from typing import Annotated, Literal

from pydantic import Field, model_validator

from prime_rl.config.base import BaseConfig


class OptimizerBase(BaseConfig):
    """What every optimizer section shares; each kind adds its own fields and its `type`."""

    lr: float = Field(1e-6, gt=0)
    """Peak learning rate, reached at the end of warmup."""

    max_norm: float = Field(1.0, ge=0)
    """Clip gradients to this global L2 norm before each step; 0 disables clipping."""

    cpu_offload: bool = False
    """Keep the optimizer's state (AdamW moments, momentum) in host memory between steps, on the GPU only during
    `step()` (CUDA only; `model.cpu_offload` already keeps it on the host)."""


class AdamWConfig(OptimizerBase):
    type: Literal["adamw"] = "adamw"
    """Optimizer kind (selects this section)."""

    weight_decay: float = Field(0.01, ge=0)
    """Decoupled weight decay (AdamW style), applied to every parameter."""

    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.999)
    """Decay rates of the first and second moment estimates."""


class SGDConfig(OptimizerBase):
    type: Literal["sgd"] = "sgd"
    """Optimizer kind (selects this section)."""

    weight_decay: float = Field(0.0, ge=0)
    """L2 penalty added to the gradient (coupled, as in torch SGD)."""

    momentum: float = Field(0.9, ge=0, lt=1)
    """Momentum factor; 0 is plain SGD."""

    nesterov: bool = True
    """Use Nesterov momentum (needs `momentum > 0`)."""

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> "SGDConfig":
        # torch raises only when the optimizer is built; fail at config load instead.
        if self.nesterov and self.momentum == 0:
            raise ValueError("nesterov=true needs momentum > 0 (set nesterov=false for plain SGD)")
        return self


OptimizerConfig = Annotated[AdamWConfig | SGDConfig, Field(discriminator="type")]


class SchedulerBase(BaseConfig):
    """What every schedule shares: the warmup, one definition with one default for all kinds."""

    warmup_steps: int = Field(0, ge=0)
    """Steps of linear warmup at the start (step s < warmup_steps uses lr * (s + 1) / warmup_steps); 0 starts at
    full lr. No schedule warms up unless asked to."""


class ConstantSchedulerConfig(SchedulerBase):
    type: Literal["constant"] = "constant"
    """Schedule kind (selects this section)."""


class LinearSchedulerConfig(SchedulerBase):
    type: Literal["linear"] = "linear"
    """Schedule kind (selects this section)."""

    decay_steps: int = Field(10, ge=0)
    """Last steps of the run over which the lr falls linearly to `min_lr` (reached on the final step)."""

    min_lr: float = Field(0.0, ge=0)
    """Learning rate of the final step; must not exceed the optimizer's `lr`."""


class CosineSchedulerConfig(SchedulerBase):
    type: Literal["cosine"] = "cosine"
    """Schedule kind (selects this section)."""

    min_lr: float = Field(0.0, ge=0)
    """Learning rate of the final step, where the cosine ends; must not exceed the optimizer's `lr`."""


SchedulerConfig = Annotated[
    ConstantSchedulerConfig | LinearSchedulerConfig | CosineSchedulerConfig, Field(discriminator="type")
]
