"""`synthesize` entry point: rollouts of a model on environments, written as an SFT dataset `sft` reads as is.

    uv run synthesize @ cfg.toml [--min-reward 1.0]

Each kept rollout is one JSONL row: `prompt` (the messages before the model's first turn), `completion` (the
model's turns and everything the environment said in between, so multi-turn conversations stay whole), `tools`
(when the environment offered any), `reward`, `metrics`, `env`, `example_id`. Rollouts that failed, and with
`min_reward` those below it, are left out. Writes `{output_dir}/data.jsonl` atomically (a crash leaves the old
file or none) and `{output_dir}/synthesize_summary.json`.
"""

from __future__ import annotations

import json
import statistics
import sys

from loguru import logger

from prime_rl.config.loader import load_config, write_resolved_config
from prime_rl.eval.config import SynthesizeConfig
from prime_rl.eval.rollouts import Job, plan_jobs, rollout_worker, run_jobs, serve_and_run
from prime_rl.orchestrator.messages import RolloutResult
from prime_rl.utils.fs import write_atomic
from prime_rl.utils.logging import setup_logging
from prime_rl.utils.secret import take_keys_at_start


def sft_row(job: Job, result: RolloutResult) -> dict:
    """A rollout as a prompt/completion chat example."""
    messages = result.messages or []
    first_reply = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
    row = {"prompt": messages[:first_reply], "completion": messages[first_reply:]}
    if result.tools:
        row["tools"] = result.tools
    return row | {"reward": result.reward, "metrics": result.metrics, "env": job.env, "example_id": job.example_id}


def keep(result: RolloutResult, min_reward: float | None) -> str | None:
    """Why a rollout is left out (None: kept)."""
    if result.error is not None:
        return "error"
    if not result.messages or not any(m.get("role") == "assistant" for m in result.messages):
        return "no reply"
    if min_reward is not None and result.reward < min_reward:
        return "below min_reward"
    return None


async def synthesize(config: SynthesizeConfig, jobs: list[Job]) -> dict:
    out = config.output_dir
    out.mkdir(parents=True, exist_ok=True)
    target, tmp = out / "data.jsonl", out / "data.jsonl.tmp"
    counts = {"rollouts": 0, "kept": 0, "error": 0, "no reply": 0, "below min_reward": 0}
    kept_rewards: list[float] = []
    with open(tmp, "w") as f:

        def on_rollout(job: Job, result: RolloutResult) -> None:
            counts["rollouts"] += 1
            reason = keep(result, config.min_reward)
            if reason is not None:
                counts[reason] += 1
                return
            counts["kept"] += 1
            kept_rewards.append(result.reward)
            f.write(json.dumps(sft_row(job, result)) + "\n")

        async with rollout_worker(config, keep_messages=True) as worker:
            seconds = await run_jobs(worker, jobs, config, "synthesize", on_rollout)
    tmp.replace(target)
    summary = {**counts, "kept_reward_mean": statistics.fmean(kept_rewards) if kept_rewards else None}
    summary["seconds"] = round(seconds, 3)
    write_atomic(out / "synthesize_summary.json", json.dumps(summary, indent=2).encode())
    return summary


def main(argv: list[str] | None = None) -> None:
    take_keys_at_start("synthesize")  # no run secret reaches the environments this process runs (`utils.secret`)
    config, _ = load_config(SynthesizeConfig, "synthesize", argv)
    setup_logging("synthesize", config.log.level, config.output_dir / "logs", file_name=config.log.file)
    write_resolved_config(config, "synthesize")
    # The environments load while the server starts; a bad one stops it again (exit 2).
    summary = serve_and_run("synthesize", config, [], lambda: plan_jobs(config), lambda jobs: synthesize(config, jobs))
    mean = summary["kept_reward_mean"]
    logger.info(
        f"kept {summary['kept']} of {summary['rollouts']} rollouts (errors {summary['error']}, below min_reward "
        f"{summary['below min_reward']}, no reply {summary['no reply']}); kept reward mean "
        f"{'n/a' if mean is None else f'{mean:.3f}'} -> {config.output_dir / 'data.jsonl'}"
    )
    if summary["kept"] == 0:
        sys.exit(1)
