"""The runs a LoRA trainer trains: each one orchestrator's output directory, with its own adapter slot, optimizer,
schedule, progress, checkpoints and metrics.

Where runs are: with `max_concurrent_runs = 1`, `output_dir` itself; with more, every `output_dir/run_*` directory.
A run is known by its orchestrator's resolved config, `configs/orchestrator.toml` (written when the orchestrator
starts), which must have an `[adapter]` section; its optimizer, schedule and seed come from there, its length from
its `max_steps`. A directory whose config is invalid gets `configs/trainer_error.txt` and is skipped until the config
changes, and so does a run whose adapter diverged (a NaN or an infinity after a step: it is not published, the run
ends, and the file says at which step and in which tensor; the other runs go on); an orchestrator restarted on the directory rewrites its config, and the run restarts in the trainer from the
checkpoint its `ckpt.resume_step` names. A run whose orchestrator has exited (its `.locks/orchestrator.lock` is free)
leaves once no batch is left to train, and a directory whose orchestrator is gone is not waited for: the trainer
stops when every run it trained has ended and no live orchestrator is starting another.

Rank 0 looks at the directories (`Runs.changes`); every rank applies the same `Changes` (`Runs.apply`), so all ranks
agree on the set of runs at every step. A run's own files, beside the orchestrator's:

    broadcasts/step_n/                 the adapter after n steps (peft format; STABLE once complete)
    checkpoints/step_n/trainer/        adapter.safetensors, optimizer.pt, extra.pt (schedule, progress), COMPLETE
    metrics.jsonl                      "trainer" lines with this run's step metrics (W&B run `<name>-trainer`)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from loguru import logger

from prime_rl.config.loader import fill_discriminators, load_toml
from prime_rl.config.orchestrator import OrchestratorConfig
from prime_rl.trainer.ckpt import (
    Progress,
    complete_steps,
    load_adapter_checkpoint,
    prune_checkpoints,
    resolve_resume_step,
    save_adapter_checkpoint,
    step_dir,
)
from prime_rl.trainer.config import TrainerConfig
from prime_rl.trainer.model.lora import LoRAAdapters
from prime_rl.trainer.optim import build_optimizer, build_scheduler, clip_grad_norm
from prime_rl.trainer.weights import STABLE, broadcast_dir, nonfinite_tensor_name, prune_broadcasts
from prime_rl.utils.fs import remove_steps_after, write_atomic
from prime_rl.utils.locks import holder_alive
from prime_rl.utils.monitor import Monitor

RUN_CONFIG = Path("configs") / "orchestrator.toml"
CONFIG_ERROR = Path("configs") / "trainer_error.txt"


def read_run_config(run_dir: Path) -> OrchestratorConfig:
    """The run's orchestrator config; `ValueError` saying what is wrong with it."""
    try:
        data, _ = load_toml(run_dir / RUN_CONFIG)
        config = OrchestratorConfig.model_validate(fill_discriminators(OrchestratorConfig, data))
    except Exception as e:  # a TOML, include or validation error: the message is the point
        raise ValueError(f"{run_dir / RUN_CONFIG}: {e}") from None
    if config.adapter is None:
        raise ValueError(f"{run_dir / RUN_CONFIG}: no [adapter] section; a LoRA trainer trains adapters only")
    return config


@dataclass
class Joining:
    """A run entering a slot, as rank 0 found it."""

    name: str
    path: Path
    slot: int
    config: OrchestratorConfig
    resume_step: int | None
    """Step whose checkpoint it resumes from (None: a fresh adapter)."""


@dataclass
class Changes:
    """What every rank does before a step: runs that leave (name -> why), runs that join, runs whose batch is ready."""

    leaving: dict[str, str] = field(default_factory=dict)
    joining: list[Joining] = field(default_factory=list)
    ready: list[str] = field(default_factory=list)
    done: bool = False
    """No run left to train and none coming: the trainer stops."""


@dataclass
class Run:
    """One run inside the trainer."""

    name: str
    path: Path
    slot: int
    config: OrchestratorConfig
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    progress: Progress
    max_steps: int | None
    max_norm: float
    monitor: Monitor | None
    config_mtime: float
    waiting_since: float = field(default_factory=time.monotonic)

    @property
    def next_batch(self) -> Path:
        return self.path / "rollouts" / f"step_{self.progress.step + 1}" / "batch.bin"


