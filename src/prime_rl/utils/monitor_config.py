"""Config of the optional W&B sink of `Monitor` (torch-free: the `rl` launcher and `--help` read it)."""

from prime_rl.config import BaseConfig


class WandbConfig(BaseConfig):
    project: str = "prime-rl"
    """W&B project the runs are logged to."""

    name: str | None = None
    """Run name prefix: each process logs to its own run `<name>-<process>` (None: the output directory's name)."""

    group: str | None = None
    """W&B group that ties the runs of one experiment together (None: the run name prefix)."""

    offline: bool = False
    """Log to local files only (`wandb sync` uploads them later); `WANDB_MODE=offline` does the same."""
