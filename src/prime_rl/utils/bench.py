"""The `--bench` table of the trainer, the orchestrator and `rl`: one row per step, then mean ± std of the chosen
columns over the steps after the first (the first includes warm-up: compilation, allocator, connection pools).

Pure and dependency-free, so the trainer's import path stays torch + transformers only.
"""

import math
import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Column:
    header: str
    key: str
    """Key of the row dict; a missing, None or NaN value is shown as `-` and left out of the summary."""
    spec: str = ".3f"
    """Format spec of a cell."""
    scale: float = 1.0
    """Shown value = row value x scale (e.g. 100 for a fraction shown in percent)."""
    summary: bool = False
    """Also report mean ± std over the steps after the first (in the cells' format)."""

    def __post_init__(self) -> None:
        if self.summary and self.spec.endswith("d"):
            raise ValueError(f"column {self.header!r}: a mean is not an integer; give a summary column a float spec")


def _value(row: dict, column: Column) -> float | None:
    value = row.get(column.key)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return value if column.scale == 1 else value * column.scale  # an int stays an int (`d` cells)


def _mean_std(values: list[float], spec: str) -> str:
    """Mean ± sample standard deviation, both written like the column's cells."""
    if not values:
        return "-"
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{format(statistics.fmean(values), spec)} ± {format(std, spec)}"


def format_bench_table(rows: list[dict], columns: list[Column]) -> str:
    """Right-aligned plain-text table of `rows` (one per step, in order), then a summary line over `rows[1:]`."""
    header = [c.header for c in columns]
    cells = [[("-" if (v := _value(row, c)) is None else format(v, c.spec)) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in [header, *cells]) for i in range(len(columns))]
    text = ["  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)) for line in [header, *cells]]
    measured = rows[1:]
    if not measured:
        text.append("summary: no steps after the warm-up step")
        return "\n".join(text)
    parts = []
    for column in columns:
        if column.summary:
            values = [v for row in measured if (v := _value(row, column)) is not None]
            parts.append(f"{column.header} {_mean_std(values, column.spec)}")
    text.append(f"summary over {len(measured)} steps after the first: " + ", ".join(parts))
    return "\n".join(text)


def hold_timing_lock(path):
    """The exclusive lock every CPU-timing benchmark under `benchmarks/` takes (default /tmp/bench.lock), so timings
    on a shared machine never overlap; waits, saying so, while another holds it. Held until the file is closed."""
    import fcntl

    lock = open(path, "a")  # noqa: SIM115 - held for the benchmark's length
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"waiting for {path} (another benchmark is timing)", flush=True)
        fcntl.flock(lock, fcntl.LOCK_EX)
    return lock
