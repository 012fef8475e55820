"""Where a run picks up: the checkpoint step it resumes from, and what an earlier run left that must go.

Trainer and orchestrator checkpoint separately; a run resumes only from a step both saved (`-1`: the latest such
step), and each run of `[[runs]]` from its own. Rollouts and weights after that step (or all of them, fresh)
would be consumed as if new, so they are deleted before any process starts.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from loguru import logger

from prime_rl.orchestrator import ckpt as orchestrator_ckpt
from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.rl.config import RLConfig
from prime_rl.rl.preflight import fail


def resolve_resume(config: RLConfig) -> int | None:
    """-1 -> the latest step both trainer and orchestrator checkpointed; N -> N, which both must have."""
    if config.trainer.ckpt is None or config.trainer.ckpt.resume_step is None:
        return None
    step = resume_step_in(config.output_dir, config.trainer.ckpt.resume_step)
    config.trainer.ckpt.resume_step = config.orchestrator.ckpt.resume_step = step
    return step


def resume_step_in(out: Path, requested: int) -> int:
    """The step a run directory resumes from: its trainer and its orchestrator both checkpointed it."""
    from prime_rl.trainer.ckpt import complete_steps

    both = sorted(set(complete_steps(out)) & set(orchestrator_ckpt.saved_steps(out)))
    if requested == -1:
        if not both:
            fail(f"--ckpt.resume-step -1: no step has both a trainer and an orchestrator checkpoint in {out}")
        return both[-1]
    if requested not in both:
        fail(f"no complete trainer + orchestrator checkpoint for step {requested} in {out} (have {both})")
    return requested


def resolve_run_resumes(runs: dict[str, OrchestratorConfig]) -> None:
    """With `runs`: each run resumes from its own latest (or named) step; the trainer reads it from the run's
    config. A run that has never checkpointed starts fresh under `resume_step = -1`."""
    for name, orch in runs.items():
        if orch.ckpt is None or orch.ckpt.resume_step is None:
            continue
        fresh = orch.ckpt.resume_step == -1 and not orchestrator_ckpt.saved_steps(orch.output_dir)
        orch.ckpt.resume_step = None if fresh else resume_step_in(orch.output_dir, orch.ckpt.resume_step)
        logger.info(f"run {name}: " + ("starts fresh" if fresh else f"resumes from step {orch.ckpt.resume_step}"))


def clean_stale_outputs(output_dir: Path, resume_step: int | None) -> None:
    """Batches and weights of an earlier run would be consumed as if new: drop them (after the resumed step)."""
    for kind in ("rollouts", "broadcasts"):
        for path in (output_dir / kind).glob("step_*"):
            step = path.name.removeprefix("step_").split(".")[0]
            if resume_step is None or not step.isdigit() or int(step) > resume_step:
                shutil.rmtree(path, ignore_errors=True)
