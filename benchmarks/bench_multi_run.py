"""Several runs in one trainer vs the same runs one after the other: wall time and each run's rewards.

    uv run python benchmarks/bench_multi_run.py            # configs/reverse_text/multi_run/rl.toml (needs run.sh's SFT)
    uv run python benchmarks/bench_multi_run.py --config my_runs.toml --out outputs/bench-multi-run

Runs `rl @ config` once with all its `[[runs]]` (one trainer, one vLLM server, one orchestrator per run), then once
per run with that run alone (`--runs '[<it>]'`), each `rl` from scratch into its own output dir. Prints one table:
per launch its wall time, the part spent starting vLLM (rl's "waiting for inference" to "inference is healthy"),
the rest, and per run its training reward (mean of the orchestrator's `reward/mean` over the first and the last
three steps), then the sum of the one-after-the-other launches.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from prime_rl.config.loader import load_config
from prime_rl.rl import RLConfig
from prime_rl.utils.bench import Column, format_bench_table
from prime_rl.utils.metrics import load_metrics, series

RL = str(Path(sys.executable).parent / "rl")
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) \|")

COLUMNS = [
    Column("launch", "launch", "s"),
    Column("runs", "runs", "s"),
    Column("wall s", "wall", ".0f"),
    Column("vLLM start s", "server_start", ".0f"),
    Column("rest s", "rest", ".0f"),
    Column("run", "run", "s"),
    Column("reward first 3", "reward_first", ".3f"),
    Column("reward last 3", "reward_last", ".3f"),
]


def logged_at(log: Path, needle: str) -> datetime | None:
    for line in log.read_text(errors="replace").splitlines():
        if needle in line and (m := STAMP.match(line)):
            return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S.%f")
    return None


def rewards(run_dir: Path) -> tuple[float, float]:
    """Mean train reward of the first three and of the last three steps."""
    _, values = series(load_metrics(run_dir / "metrics.jsonl"), "orchestrator", "reward/mean")
    return sum(values[:3]) / len(values[:3]), sum(values[-3:]) / len(values[-3:])


def launch(config: Path, out: Path, runs: list[dict] | None, flags: list[str] = ()) -> dict:
    """One `rl` from scratch into `out` (with `runs`: only those; `flags`: more CLI flags); its times."""
    args = [RL, "@", str(config), "--output-dir", str(out), *flags]
    if runs is not None:
        args += ["--runs", json.dumps(runs)]
    start = time.perf_counter()
    done = subprocess.run(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"{' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    log = out / "logs" / "rl.log"
    waiting, healthy = logged_at(log, "waiting for inference"), logged_at(log, "inference is healthy")
    server = (healthy - waiting).total_seconds() if waiting and healthy else float("nan")
    return {"wall": wall, "server_start": server, "rest": wall - server}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path("configs/reverse_text/multi_run/rl.toml"))
    parser.add_argument("--out", type=Path, default=Path("outputs/bench-multi-run"))
    args = parser.parse_args()
    config, _ = load_config(RLConfig, "rl", ["@", str(args.config)])
    specs = [run.model_dump(mode="json", exclude_defaults=True) for run in config.runs]
    if len(specs) < 2:
        sys.exit(f"{args.config}: needs at least two [[runs]] to compare")

    launches = [("together", None, args.out / "together")]
    launches += [(f"alone {s['name']}", [s], args.out / f"alone-{s['name']}") for s in specs]
    rows, sequential = [], 0.0
    for label, runs, out in launches:
        print(f"{label}: rl @ {args.config} --output-dir {out}", flush=True)
        times = launch(args.config, out, runs)
        if runs is not None:
            sequential += times["wall"]
        names = [s["name"] for s in (runs or specs)]
        for i, name in enumerate(names):
            first, last = rewards(out / f"run_{name}")
            row = {"launch": label if i == 0 else "", "runs": str(len(names)) if i == 0 else "", "run": name}
            rows.append(row | (times if i == 0 else {}) | {"reward_first": first, "reward_last": last})
    print("\n".join(format_bench_table(rows, COLUMNS).splitlines()[:-1]))  # no per-step summary line
    together = rows[0]["wall"]
    print(f"together {together:.0f} s; one after the other {sequential:.0f} s ({sequential / together:.2f}x)")


if __name__ == "__main__":
    main()
