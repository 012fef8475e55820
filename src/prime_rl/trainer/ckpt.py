"""Resumable trainer checkpoints: DCP shards of model + optimizer, plus scheduler and progress.

Layout: `checkpoints/step_n/<name>/` (`trainer` for RL, `sft` for SFT) holds the DCP files, `extra.pt`
(scheduler, progress) and, last, the `COMPLETE` marker. A checkpoint without the marker (a crash mid-save) is never resumed from.
DCP checkpoints are resharded on load, so a run may resume on a different number of ranks.

A LoRA adapter's checkpoint (sft with `model.lora`, each run of the LoRA trainer) is plain files instead, written by
rank 0 (every rank holds the same adapter and optimizer state): `adapter.safetensors` (peft tensor names, no slot in
them), `optimizer.pt`, `extra.pt`, `COMPLETE`. The frozen base is not in it: a resume loads it from `model.name` again.
"""

import contextlib
import shutil
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from loguru import logger
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from prime_rl.config import CheckpointConfig
from prime_rl.utils.fs import atomic_dir

if TYPE_CHECKING:
    from prime_rl.trainer.model.lora import LoRAAdapters

COMPLETE = "COMPLETE"
ADAPTER_CHECKPOINT = "adapter.safetensors"


@dataclass
class Progress:
    step: int = 0
    """Optimizer steps taken (the policy is pi_step)."""
    tokens: int = 0
    """Real (non-padding) tokens trained on."""
    samples: int = 0
    """Samples trained on."""


P = TypeVar("P", bound=Progress)


def step_dir(output_dir: Path, step: int, name: str = "trainer") -> Path:
    return Path(output_dir) / "checkpoints" / f"step_{step}" / name


def complete_steps(output_dir: Path, name: str = "trainer") -> list[int]:
    """Steps with a finished checkpoint of `name`, ascending."""
    steps = []
    for path in (Path(output_dir) / "checkpoints").glob(f"step_*/{name}"):
        if (path / COMPLETE).exists():
            steps.append(int(path.parent.name.split("_")[1]))
    return sorted(steps)


def resolve_resume_step(output_dir: Path, requested: int, name: str = "trainer") -> int:
    """-1 -> the latest complete checkpoint; N -> N, which must be complete. Warns about unfinished ones."""
    complete = complete_steps(output_dir, name)
    for path in sorted((Path(output_dir) / "checkpoints").glob(f"step_*/{name}")):
        if not (path / COMPLETE).exists():
            logger.warning(f"skipping checkpoint {path}: it has no {COMPLETE} marker (interrupted while saving)")
    if requested == -1:
        if not complete:
            raise FileNotFoundError(f"--ckpt.resume-step -1: no complete checkpoint under {output_dir}/checkpoints")
        return complete[-1]
    if requested not in complete:
        raise FileNotFoundError(
            f"no complete checkpoint for step {requested} under {output_dir}/checkpoints (complete: {complete})"
        )
    return requested


def prune_checkpoints(output_dir: Path, config: CheckpointConfig, latest: int, name: str = "trainer") -> None:
    """Delete the complete checkpoints before `latest` that `keep_last` / `keep_interval` do not keep (and a
    `step_n/` left empty by that: another process's half, e.g. the orchestrator's, keeps it)."""
    steps = complete_steps(output_dir, name)
    keep = config.kept(steps)
    for step in steps:
        if step not in keep and step < latest:
            path = step_dir(output_dir, step, name)
            shutil.rmtree(path, ignore_errors=True)
            with contextlib.suppress(OSError):  # not empty (the other half is there), or its owner removed it
                path.parent.rmdir()


def save_adapter_checkpoint(
    target: Path, adapters: "LoRAAdapters", slot: int, optimizer, scheduler, progress: Progress
) -> Path:
    """Rank 0: the adapter of `slot` with its optimizer, schedule and progress at `target`, complete with its
    `COMPLETE` marker or not there at all."""
    with atomic_dir(target) as tmp:
        save_file(adapters.state(slot), str(tmp / ADAPTER_CHECKPOINT))
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save({"scheduler": scheduler.state_dict(), "progress": asdict(progress)}, tmp / "extra.pt")
    (target / COMPLETE).touch()
    return target


