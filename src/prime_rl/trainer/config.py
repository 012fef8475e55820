"""Config of the `trainer` entry point."""

from typing import Literal

from pydantic import Field, model_validator

from prime_rl.config import (
    BaseConfig,
    BenchConfig,
    CheckpointConfig,
    EntrypointConfig,
    ModelConfig,
    WeightBroadcastConfig,
)
from prime_rl.config.optim import AdamWConfig, ConstantSchedulerConfig, OptimizerConfig, SchedulerConfig
from prime_rl.utils.monitor_config import WandbConfig


class LossConfig(BaseConfig):
    objective: Literal["aipo", "grpo", "gspo", "cispo"] = "aipo"
    """Policy objective: truncated IS REINFORCE, token PPO clip, sequence PPO clip, or clipped-weight REINFORCE."""

    delta: float = Field(2.0, gt=0)
    """aipo: truncation of the importance weight, min(r, delta)."""

    eps_low: float = Field(0.2, ge=0)
    """grpo/cispo: lower clip of the ratio at 1 - eps_low."""

    eps_high: float = Field(0.28, ge=0)
    """grpo/cispo: upper clip of the ratio at 1 + eps_high (DAPO clip-higher)."""

    gspo_eps_low: float = Field(3e-4, ge=0)
    """gspo: lower clip of the sequence ratio at 1 - gspo_eps_low (GSPO paper value)."""

    gspo_eps_high: float = Field(4e-4, ge=0)
    """gspo: upper clip of the sequence ratio at 1 + gspo_eps_high (GSPO paper value)."""

    token_mask_low: float = 0.125
    """Drop a loss token whose ratio r is below this."""

    token_mask_high: float = 8.0
    """Drop a loss token whose ratio r is above this."""

    geo_mask_low: float = 0.1
    """Drop a whole sample whose geometric-mean ratio over its loss tokens is below this."""

    geo_mask_high: float = 10.0
    """Drop a whole sample whose geometric-mean ratio over its loss tokens is above this."""

    sequence_mask_low: float = 0.0
    """Drop a whole sample if the smallest ratio among its loss tokens is below this (0 disables)."""

    sequence_mask_high: float = 100.0
    """Drop a whole sample if the largest ratio among its loss tokens is above this."""

    kl_tau: float = Field(0.0, ge=0)
    """Strength of the pull towards the sampling policy: advantages become A - kl_tau * log r (0 disables)."""

    @model_validator(mode="after")
    def _bounds_are_ordered(self) -> "LossConfig":
        for name in ("token_mask", "geo_mask", "sequence_mask"):
            low, high = getattr(self, f"{name}_low"), getattr(self, f"{name}_high")
            if not low < high:
                raise ValueError(f"{name}_low ({low}) must be < {name}_high ({high})")
        return self


