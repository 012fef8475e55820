"""Orchestrator checkpoints: progress and the state of the parts that keep one, at the trainer's checkpoint steps.

Layout: `checkpoints/step_n/orchestrator/progress.json` and one `<name>.json` per state (`buffer`, and where
enabled `advantage_baseline` of `reinforce_mean` and `temperature` of the temperature scaling), written as one
directory that appears atomically, so a directory that exists is complete. `step_n` means batches 1..n were written: a resumed
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


def save(output_dir: Path, progress: Progress, states: dict[str, dict], config: CheckpointConfig) -> Path:
    """Write step `progress.step`'s checkpoint (`states`: name -> JSON-able state), then delete those
    `config.keep_last` / `keep_interval` drop (as the trainer does with its own, so a step keeps both halves or
    neither)."""
    target = ckpt_dir(output_dir, progress.step)
    with atomic_dir(target) as tmp:
        (tmp / "progress.json").write_text(json.dumps(asdict(progress)))
        for name, state in states.items():
            (tmp / f"{name}.json").write_text(json.dumps(state))
    steps = saved_steps(output_dir)
    for step in set(steps) - config.kept(steps):
        shutil.rmtree(ckpt_dir(output_dir, step), ignore_errors=True)
        with contextlib.suppress(OSError):  # the step's directory, once the trainer's half is gone too
            ckpt_dir(output_dir, step).parent.rmdir()
    return target


def load(output_dir: Path, step: int) -> tuple[Progress, dict[str, dict]]:
    """Progress and the saved states by name (a state the saving run did not keep is absent)."""
    path = ckpt_dir(output_dir, step)
    progress = Progress(**json.loads((path / "progress.json").read_text()))
    states = {p.stem: json.loads(p.read_text()) for p in sorted(path.glob("*.json")) if p.name != "progress.json"}
    return progress, states