class Runs:
    def __init__(self, config: TrainerConfig, adapters: LoRAAdapters, is_main: bool, monitor: Monitor | None):
        self.config, self.adapters, self.is_main = config, adapters, is_main
        self.monitor = monitor
        """The trainer's own monitor (rank 0): with one run, that run's metrics go there."""
        self.active: dict[str, Run] = {}
        self.ended: dict[str, float] = {}
        """Runs that finished or failed -> their config's mtime then: they join again only when it changes."""
        self.first_seen: dict[str, float] = {}
        self.seen_any = False

    # -- rank 0: what changes ------------------------------------------------------------------------------

    def directories(self) -> list[Path]:
        root = Path(self.config.output_dir)
        if self.config.max_concurrent_runs == 1:
            return [root]
        return sorted(p for p in root.glob("run_*") if p.is_dir())

    def changes(self, timeout: float | None) -> Changes:
        """Rank 0: which runs leave (finished, failed, gone, restarted), which join, and whose next batch is there."""
        changes = Changes()
        now = time.monotonic()
        present = {p.name if self.config.max_concurrent_runs > 1 else "run": p for p in self.directories()}
        # Probed once per look and before any batch is looked for: an orchestrator seen gone wrote all it ever will.
        gone = {name for name, path in present.items() if orchestrator_gone(path)}
        for name, run in self.active.items():
            mtime = _mtime(run.path / RUN_CONFIG)
            if name not in present or mtime is None:
                changes.leaving[name] = "its directory or config is gone"
            elif mtime != run.config_mtime:
                changes.leaving[name] = "its orchestrator restarted (new config): it rejoins from its checkpoint"
            elif run.max_steps is not None and run.progress.step >= run.max_steps:
                changes.leaving[name] = f"finished ({run.max_steps} steps)"
            elif name in gone and not run.next_batch.exists():
                changes.leaving[name] = f"failed: its orchestrator exited before writing {run.next_batch}"
            elif timeout is not None and now - run.waiting_since > timeout:
                changes.leaving[name] = f"failed: no batch {run.next_batch} within {timeout:g} s (batch_timeout)"
        free = sorted(set(range(self.config.max_concurrent_runs)) - {r.slot for r in self.active.values()})
        free = sorted(set(free) | {self.active[n].slot for n in changes.leaving})
        restarted = {n for n, run in self.active.items() if n in changes.leaving and n in present and
                     _mtime(run.path / RUN_CONFIG) not in (None, run.config_mtime)}  # fmt: skip
        for name, path in present.items():
            if name in self.active and name not in restarted:
                continue
            mtime = _mtime(path / RUN_CONFIG)
            if mtime is None:
                self.first_seen.setdefault(name, now)
                continue
            if self.ended.get(name) == mtime or name in gone:  # e.g. a run of an earlier launch: not coming
                continue
            try:
                config = read_run_config(path)
            except ValueError as e:
                if self.ended.get(name) != mtime:
                    logger.error(f"run {name} not started: {e}")
                    write_atomic(path / CONFIG_ERROR, f"{e}\n".encode())
                    self.ended[name] = mtime
                continue
            if not free:
                if name not in self.first_seen:
                    logger.warning(
                        f"run {name} waits for a free slot (max_concurrent_runs={self.config.max_concurrent_runs})"
                    )
                self.first_seen.setdefault(name, now)
                continue
            resume = config.ckpt.resume_step if config.ckpt is not None else None
            if resume is not None:
                try:
                    resume = resolve_resume_step(path, resume) if complete_steps(path) or resume != -1 else None
                except FileNotFoundError as e:
                    logger.error(f"run {name} not started: {e}")
                    self.ended[name] = mtime
                    continue
            changes.joining.append(Joining(name, path, free.pop(0), config, resume))
        for name in [n for n in self.active if n not in changes.leaving]:
            if self.active[name].next_batch.exists():
                changes.ready.append(name)
        for joining in changes.joining:
            step = joining.resume_step or 0
            if (joining.path / "rollouts" / f"step_{step + 1}" / "batch.bin").exists():
                changes.ready.append(joining.name)
        pending = [n for n in present if n not in self.ended and n not in self.active and n not in
                   {j.name for j in changes.joining} and n not in gone]  # fmt: skip
        stays = set(self.active) - set(changes.leaving) | {j.name for j in changes.joining}
        self.seen_any = self.seen_any or bool(stays)
        changes.done = self.seen_any and not stays and not pending
        return changes

    def worth_a_step(self, changes: Changes) -> bool:
        return bool(changes.ready or changes.leaving or changes.joining or changes.done)

    # -- every rank: apply them ----------------------------------------------------------------------------

    def apply(self, changes: Changes) -> None:
        for name, why in changes.leaving.items():
            run = self.active.pop(name)
            if self.is_main:
                (logger.error if why.startswith("failed") else logger.info)(f"run {name} leaves: {why}")
                self.ended[name] = run.config_mtime
                if run.monitor is not None and run.monitor is not self.monitor:
                    run.monitor.close(1 if why.startswith("failed") else 0)
        for joining in changes.joining:
            self.active[joining.name] = self._start(joining)

    def _start(self, joining: Joining) -> Run:
        config, adapter = joining.config, joining.config.adapter
        optim = adapter.optim or self.config.optim
        max_steps = config.max_steps or self.config.max_steps
        self.adapters.reset_slot(joining.slot, adapter.seed if adapter.seed is not None else self.config.seed)
        params = self.adapters.slot_params(joining.slot)
        optimizer = build_optimizer(params, optim)
        scheduler = build_scheduler(optimizer, adapter.scheduler or self.config.scheduler, max_steps)
        progress = Progress()
        if joining.resume_step is not None:
            progress = load_adapter_checkpoint(step_dir(joining.path, joining.resume_step), self.adapters,
                                               joining.slot, optimizer, scheduler)  # fmt: skip
        monitor = None
        if self.is_main:
            # Adapters after the start step are an earlier life's: its orchestrator must not load them. (The
            # orchestrator drops its own stale batches before it writes the config that starts the run.)
            remove_steps_after(joining.path / "broadcasts", progress.step)
            if self.config.max_concurrent_runs == 1:
                monitor = self.monitor
            else:
                wandb = self.config.wandb if config.wandb is None else config.wandb
                tensorboard = self.config.tensorboard or config.tensorboard  # the trainer's or the run's
                monitor = Monitor(joining.path, "trainer", wandb, config.model_dump(mode="json"),
                                  joining.resume_step is not None, tensorboard)  # fmt: skip
            logger.info(f"run {joining.name} joins in slot {joining.slot} at step {progress.step} "
                        f"(lr {optim.lr:g}, max_steps {max_steps})")  # fmt: skip
        mtime = _mtime(joining.path / RUN_CONFIG) or 0.0
        return Run(joining.name, joining.path, joining.slot, config, optimizer, scheduler, progress, max_steps,
                   optim.max_norm, monitor, mtime)  # fmt: skip

    def by_slot(self) -> dict[int, Run]:
        return {run.slot: run for run in self.active.values()}

    # -- after the backward pass ---------------------------------------------------------------------------

    def optimizer_step(self, run: Run) -> tuple[float, float]:
        """Clip and step this run's adapter alone; returns its gradient norm before clipping and the lr used."""
        params = self.adapters.slot_params(run.slot)
        grad_norm = clip_grad_norm(params, run.max_norm)
        lr = run.scheduler.get_last_lr()[0]
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        run.scheduler.step()
        return grad_norm, lr

    def publish(self, run: Run, base_model: str, dtype: torch.dtype) -> str | None:
        """Rank 0: the adapter after `run.progress.step` steps to `broadcasts/`, maybe a checkpoint, then pruning.
        An adapter with a NaN or an infinity (as exported in `dtype`) is neither published nor checkpointed: returns
        why (the step and the tensor; also written to the run's `configs/trainer_error.txt`), else None."""
        step = run.progress.step
        diverged = self.divergence(run, dtype)
        if diverged is not None:  # (`apply` logs it as the run leaves)
            write_atomic(run.path / CONFIG_ERROR, f"the trainer ended this run: it {diverged}\n".encode())
            return diverged
        self.adapters.save(run.slot, broadcast_dir(run.path, step), base_model, dtype, STABLE)
        ckpt = run.config.ckpt
        if ckpt is not None and ckpt.due(step, run.max_steps):
            save_run_checkpoint(run, self.adapters)
            prune_checkpoints(run.path, ckpt, step)
        live = set(complete_steps(run.path)) if ckpt is not None else set()
        prune_broadcasts(run.path, step, run.config.max_async_level, keep=live)
        return None

    def divergence(self, run: Run, dtype: torch.dtype) -> str | None:
        """Why the run's adapter must not be published (a NaN or an infinity in it, cast to `dtype`), or None."""
        name = nonfinite_tensor_name(self.adapters.state(run.slot), dtype)
        if name is None:
            return None
        return (
            f"diverged at step {run.progress.step}: its adapter has non-finite values (NaN or inf) in {name}; "
            "it is not published"
        )


def orchestrator_gone(run_dir: Path) -> bool:
    """An orchestrator ran on the directory and has exited or died (its lock is free): no batch will come. False
    where that is unknown (no lock file, e.g. batches written by hand, or a filesystem without `flock`)."""
    return holder_alive(run_dir, "orchestrator") is False


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return None


def save_run_checkpoint(run: Run, adapters: LoRAAdapters) -> Path:
    """Rank 0 (every rank holds the same adapter and optimizer state): `checkpoints/step_n/trainer/`, complete with
    its marker or not there at all. Tensors are keyed by slot-independent names: a resumed run may get another slot."""
    target = step_dir(run.path, run.progress.step)
    save_adapter_checkpoint(target, adapters, run.slot, run.optimizer, run.scheduler, run.progress)
    logger.info(f"run {run.name}: checkpoint for step {run.progress.step} complete at {target}")
    return target
