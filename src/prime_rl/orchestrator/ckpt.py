"""Orchestrator checkpoints: progress and buffer, at the trainer's checkpoint steps.

Layout: `checkpoints/step_n/orchestrator/{progress,buffer}.json`, written as one directory that appears
atomically, so a directory that exists is complete. `step_n` means batches 1..n were written: a resumed
orchestrator writes batch n+1 next, which is what a trainer resumed from its step-n checkpoint reads next.
"""

import contextlib
import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from prime_rl.config import CheckpointConfig
from prime_rl.utils.fs import atomic_dir


@dataclass
class Progress:
    step: int = 0
    """Batches written."""
    tokens: int = 0
    """Tokens in the written batches."""
    samples: int = 0
    """Samples in the written batches."""
    problems: int = 0
    """Groups (tasks rolled out) in the written batches."""


def ckpt_dir(output_dir: Path, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"step_{step}" / "orchestrator"


def saved_steps(output_dir: Path) -> list[int]:
    return sorted(
        int(p.parent.name.removeprefix("step_")) for p in Path(output_dir).glob("checkpoints/step_*/orchestrator")
    )


def resolve_resume_step(output_dir: Path, requested: int) -> int:
    """-1 -> the latest orchestrator checkpoint; N -> N, which must exist."""
    steps = saved_steps(output_dir)
    if requested == -1:
        if not steps:
            raise FileNotFoundError(f"--ckpt.resume-step -1: no orchestrator checkpoint under {output_dir}/checkpoints")
        return steps[-1]
    if requested not in steps:
        raise FileNotFoundError(
            f"no orchestrator checkpoint for step {requested} under {output_dir}/checkpoints (have {steps})"
        )
    return requested


def save(output_dir: Path, progress: Progress, buffer_state: dict, config: CheckpointConfig) -> Path:
    """Write step `progress.step`'s checkpoint, then delete those `config.keep_last` / `keep_interval` drop (as the
    trainer does with its own, so a step keeps both halves or neither)."""
    target = ckpt_dir(output_dir, progress.step)
    with atomic_dir(target) as tmp:
        (tmp / "progress.json").write_text(json.dumps(asdict(progress)))
        (tmp / "buffer.json").write_text(json.dumps(buffer_state))
    steps = saved_steps(output_dir)
    for step in set(steps) - config.kept(steps):
        shutil.rmtree(ckpt_dir(output_dir, step), ignore_errors=True)
        with contextlib.suppress(OSError):  # the step's directory, once the trainer's half is gone too
            ckpt_dir(output_dir, step).parent.rmdir()
    return target


def load(output_dir: Path, step: int) -> tuple[Progress, dict]:
    path = ckpt_dir(output_dir, step)
    progress = Progress(**json.loads((path / "progress.json").read_text()))
    return progress, json.loads((path / "buffer.json").read_text())
