"""Resumable trainer checkpoints: DCP shards of model + optimizer, plus scheduler and progress.

Layout: `checkpoints/step_n/<name>/` (`trainer` for RL, `sft` for SFT) holds the DCP files, `extra.pt`
(scheduler, progress) and, last, the `COMPLETE` marker. A checkpoint without the marker (a crash mid-save) is never resumed from.
DCP checkpoints are resharded on load, so a run may resume on a different number of ranks.
"""

import shutil
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from loguru import logger
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from prime_rl.config import CheckpointConfig

COMPLETE = "COMPLETE"


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


class CheckpointManager:
    def __init__(self, output_dir: Path, config: CheckpointConfig, is_main: bool, name: str = "trainer"):
        self.output_dir = Path(output_dir)
        self.config = config
        self.is_main = is_main
        self.name = name
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
        steps = complete_steps(self.output_dir, self.name)
        keep = self.config.kept(steps)
        for step in steps:
            if step not in keep and step < latest:
                shutil.rmtree(step_dir(self.output_dir, step, self.name), ignore_errors=True)
                parent = step_dir(self.output_dir, step, self.name).parent
                if parent.exists() and not any(parent.iterdir()):
                    parent.rmdir()

    def load(self, step: int, model, optimizer, scheduler, progress_type: type[P] = Progress) -> P:
        """Restore model, optimizer and scheduler in place; returns the saved progress as `progress_type`
        (a `Progress` subclass when the entry point records more, e.g. SFT's data position)."""
        path = step_dir(self.output_dir, step, self.name)
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"])
        extra = torch.load(path / "extra.pt", weights_only=False)
        scheduler.load_state_dict(extra["scheduler"])
        return progress_type(**extra["progress"])
