"""`{output_dir}/metrics.jsonl`: every logged metric of every process, one JSON object per line."""

import json
from pathlib import Path


def append_metrics(output_dir: Path, process: str, step: int, metrics: dict) -> None:
    """One line per (process, step); short appends from several processes do not interleave."""
    with open(Path(output_dir) / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"process": process, "step": step, **metrics}) + "\n")
