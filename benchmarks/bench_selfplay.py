"""Self-play on nim under `rae` and under `grpo` from one SFT start: win rates against fixed players over training.

    uv run python benchmarks/bench_selfplay.py --runs 2 --steps 100 --algos rae,grpo

The start: a tiny model (`benchmarks/configs/selfplay/model.toml`) fine-tuned (`sft.toml`) on nim games between two
uniformly random legal players, so it plays legal moves but no strategy; built once and cached under
`outputs/selfplay/` (delete it to rebuild). Each run is the real `rl @ benchmarks/configs/selfplay/rl.toml` (nim
self-play, both seats the policy) with `[orchestrator.algo] type` set to the algorithm; its online evals play the
policy against the env's scripted `random` and `optimal` players in each seat (four eval envs named
`<opponent>-<seat>`, taskset seed 1), so `eval/<name>/reward_mean` is a win rate. Runs alternate between the
algorithms and hold `--lock`. The table gives each rate with its standard error over the eval's games, beside the
rates of a uniformly random legal player and of the best possible one (exact, by recursion over the eval's piles;
against `optimal` the best wins exactly the piles its seat can win at all).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from functools import cache
from pathlib import Path

from nim import NimConfig, generate, rules, turn_message

from prime_rl.trainer.sft.data import write_examples
from prime_rl.utils.bench import hold_timing_lock

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CONFIGS = ROOT / "benchmarks" / "configs" / "selfplay"
CACHE = ROOT / "outputs" / "selfplay"
MAX_STICKS, MAX_TAKE = 12, 3
"""The nim taskset's defaults, which the SFT data and rl.toml both use."""
EVALS = [(opponent, seat) for opponent in ("random", "optimal") for seat in ("first", "second")]


def random_game_rows(num_games: int, seed: int) -> list[dict]:
    """SFT rows: games of two uniformly random legal players, one conversation per seat that moved, each written
    as the env speaks to that seat (the rules, then one user message per move) and answered with the bare number."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_games):
        left, last, turns = rng.randint(1, MAX_STICKS), None, {"first": [], "second": []}
        seat = "first"
        while left:
            take = rng.randint(1, min(MAX_TAKE, left))
            turns[seat].append((turn_message(left, MAX_TAKE, last), str(take)))
            left, last, seat = left - take, take, "second" if seat == "first" else "first"
        for moves in turns.values():
            if not moves:
                continue  # the first seat took the whole pile: the second never moved
            prompt = [{"role": "system", "content": rules(MAX_TAKE)}, {"role": "user", "content": moves[0][0]}]
            completion = [{"role": "assistant", "content": moves[0][1]}]
            for user, reply in moves[1:]:
                completion += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
            rows.append({"prompt": prompt, "completion": completion})
    return rows


def build_start() -> Path:
    """The SFT start, built once (model, data, `sft`) and reused while its weights directory exists."""
    sft = CONFIGS / "sft.toml"
    steps = next(
        int(line.split("=")[1].split("#")[0]) for line in sft.read_text().splitlines() if line.startswith("max_steps")
    )
    weights = CACHE / "sft" / "weights" / f"step_{steps}"
    if (weights / "config.json").exists():
        return weights
    write_examples(CACHE / "sft-data.jsonl", random_game_rows(3000, seed=0))
    for cmd in (["tiny-model", "@", str(CONFIGS / "model.toml")], ["sft", "@", str(sft)]):
        print("+", " ".join(cmd), flush=True)
        # Passive OpenMP waits: with busy-waiting threads `sft` ran 10-30x slower on a shared, loaded 2-core machine.
        env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
        subprocess.run([str(BIN / cmd[0]), *cmd[1:]], cwd=ROOT, env=env, check=True, capture_output=True)
    return weights


@cache
def policy_wins(left: int, policy: str, opponent: str) -> float:
    """P(the policy to move at `left` sticks wins) against the scripted `opponent` ("random"/"optimal"); `policy`
    "uniform" takes a uniformly random legal move, "best" the move that maximises this probability."""
    if left == 0:
        return 0.0  # the opponent took the last stick
    odds = [1.0 - scripted_wins(left - t, policy, opponent) for t in range(1, min(MAX_TAKE, left) + 1)]
    return max(odds) if policy == "best" else statistics.fmean(odds)


@cache
def scripted_wins(left: int, policy: str, opponent: str) -> float:
    """P(the scripted player to move at `left` wins) against `policy` (nim's `optimal_move`: the winning take when
    there is one, else a uniformly random legal move)."""
    if left == 0:
        return 0.0
    best = left % (MAX_TAKE + 1)
    takes = [best] if opponent == "optimal" and best else range(1, min(MAX_TAKE, left) + 1)
    return statistics.fmean(1.0 - policy_wins(left - t, policy, opponent) for t in takes)


def reference_rates(piles: list[int]) -> dict[str, dict[tuple[str, str], float]]:
    """Exact win rates over the eval's piles of a uniformly random legal player (what the SFT start imitates) and
    of the best possible player (against `optimal`: 1 from a winning position, 0 from a lost one)."""
    rates = {}
    for policy, name in (("uniform", "uniform random player (exact)"), ("best", "best possible (exact)")):
        rates[name] = {
            (opponent, seat): statistics.fmean(
                policy_wins(n, policy, opponent) if seat == "first" else 1.0 - scripted_wins(n, policy, opponent)
                for n in piles
            )
            for opponent, seat in EVALS
        }
    return rates


def run(algo: str, model: Path, steps: int, interval: int, tmp: Path) -> dict:
    """One `rl` run of `algo` from `model`: `read_run` of its output, and its wall time."""
    out = tmp / f"{algo}-{time.monotonic_ns()}"
    overlay = tmp / f"{algo}.toml"
    overlay.write_text(f'[orchestrator.algo]\ntype = "{algo}"\n')
    cmd = [str(BIN / "rl"), "@", str(CONFIGS / "rl.toml"), "@", str(overlay), "--model.name", str(model)]
    cmd += ["--max-steps", str(steps), "--output-dir", str(out), "--orchestrator.eval.interval", str(interval)]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    wall = time.monotonic() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{algo} exited with {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return read_run(out) | {"wall": wall}


def read_run(out: Path) -> dict:
    """A finished run's evals {step: {(opponent, seat): (win rate, games, forfeit rate)}} (from each pass's
    results.jsonl), its mean orchestrator step seconds and the first seat's training reward per step."""
    curve: dict[int, dict] = {}
    for step_dir in sorted((out / "evals").glob("step_*")):
        rows = [json.loads(line) for line in (step_dir / "results.jsonl").read_text().splitlines()]
        cells = {}
        for opponent, seat in EVALS:
            games = [r for r in rows if r.get("env") == f"{opponent}-{seat}"]
            wins = [r["reward"] for r in games]
            forfeits = [r["metrics"].get("forfeited", 0.0) for r in games]
            cells[opponent, seat] = (statistics.fmean(wins), len(wins), statistics.fmean(forfeits))
        curve[int(step_dir.name.split("_")[1])] = cells
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    orch = [m for m in metrics if m["process"] == "orchestrator" and "time/step" in m]
    train = [m for m in orch if "reward/nim/first/mean" in m]
    return {
        "curve": curve,
        "step_s": statistics.fmean(m["time/step"] for m in orch),
        "train_first": [round(m["reward/nim/first/mean"], 3) for m in train],
    }


