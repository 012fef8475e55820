"""One monitoring interface per process, with sinks: `{output_dir}/metrics.jsonl` always, W&B and TensorBoard when
configured.

    monitor = Monitor(output_dir, "trainer", config.wandb, config.model_dump(mode="json"), tensorboard=True)
    monitor.log(step, {"loss": 0.1})
    metrics |= monitor.log_distribution(step, "distribution/reward", rewards)
    monitor.log_table(step, "samples", ["prompt", "completion"], rows)
    monitor.close(exit_code)

Every process of a run gets its own W&B run, `<name>-<process>`, in one group, all logged against the
training step (`step=`), so the trainer's and the orchestrator's curves line up. A process resumed from a
checkpoint continues its W&B run (the id is kept in `{output_dir}/wandb/<process>.run-id`); W&B ignores steps
at or below the last one it has, so the steps redone after a crash keep their first values there, while
metrics.jsonl gets a line for each.

TensorBoard event files go to `{output_dir}/tensorboard/<process>/` (`tensorboard --logdir {output_dir}/tensorboard`
shows every process of the run): each numeric metric as a scalar at its step, each distribution as a histogram. A
resumed process adds a new event file there; TensorBoard shows both, the redone steps twice.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from prime_rl.utils.fs import write_atomic
from prime_rl.utils.metrics import append_metrics
from prime_rl.utils.monitor_config import WandbConfig

QUANTILES = (10, 50, 90)
"""Percentiles of a distribution kept in metrics.jsonl (the full histogram goes to W&B and TensorBoard only)."""


class MonitorError(RuntimeError):
    """A sink could not be opened (e.g. W&B online without a login)."""


def distribution_summary(name: str, values: list[float]) -> dict[str, float]:
    """Summary statistics of a distribution, as flat `name/stat` metrics."""
    a = np.asarray(values, dtype=np.float64)
    stats = {"mean": a.mean(), "std": a.std(), "min": a.min(), "max": a.max()}
    stats.update({f"p{q}": v for q, v in zip(QUANTILES, np.percentile(a, QUANTILES), strict=True)})
    return {f"{name}/{k}": float(v) for k, v in stats.items()}


class Monitor:
    def __init__(
        self,
        output_dir: Path,
        process: str,
        wandb_config: WandbConfig | None = None,
        run_config: dict[str, Any] | None = None,
        resume: bool = False,
        tensorboard: bool = False,
    ):
        self.output_dir, self.process = Path(output_dir), process
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.run = None
        if wandb_config is not None:
            self.run = _init_wandb(self.output_dir, process, wandb_config, run_config or {}, resume)
        self.wandb_step = -1
        """The newest step W&B was given: it drops a row logged below it, so a later row of an older step (an online
        eval finishing after newer training steps) goes to this one, and is plotted against its own axis."""
        self.tensorboard = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # only when asked: it needs the tensorboard package

            self.tensorboard = SummaryWriter(str(self.output_dir / "tensorboard" / process))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        append_metrics(self.output_dir, self.process, step, metrics)
        if self.run is not None:
            self.wandb_step = max(self.wandb_step, step)
            self.run.log({k: v for k, v in metrics.items() if v is not None}, step=self.wandb_step)
        if self.tensorboard is not None:
            for name, value in metrics.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    self.tensorboard.add_scalar(name, value, step)
            self.tensorboard.flush()  # a crashed process keeps what it logged

    def define_axis(self, prefix: str, axis: str) -> None:
        """W&B plots the metrics named `prefix*` against the metric `axis` (logged with them), not the process's step:
        rows that may be logged after newer steps (see `wandb_step`) still land at their own x. metrics.jsonl and
        TensorBoard take every row at its own step anyway."""
        if self.run is not None:
            self.run.define_metric(axis)
            self.run.define_metric(f"{prefix}*", step_metric=axis)

    def log_distribution(self, step: int, name: str, values: list[float]) -> dict[str, float]:
        """W&B gets a histogram; returns `name/{mean,std,min,max,p10,p50,p90}` for the caller to add to the step's
        metrics (metrics.jsonl keeps one line per process and step)."""
        if len(values) == 0:
            return {}
        if self.run is not None:
            import wandb

            self.run.log({name: wandb.Histogram(values)}, step=step)
        if self.tensorboard is not None:
            self.tensorboard.add_histogram(name, np.asarray(values, dtype=np.float64), step)
        return distribution_summary(name, values)

    def log_table(self, step: int, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        """W&B gets a table; `{output_dir}/tables.jsonl` one line per table, so samples are kept without W&B too."""
        line = {"process": self.process, "step": step, "table": name, "columns": columns, "rows": rows}
        with open(self.output_dir / "tables.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        if self.run is not None:
            import wandb

            self.run.log({name: wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self, exit_code: int = 0) -> None:
        """A non-zero `exit_code` marks the W&B run failed."""
        if self.run is not None:
            self.run.finish(exit_code=exit_code)
            self.run = None
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None


def _init_wandb(output_dir: Path, process: str, config: WandbConfig, run_config: dict[str, Any], resume: bool):
    import wandb  # only when configured: the import costs seconds

    prefix = config.name or output_dir.resolve().name
    id_file = output_dir / "wandb" / f"{process}.run-id"
    run_id = id_file.read_text().strip() if resume and id_file.exists() else None  # None: W&B picks a new id
    try:
        run = wandb.init(
            project=config.project,
            id=run_id,
            resume="allow" if run_id else None,
            name=f"{prefix}-{process}",
            group=config.group or prefix,
            job_type=process,
            config=run_config,
            mode="offline" if config.offline else None,  # None: WANDB_MODE decides (online by default)
            dir=None if os.environ.get("WANDB_DIR") else output_dir,
            reinit="create_new",  # one process may own several runs (the tests do)
            # Console output already goes to {output_dir}/logs; wrapping stdout would duplicate it.
            settings=wandb.Settings(console="off", silent=True),
        )
    except Exception as e:
        raise MonitorError(
            f"W&B run {prefix}-{process} could not start: {e} (log in with `wandb login`, or use --wandb.offline)"
        ) from e
    write_atomic(id_file, run.id.encode())
    return run
