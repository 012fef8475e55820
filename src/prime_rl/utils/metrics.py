"""`{output_dir}/metrics.jsonl`: every logged metric of every process, one JSON object per line."""

import json
from pathlib import Path

Metrics = dict[str, dict[int, dict]]
"""process -> step -> that step's metrics."""


def append_metrics(output_dir: Path, process: str, step: int, metrics: dict) -> None:
    """One line per (process, step); short appends from several processes do not interleave."""
    with open(Path(output_dir) / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"process": process, "step": step, **metrics}) + "\n")


def load_metrics(path: Path) -> Metrics:
    """Read `metrics.jsonl`; when a step was logged twice (a resumed run repeats steps), the later value wins."""
    data: Metrics = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            process, step = row.pop("process"), int(row.pop("step"))
        except (ValueError, KeyError) as e:
            raise ValueError(f"{path}:{n}: not a metrics line ({e})") from None
        data.setdefault(process, {}).setdefault(step, {}).update(row)  # one step may span several lines
    return data


def series(data: Metrics, process: str, key: str) -> tuple[list[int], list[float]]:
    """One metric of one process, in step order: (steps, values), skipping steps that did not log it."""
    steps = sorted(data.get(process, {}))
    points = [(s, data[process][s].get(key)) for s in steps]
    points = [(s, float(v)) for s, v in points if isinstance(v, int | float) and not isinstance(v, bool)]
    return [s for s, _ in points], [v for _, v in points]
