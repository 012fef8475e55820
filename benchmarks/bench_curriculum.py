"""A difficulty-pool curriculum against the standard sampler on the demo's RL stage: held-out reward and pool sizes.

    uv run python benchmarks/bench_curriculum.py --runs 5 --steps 40 --tasks 64 [--arms standard,pool,pool95]

Each run is the real `rl @ configs/reverse_text/rl.toml` from the demo's SFT weights (`bash configs/reverse_text/run.sh`
makes them) for `--steps` steps, with online evals every `--eval-interval` steps on `--eval-tasks` held-out tasks
(taskset seed 1) x 2. Every arm trains on the first `--tasks` tasks of seed 0: the demo's 1000 are more than its 8
groups a step ever draw twice, so every task would stay `unseen` and the pools could change nothing; with a few dozen
tasks each one comes back every few steps and its pool decides how often. `standard` draws uniformly, `pool` uses
the default `difficulty_pool` sampler (docs/algorithms.md, "Curricula"), `pool95` the same with `normal` up to 0.95.
Run i of every arm uses buffer seed i; arms alternate; the timing lock (`--lock`) keeps other benchmarks from timing
while this one loads the cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from prime_rl.utils.bench import hold_timing_lock
from prime_rl.utils.net import free_port

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SFT = ROOT / "outputs" / "reverse-text" / "sft" / "weights" / "step_450"
ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"  # the demo's (configs/reverse_text/rl.toml)
SAMPLERS = {
    "standard": '{ type = "standard" }',
    "pool": '{ type = "difficulty_pool" }',
    # The default pools but `normal` up to 0.95: from the demo's SFT start most groups pass 0.75 within ~15 steps,
    # after which every task is `easy` and the default draw is uniform again; 0.95 keeps a task favoured until its
    # groups are (nearly) all exact.
    "pool95": '{ type = "difficulty_pool", pools = { hard = { threshold = 0.25, weight = 0.2 }, '
    "normal = { threshold = 0.95, weight = 1.0 }, easy = { threshold = 1.0, weight = 0.2 } } }",
}
OVERLAY = """[orchestrator.buffer]
seed = {seed}
sampler = {sampler}

[[orchestrator.env]]
id = "reverse-text"
args = {{ alphabet = "{alphabet}", num_tasks = {tasks} }}

