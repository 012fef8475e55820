"""`rl --bench`: after a short real run, one table of the orchestrator's and trainer's metrics per step.

Both processes append their step metrics to `output_dir/metrics.jsonl`; the table joins them by step, so where a
step's time goes (waiting for weights, for the batch, training, publishing) reads off one line.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from prime_rl.utils.bench import Column, format_bench_table

BENCH_COLUMNS = [
    Column("step", "step", "d"),
    Column("orch s", "orchestrator_seconds", ".2f", summary=True),
    Column("rollouts/s", "rollouts_per_s", ".1f", summary=True),
    Column("inf tok/s", "inference_tokens_per_s", ".0f", summary=True),
    Column("weights wait s", "wait_for_weights", ".2f"),
    Column("swap s", "update_weights", ".3f"),
    Column("trainer s", "trainer_seconds", ".2f", summary=True),
    Column("batch wait s", "wait_for_batch", ".2f"),
    Column("train s", "train_seconds", ".2f"),
    Column("publish s", "publish_seconds", ".2f"),
    Column("taken wait s", "wait_for_taken", ".2f"),
    Column("train tok/s", "train_tokens_per_s", ".0f", summary=True),
    Column("MFU %", "mfu", ".2f", summary=True),
    Column("peak GiB", "peak_memory_gib", ".2f"),
]
"""Orchestrator: step time (of which waiting for weights and swapping them), rollouts and tokens (prompt +
completion) per second through inference. Trainer: step time = waiting for the batch + training + publishing +
waiting for the orchestrator to take an in-memory policy, trained tokens per second, MFU (`-` without a known GPU
peak), peak memory."""


def bench_rows(lines: Iterable[str]) -> list[dict]:
    """`metrics.jsonl` lines -> one row per step with the orchestrator's and the trainer's metrics of that step side
    by side (`BENCH_COLUMNS`' keys; None where a process did not log the step; a step logged twice keeps its later
    line). The trainer logs tokens/s and MFU over a window of recent steps; the row has this step's own: tokens /
    training time, and MFU scaled by the same ratio (MFU is proportional to tokens/s)."""
    logged: dict[str, dict[int, dict]] = {"orchestrator": {}, "trainer": {}}
    for line in lines:
        if line.strip():
            metrics = json.loads(line)
            if metrics.get("process") in logged:
                logged[metrics["process"]][int(metrics["step"])] = metrics
    rows = []
    for step in sorted(logged["orchestrator"].keys() | logged["trainer"].keys()):
        orch, trainer = logged["orchestrator"].get(step, {}), logged["trainer"].get(step, {})
        times = [trainer.get(k) for k in ("time_data", "time_train", "time_publish")]
        tokens_per_s = mfu = None
        if trainer.get("tokens") is not None and trainer.get("time_train"):
            tokens_per_s = trainer["tokens"] / trainer["time_train"]
            if trainer.get("mfu") is not None and trainer.get("tokens_per_s"):
                mfu = trainer["mfu"] * tokens_per_s / trainer["tokens_per_s"]
        rows.append(
            {
                "step": step,
                "orchestrator_seconds": orch.get("time/step"),
                "rollouts_per_s": orch.get("rollouts_per_s"),
                "inference_tokens_per_s": orch.get("tokens_per_s"),
                "wait_for_weights": orch.get("time/wait_for_weights"),
                "update_weights": orch.get("time/update_weights"),
                "trainer_seconds": None if None in times else sum(times) + trainer.get("time_wait_taken", 0.0),
                "wait_for_batch": times[0],
                "train_seconds": times[1],
                "publish_seconds": times[2],
                "wait_for_taken": trainer.get("time_wait_taken"),
                "train_tokens_per_s": tokens_per_s,
                "mfu": mfu,
                "peak_memory_gib": trainer.get("peak_memory_gib"),
            }
        )
    return rows


def bench_table(lines: Iterable[str]) -> str:
    return format_bench_table(bench_rows(lines), BENCH_COLUMNS)


def metrics_size(output_dir: Path) -> int:
    """Bytes in `metrics.jsonl` now: this run's lines are the ones after them (the file keeps earlier runs')."""
    path = output_dir / "metrics.jsonl"
    return path.stat().st_size if path.exists() else 0


def print_bench_table(output_dir: Path, start: int) -> None:
    with open(output_dir / "metrics.jsonl") as f:
        f.seek(start)
        print(bench_table(f.read().splitlines()), flush=True)