def load_adapter_checkpoint(
    path: Path, adapters: "LoRAAdapters", slot: int, optimizer, scheduler, progress_type: type[P] = Progress
) -> P:
    """Every rank reads the same files: the adapter into `slot`, the optimizer (whose parameters are the slot's, in
    `slot_params` order) and the schedule; returns the saved progress."""
    if not (path / ADAPTER_CHECKPOINT).exists():
        raise FileNotFoundError(f"{path} has no {ADAPTER_CHECKPOINT}: it was saved without model.lora")
    adapters.load_state(slot, load_file(str(path / ADAPTER_CHECKPOINT)))
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
    extra = torch.load(path / "extra.pt", weights_only=False)
    scheduler.load_state_dict(extra["scheduler"])
    return progress_type(**extra["progress"])


class CheckpointManager:
    def __init__(
        self,
        output_dir: Path,
        config: CheckpointConfig,
        is_main: bool,
        name: str = "trainer",
        adapters: "LoRAAdapters | None" = None,
    ):
        self.output_dir = Path(output_dir)
        self.config = config
        self.is_main = is_main
        self.name = name
        self.adapters = adapters
        """With `model.lora`: checkpoints are slot 0's adapter checkpoint (written at once, `save_async` or not: a
        few MB), not DCP shards."""
        self.pending: Future | None = None
        self.pending_step: int | None = None
        """The step of a save still being written in the background (it has no `COMPLETE` marker yet)."""
        # Background saves need their own group so they never interleave with training collectives.
        self.group = dist.new_group(backend="gloo") if config.save_async else None

    def save(self, step: int, model, optimizer, scheduler, progress: Progress) -> None:
        self.wait()
        path = step_dir(self.output_dir, step, self.name)
        if self.is_main and path.exists():
            shutil.rmtree(path)  # a stale, unfinished attempt at the same step
        dist.barrier()
        if self.adapters is not None:
            if self.is_main:
                save_adapter_checkpoint(path, self.adapters, 0, optimizer, scheduler, progress)
                logger.info(f"checkpoint for step {step} complete at {path}")
                self._prune(step)
            dist.barrier()
            return
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        extra = {"scheduler": scheduler.state_dict(), "progress": asdict(progress)}
        if self.config.save_async:
            written = dcp.async_save(state, checkpoint_id=str(path), process_group=self.group)
            self.pending, self.pending_step = Future(), step
            written.add_done_callback(partial(self._finish_async, self.pending, step, path, extra))
        else:
            dcp.save(state, checkpoint_id=str(path))
            dist.barrier()
            self._finish(step, path, extra)

    def _finish(self, step: int, path: Path, extra: dict) -> None:
        if not self.is_main:
            return
        torch.save(extra, path / "extra.pt")
        (path / COMPLETE).touch()
        logger.info(f"checkpoint for step {step} complete at {path}")
        self._prune(step)

    def _finish_async(self, done: Future, step: int, path: Path, extra: dict, written: Future) -> None:
        """When the background write ends: mark the checkpoint complete only if it succeeded, then settle `done`,
        which `wait()` waits for (the write's own future settles before its callbacks have run)."""
        try:
            written.result()
            self._finish(step, path, extra)
            done.set_result(None)
        except BaseException as e:
            done.set_exception(e)

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.pending = self.pending_step = None
            dist.barrier(group=self.group)

    def live_steps(self) -> set[int]:
        """Steps a resume may start from, now or once the save in flight completes: the complete checkpoints
        and the one being written. Whatever a resume needs besides the checkpoint (the step's published
        weights) must stay while its step is in here, and may go once it is not.
        """
        pending = self.pending_step  # read first: a save that completes meanwhile is then listed either way
        return set(complete_steps(self.output_dir, self.name)) | ({pending} if pending is not None else set())

    def _prune(self, latest: int) -> None:
        prune_checkpoints(self.output_dir, self.config, latest, self.name)

    def load(self, step: int, model, optimizer, scheduler, progress_type: type[P] = Progress) -> P:
        """Restore model, optimizer and scheduler in place; returns the saved progress as `progress_type`
        (a `Progress` subclass when the entry point records more, e.g. SFT's data position)."""
        path = step_dir(self.output_dir, step, self.name)
        if self.adapters is not None:
            return load_adapter_checkpoint(path, self.adapters, 0, optimizer, scheduler, progress_type)
        if (path / ADAPTER_CHECKPOINT).exists():
            raise FileNotFoundError(f"{path} holds a LoRA adapter (saved with model.lora): resume it with model.lora")
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"])
        extra = torch.load(path / "extra.pt", weights_only=False)
        scheduler.load_state_dict(extra["scheduler"])
        return progress_type(**extra["progress"])
