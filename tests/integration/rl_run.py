"""What the integration tests that run `rl` share: its TOML (a tiny model, reverse-text, 8 rollouts a step of at most
12 tokens) and the pids it logs."""

import json
import re
import time
from pathlib import Path


def write_rl_config(path: Path, model: Path, out: Path, k: int, steps: int, top: str = "", bottom: str = "") -> Path:
    """`top` goes before the first table (top-level keys and whole tables), `bottom` after the orchestrator's."""
    path.write_text(
        f"""
output_dir = "{out}"
max_steps = {steps}
max_async_level = {k}
seq_len = 512
trainer_gpu_ids = [0]
{top}
[model]
name = "{model}"

[orchestrator]
batch_size = 8
rollouts_per_example = 4
workers = 1
weights_poll_interval = 0.2
[orchestrator.model]
renderer = {{ name = "qwen3", enable_thinking = false }}
[orchestrator.sampling]
max_tokens = 12
{bottom}
[trainer.optim]
lr = 1e-3
"""
    )
    return path


def started_pid(log: Path, name: str, timeout: float = 600) -> int:
    """The pid `rl` logged for the process `name` it started (waiting until it has)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""  # rl may not have started logging yet
        if m := re.search(rf"started {name} \(pid (\d+)\)", text):
            return int(m.group(1))
        time.sleep(0.2)
    raise TimeoutError(f"{name} never started:\n{log.read_text()[-3000:] if log.exists() else ''}")


def run_metrics(run_dir: Path, process: str) -> list[dict]:
    """`process`'s lines in the run's metrics.jsonl so far (a line still being written is not one yet)."""
    path = run_dir / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    lines = text[: text.rfind("\n") + 1].splitlines()
    return [m for m in map(json.loads, lines) if m["process"] == process]