class LoRAConfig(BaseConfig):
    """Low-rank adapters on the named linear layers; the base weights stay frozen and only adapters train."""

    rank: int = Field(8, ge=1)
    """r: adapter rank (vLLM serves ranks 1, 8, 16, 32, 64, 128, 256, 320 and 512 up to its `max_lora_rank`)."""

    alpha: float = Field(16.0, gt=0)
    """Scaling numerator: the adapter adds (alpha / rank) * B A x to the layer's output."""

    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input while training."""

    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    """Names (last component) of the linear layers that get adapters; each must match at least one layer."""


class TrainerModelConfig(ModelConfig):
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

    logprob_chunk: int = Field(1024, ge=1)
    """Positions whose logits the LM head computes at once (never a whole row's [tokens x vocab]). 1024 x Qwen3's
    151,936 vocab is ~0.6 GB per fp32 copy, a few copies at a time, while each chunk is still a large matmul."""

    lora: LoRAConfig | None = None
    """Train LoRA adapters instead of the full weights (`--model.lora` enables with defaults)."""

    cp: int = Field(1, ge=1)
    """Context parallelism: each packed row is split over `cp` consecutive ranks (Ulysses all-to-all attention over
    SDPA); must divide the ranks and the attention heads. For rows too long for one device's activations."""

    @model_validator(mode="after")
    def _check_lora(self) -> "TrainerModelConfig":
        if self.lora is None:
            return self
        if self.cp > 1:
            raise ValueError("model.lora does not support context parallelism (model.cp > 1) yet")
        if self.random_init:
            raise ValueError(
                "model.lora trains an adapter of the weights in model.name; with model.random_init the base would "
                "be random weights that no one could load the adapter onto"
            )
        return self


class CriticConfig(BaseConfig):
    """PPO's learned value function (`rl/critic.py`): a trunk with a scalar head, trained beside the policy; the policy
    then trains on per-token GAE advantages from the samples' rewards instead of the batch's advantages."""

    model: str | None = None
    """Hugging Face name or directory of the value model's trunk (a causal LM; its output layer is not used);
    None: the policy's `model.name`. It shares the policy's `model` settings (dtype, attn, ac, compile, offload)."""

    optim: OptimizerConfig = AdamWConfig(lr=1e-5)
    """The value model's own optimizer (constant learning rate), gradients clipped to its `max_norm`."""

    gamma: float = Field(1.0, ge=0, le=1)
    """GAE discount per sampled token (environment tokens between turns do not count as steps)."""

    lam: float = Field(1.0, ge=0, le=1)
    """GAE lambda: 1 gives Monte-Carlo returns minus the value, 0 the one-step TD error."""

    value_clip: float = Field(0.2, gt=0)
    """Epsilon of PPO's clipped value loss: a value may move at most this far from the step's start value before
    its clipped term takes over (binds only from the second of `epochs`: the first starts at those values)."""

    epochs: int = Field(1, ge=1)
    """Optimizer steps of the value loss per trainer step, each over the whole batch. Clipping relative to the values
    computed at the step's start only bites from the second on: in the first the values are still those."""


class ReferenceConfig(BaseConfig):
    """A KL penalty against a frozen reference policy: beta * KL(pi || pi_ref) per trained token joins the loss."""

    beta: float = Field(0.04, gt=0)
    """KL coefficient: how hard the policy is held near the reference (0.04: the GRPO paper's; omit the section
    for none)."""

    model: str | None = None
    """HF name or directory of the reference (same tokenizer as the policy); None: `model.name` as loaded at step 0,
    i.e. the initial policy (with `model.lora`: the base with the adapters off, no second copy)."""


class TrainerBenchConfig(BenchConfig):
    """`steps` on fake data: the trainer alone, no orchestrator, no publishing."""

    samples: int = Field(8, ge=1)
    """Samples per step."""

    variable_length: bool = False
    """Draw sample lengths uniformly from [seq_len/8, seq_len] instead of using exactly seq_len."""


class TrainerConfig(EntrypointConfig):
    model: TrainerModelConfig = TrainerModelConfig()
    """The model to train."""

    loss: LossConfig = LossConfig()
    """Objective, importance-ratio masking and KL shaping."""

    optim: OptimizerConfig = AdamWConfig()
    """Optimizer (`type = "adamw"` or `"sgd"`)."""

    scheduler: SchedulerConfig = ConstantSchedulerConfig()
    """Learning-rate schedule (`type = "constant"`, `"linear"` or `"cosine"`)."""

    reference: ReferenceConfig | None = None
    """KL penalty against a frozen reference policy (`--reference` enables with defaults)."""

    ckpt: CheckpointConfig | None = None
    """Resumable checkpoints (`--ckpt` enables with defaults)."""

    wandb: WandbConfig | None = None
    """Also log to W&B, as run `<name>-trainer` (`--wandb` enables with defaults)."""

    tensorboard: bool = False
    """Also write TensorBoard event files (scalars, histograms) to `{output_dir}/tensorboard/trainer/`."""

    bench: TrainerBenchConfig | None = None
    """Benchmark on fake data instead of training on rollouts (`--bench` enables); prints a summary table."""

    weight_broadcast: WeightBroadcastConfig = WeightBroadcastConfig()
    """How each new policy reaches inference: the filesystem, or an in-memory broadcast from rank 0."""

    seq_len: int = Field(2048, ge=1)
    """Maximum tokens of a sample (a longer one is an error) and of a packed row."""

    micro_batch_tokens: int | None = Field(None, ge=1)
    """Positions per forward pass, padding included (None: seq_len): as many rows run together as fit; the same
    gradient whatever the value. Raise it while memory allows: one forward of many rows beats many small ones."""

    max_steps: int | None = Field(None, ge=1)
    """Stop after this step (None: run until stopped)."""

    max_async_level: int = Field(2, ge=0)
    """How many steps inference may lag behind; decides which published weights must be kept."""

    batch_timeout: float | None = Field(3600.0, gt=0)
    """Seconds to wait for a step's batch before failing (None: wait forever). One hour is far longer than
    one step's rollouts take in a healthy run, so a trainer still waiting then has lost its orchestrator
    (it died or never started on this output_dir): fail with a message instead of hanging forever.
    Raise it for steps whose rollouts really take longer. A warning names the awaited file every minute."""

    seed: int = 0
    """Seed for random initialisation and fake data."""

    critic: CriticConfig | None = None
    """PPO with a learned critic: GAE advantages from a value model trained here (`--critic` enables with defaults)."""

    max_concurrent_runs: int = Field(1, ge=1)
    """With `model.lora`: runs trained at once, each an orchestrator on `output_dir/run_<name>` with its own adapter,
    optimizer, schedule, checkpoints and metrics (found while training); 1: `output_dir` itself is the one run."""

    @model_validator(mode="after")
    def _check(self) -> "TrainerConfig":
        if self.ckpt is not None and self.ckpt.resuming and self.bench is not None:
            raise ValueError("--bench runs on fake data and cannot resume from a checkpoint")
        if self.max_concurrent_runs > 1 and self.model.lora is None:
            raise ValueError("max_concurrent_runs > 1 trains one LoRA adapter per run: set [model.lora]")
        if self.model.lora is not None:
            if self.weight_broadcast.in_memory:
                raise ValueError(
                    f"weight_broadcast.type = {self.weight_broadcast.type!r}: LoRA adapters are published to "
                    "`broadcasts/` (a few MB each); use the filesystem type"
                )
            if self.bench is not None:
                raise ValueError("--bench measures full-weight training; it does not run LoRA adapters")
        if self.critic is not None:
            if self.model.lora is not None:
                raise ValueError("critic with model.lora: the LoRA trainer (one adapter per run) has no value model")
            if self.model.cp > 1:
                raise ValueError(f"critic with model.cp = {self.model.cp}: the value model has no context parallelism")
        return self
