"""Config of the `sft` entry point (supervised fine-tuning on chat data)."""

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from prime_rl.config import BaseConfig, EntrypointConfig
from prime_rl.config.optim import AdamWConfig, ConstantSchedulerConfig, OptimizerConfig, SchedulerConfig
from prime_rl.trainer.config import CheckpointConfig, TrainerBenchConfig, TrainerModelConfig
from prime_rl.utils.monitor_config import WandbConfig


class LossMaskConfig(BaseConfig):
    system: bool = False
    """Train on the tokens of system messages."""

    user: bool = False
    """Train on the tokens of user messages."""

    assistant: bool = True
    """Train on the tokens of assistant messages (content, tool calls and the end-of-turn token)."""

    tool: bool = False
    """Train on the tokens of tool results."""


class ChatDataConfig(BaseConfig):
    type: Literal["chat"] = "chat"
    """Data kind (selects this section)."""

    name: str = "PrimeIntellect/Reverse-Text-SFT"
    """Local .jsonl/.parquet file or directory of them, else a hub dataset id; rows: `prompt`, `completion`, [`tools`]."""

    split: str = "train"
    """Split to load from a Hugging Face dataset (local files are a single split)."""

    shuffle: bool = True
    """Visit the examples in a new seeded order every epoch (else in file order)."""

    loss_mask: LossMaskConfig = LossMaskConfig()
    """Which roles' tokens are trained on; template scaffolding that opens an assistant turn never is."""

    renderer: dict[str, Any] | None = None
    """Render with this `renderers` config (as `model.renderer` in rl/eval, e.g. `{name = "qwen3", enable_thinking =
    false}`) instead of the chat template: SFT then trains on exactly the tokens RL samples and bridges to, and only
    on the assistant tokens the model itself would sample."""


class FakeDataConfig(BaseConfig):
    type: Literal["fake"] = "fake"
    """Data kind (selects this section): `batch_size` rows of `seq_len` random tokens per step, in a normal run
    (exports, checkpoints); `--bench` uses the same rows for a throughput table."""


DataConfig = Annotated[ChatDataConfig | FakeDataConfig, Field(discriminator="type")]


class SFTConfig(EntrypointConfig):
    model: TrainerModelConfig = TrainerModelConfig()
    """The model to fine-tune."""

    data: DataConfig = ChatDataConfig()
    """Training data (`type = "chat"` or `"fake"`)."""

    optim: OptimizerConfig = AdamWConfig()
    """Optimizer (`type = "adamw"` or `"sgd"`)."""

    scheduler: SchedulerConfig = ConstantSchedulerConfig()
    """Learning-rate schedule (`type = "constant"`, `"linear"` or `"cosine"`)."""

    ckpt: CheckpointConfig | None = None
    """Resumable checkpoints, including the position in the data (`--ckpt` enables with defaults)."""

    wandb: WandbConfig | None = None
    """Also log to W&B, as run `<name>-sft` (`--wandb` enables with defaults)."""

    tensorboard: bool = False
    """Also write TensorBoard event files (scalars, histograms) to `{output_dir}/tensorboard/sft/`."""

    bench: TrainerBenchConfig | None = None
    """Benchmark on fake rows instead of `data` (`--bench` enables): no exports, no checkpoints; prints a table
    (with `model.lora`, of training the adapter)."""

    batch_size: int = Field(32, ge=1)
    """Examples (conversations) per optimizer step; skipped examples are replaced by the next ones."""

    seq_len: int = Field(2048, ge=2)
    """Maximum tokens of a conversation (longer ones are skipped) and of a packed row."""

    micro_batch_tokens: int | None = Field(None, ge=1)
    """Positions per forward pass, padding included (None: seq_len): as many rows run together as fit; the same
    gradient whatever the value. Raise it while memory allows: one forward of many rows beats many small ones."""

    max_steps: int = Field(100, ge=1)
    """Optimizer steps to run; the final weights are exported after the last one."""

    weights_interval: int | None = Field(None, ge=1)
    """Also export `weights/step_n` every this many steps (None: only after the last step); with `model.lora` each
    is a peft adapter directory of `model.name`. With `eval`, the exports are the policies evaluated."""

    seed: int = 0
    """Seed of the data order (reshuffled per epoch), random initialisation and fake data."""

    eval: Path | None = None
    """An `eval` config file (environments, sampling, `[inference]` or `client.base_url`): while sft trains, `eval`
    measures the starting model, then each `weights/step_n` once exported; metrics `eval/<env>/...` at each step."""

    eval_timeout: float = Field(1200.0, gt=0)
    """Seconds sft waits after its last step for the eval to finish (the other ranks wait at the exit barrier)."""

    @model_validator(mode="after")
    def _check(self) -> "SFTConfig":
        # Imported here: config modules load without torch (the `rl` launcher reads them), optim needs it.
        from prime_rl.trainer.optim import lr_at

        steps = self.bench.steps if self.bench else self.max_steps
        lr_at(0, self.optim.lr, self.scheduler, steps)  # a schedule longer than the run fails at load
        if self.eval is not None and not self.eval.is_file():
            raise ValueError(f"eval: {self.eval} is not a file (an `eval` config, e.g. configs/reverse_text/eval.toml)")
        if self.ckpt is not None and self.ckpt.resuming and self.bench is not None:
            raise ValueError("--bench runs on fake data and cannot resume from a checkpoint")
        return self