[[orchestrator.eval.env]]
id = "reverse-text"
args = {{ seed = 1, alphabet = "{alphabet}" }}
num_examples = {eval_tasks}
rollouts_per_example = 2
"""
POOL = "curriculum/reverse-text/pool/"


def run(arm: str, seed: int, args: argparse.Namespace, tmp: Path) -> dict:
    """One `rl` run of `arm`: its held-out curve {step: avg@2}, pool sizes {step: {pool: tasks}} (pool arms only),
    mean training reward of the last 5 steps, mean step seconds and wall seconds."""
    out = tmp / f"{arm}-{seed}-{time.monotonic_ns()}"
    overlay = tmp / f"{arm}-{seed}.toml"
    overlay.write_text(
        OVERLAY.format(
            seed=seed, sampler=SAMPLERS[arm], alphabet=ALPHABET, tasks=args.tasks, eval_tasks=args.eval_tasks
        )
    )
    cmd = [str(BIN / "rl"), "@", str(ROOT / "configs" / "reverse_text" / "rl.toml"), "@", str(overlay)]
    cmd += ["--model.name", str(args.model), "--max-steps", str(args.steps), "--output-dir", str(out)]
    cmd += ["--orchestrator.eval.interval", str(args.eval_interval)]
    cmd += ["--inference.server.port", str(free_port())]  # not 8000: a server of someone else's there would answer
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    wall = time.monotonic() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{arm} exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    curve = {m["step"]: v for m in rows for k, v in m.items() if k.startswith("eval/") and k.endswith("/avg@2")}
    orch = [m for m in rows if m["process"] == "orchestrator" and "time/step" in m]
    pools = {m["step"]: {k[len(POOL) :]: int(v) for k, v in m.items() if k.startswith(POOL)} for m in orch}
    return {
        "curve": curve,
        "pools": {s: p for s, p in pools.items() if p},
        "train_reward": statistics.fmean(m["reward/mean"] for m in orch[-5:]),
        "step_s": statistics.fmean(m["time/step"] for m in orch),
        "wall": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--arms", default="standard,pool", help=f"comma-separated, of {', '.join(SAMPLERS)}")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--tasks", type=int, default=64, help="training tasks (taskset seed 0)")
    parser.add_argument("--eval-interval", type=int, default=5)
    parser.add_argument("--eval-tasks", type=int, default=64, help="held-out tasks (taskset seed 1), 2 rollouts each")
    parser.add_argument("--model", type=Path, default=SFT)
    parser.add_argument("--lock", type=Path, default=Path("/tmp/bench.lock"))
    args = parser.parse_args()
    if not (args.model / "config.json").exists():
        sys.exit(f"{args.model}: not a model directory (build the demo's with `bash configs/reverse_text/run.sh`)")
    lock = hold_timing_lock(args.lock)  # noqa: F841 - held until the process ends
    results: dict[str, list[dict]] = {arm: [] for arm in args.arms.split(",")}
    with tempfile.TemporaryDirectory(prefix="bench-curriculum-") as tmp:
        for i in range(args.runs):
            for arm in results:
                r = run(arm, i, args, Path(tmp))
                results[arm].append(r)
                print(f"{arm} run {i + 1}: {json.dumps(r)}", flush=True)
    report(results, args)


def report(results: dict[str, list[dict]], args: argparse.Namespace) -> None:
    """Markdown tables: held-out reward per eval step (each run and each arm's mean; then mean and range), and the pool
    arms' mean pool sizes."""
    runs = [(arm, i, r) for arm, rs in results.items() for i, r in enumerate(rs)]
    print(f"\nheld-out reward (avg@2, {args.eval_tasks} tasks) against steps, {args.tasks} training tasks\n")
    print("| step | " + " | ".join(f"{a} {i + 1}" for a, i, _ in runs) + " | " + " | ".join(results) + " |")
    print("|---" * (1 + len(runs) + len(results)) + "|")
    for step in sorted(runs[0][2]["curve"]):
        cells = [f"{r['curve'][step]:.3f}" for _, _, r in runs]
        means = [f"{statistics.fmean(r['curve'][step] for r in rs):.3f}" for rs in results.values()]
        print(f"| {step} | " + " | ".join(cells + means) + " |")
    print("\nthe same, each arm's mean (lowest-highest run)\n")
    print("| step | " + " | ".join(results) + " |")
    print("|---" * (1 + len(results)) + "|")
    for step in sorted(runs[0][2]["curve"]):
        spans = [[r["curve"][step] for r in rs] for rs in results.values()]
        print(
            f"| {step} | " + " | ".join(f"{statistics.fmean(v):.3f} ({min(v):.2f}-{max(v):.2f})" for v in spans) + " |"
        )
    pooled = {arm: rs for arm, rs in results.items() if rs[0]["pools"]}
    if pooled:
        names = list(next(iter(pooled.values()))[0]["pools"][args.eval_interval])
        print("\npool sizes (" + " / ".join(names) + "), each the mean over the arm's runs\n")
        print("| step | " + " | ".join(pooled) + " |")
        print("|---" * (1 + len(pooled)) + "|")
        for step in range(args.eval_interval, args.steps + 1, args.eval_interval):
            cells = [
                " / ".join(f"{statistics.fmean(r['pools'][step][n] for r in rs):.0f}" for n in names)
                for rs in pooled.values()
            ]
            print(f"| {step} | " + " | ".join(cells) + " |")
    for arm, rs in results.items():
        train = ", ".join(f"{r['train_reward']:.3f}" for r in rs)
        walls = ", ".join(f"{r['wall']:.0f}" for r in rs)
        step_s = statistics.fmean(r["step_s"] for r in rs)
        print(f"{arm}: training reward (last 5 steps) {train}; wall {walls} s; step {step_s:.2f} s")


if __name__ == "__main__":
    main()