def cell(rate: float, games: int) -> str:
    """A win rate with its binomial standard error over the games played."""
    return f"{rate:.2f} ± {math.sqrt(rate * (1 - rate) / games):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--eval-interval", type=int, default=20)
    parser.add_argument("--algos", default="rae,grpo", help="comma-separated `[orchestrator.algo] type`s")
    parser.add_argument("--lock", type=Path, default=Path("/tmp/bench.lock"))
    args = parser.parse_args()
    algos = [a.strip() for a in args.algos.split(",") if a.strip()]
    model = build_start()
    lock = hold_timing_lock(args.lock)  # noqa: F841 - held until the process ends
    results: dict[str, list[dict]] = {a: [] for a in algos}
    with tempfile.TemporaryDirectory(prefix="bench-selfplay-") as tmp:
        for i in range(args.runs):
            for algo in algos:
                r = run(algo, model, args.steps, args.eval_interval, Path(tmp))
                results[algo].append(r)
                curve = {step: {f"{o}-{s}": c for (o, s), c in cells.items()} for step, cells in r["curve"].items()}
                print(
                    f"{algo} run {i + 1}: wall {r['wall']:.0f} s, step {r['step_s']:.2f} s, evals (win rate, games, "
                    f"forfeits) {json.dumps(curve)}",
                    flush=True,
                )
    piles = generate(NimConfig(num_tasks=48, seed=1))
    header = [f"{s} vs {o}" for o, s in EVALS]
    print(f"\nwin rate ± standard error over the games ({args.steps} steps, evals of 48 piles x 2 games a seat)\n")
    print("| step | algo | " + " | ".join(header) + " | forfeits |")
    print("|---" * (3 + len(EVALS)) + "|")
    for name, rates in reference_rates(piles).items():
        print(f"| - | {name} | " + " | ".join(f"{rates[k]:.2f}" for k in EVALS) + " | 0 |")
    steps = sorted({s for rs in results.values() for r in rs for s in r["curve"]})
    for step in steps:
        for algo, rs in results.items():
            for i, r in enumerate(rs):
                cells = r["curve"].get(step)
                if cells is None:
                    continue
                label = algo if args.runs == 1 else f"{algo} run {i + 1}"
                games = sum(c[1] for c in cells.values())
                forfeits = sum(c[2] * c[1] for c in cells.values()) / games
                print(
                    f"| {step} | {label} | " + " | ".join(cell(*cells[k][:2]) for k in EVALS) + f" | {forfeits:.2f} |"
                )
    for algo, rs in results.items():
        for i, r in enumerate(rs):
            print(f"{algo} run {i + 1}: training reward of the first seat by step {r['train_first']}")


if __name__ == "__main__":
    main()
