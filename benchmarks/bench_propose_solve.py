"""Proposer-solver self-play on propose-solve under `hierarchical_grpo`: one logged group's advantages checked by
hand, and the solver success rate over training.

    uv run python benchmarks/bench_propose_solve.py --steps 300

The start: a tiny model (`benchmarks/configs/propose_solve/model.toml`) fine-tuned (`sft.toml`) on one-digit
additions, as proposals (`Problem: A + B` / `Answer: C` for the env's source prompt) and as solver answers, so it
writes valid problems and right answers only part of the time; built once and cached under `outputs/propose-solve/`
(delete it to rebuild). The run is the real `rl @ benchmarks/configs/propose_solve/rl.toml`: 2 episodes a source
task, 3 solvers a valid proposal, a batch of 8 rollouts, the samples table (`tables.jsonl`) every step, so a step
whose batch is one group with both proposals valid has that group logged whole. The script recomputes that group's
advantages from its rewards by the documented rule and prints the table beside the logged ones, then the training
solve rate (solvers' mean reward) and the share of valid proposals by step.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from propose_solve import solve_prompt, source_prompt

from prime_rl.trainer.sft.data import chat_example, write_examples

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CONFIGS = ROOT / "benchmarks" / "configs" / "propose_solve"
CACHE = ROOT / "outputs" / "propose-solve"
PROPOSE = re.compile(r"^Write an addition problem")
SOLVE = re.compile(r"What is (\d+ \+ \d+)\?")


def sft_rows(num: int, seed: int) -> list[dict]:
    """Half proposals for the source task of one-digit additions (a random valid problem and its sum), half
    solver attempts at a random one-digit addition (the sum)."""
    rng = random.Random(seed)
    rows = []
    for i in range(num):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        if i % 2 == 0:
            rows.append(chat_example(None, source_prompt("+", 1, 9), f"Problem: {a} + {b}\nAnswer: {a + b}"))
        else:
            rows.append(chat_example(None, solve_prompt(f"{a} + {b}"), str(a + b)))
    return rows


def build_start() -> Path:
    """The SFT start, built once (model, data, `sft`) and reused while its weights directory exists."""
    sft = CONFIGS / "sft.toml"
    steps = next(int(line.split("=")[1]) for line in sft.read_text().splitlines() if line.startswith("max_steps"))
    weights = CACHE / "sft" / "weights" / f"step_{steps}"
    if (weights / "config.json").exists():
        return weights
    write_examples(CACHE / "sft-data.jsonl", sft_rows(8000, seed=0))
    # Passive OpenMP waits: with busy-waiting threads `sft` ran 10-30x slower on a shared, loaded 2-core machine.
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    for cmd in (["tiny-model", "@", str(CONFIGS / "model.toml")], ["sft", "@", str(sft)]):
        print("+", " ".join(cmd), flush=True)
        subprocess.run([str(BIN / cmd[0]), *cmd[1:]], cwd=ROOT, env=env, check=True, capture_output=True)
    return weights


def hand_advantages(rows: list[dict]) -> list[float] | None:
    """hierarchical_grpo's rule, written out for one whole group of two episodes as the samples table lists it
    (each episode's proposer, then its 3 solvers): a solver is compared with the attempts in its episode, a proposer
    with the group's proposers. None when the rows are not that (8 rows, proposers at 0 and 4, each solver's problem
    its proposer's); the solvers of an invalid proposal have no prompt (nothing sampled) and reward 0."""
    if len(rows) != 8 or not all(PROPOSE.search(rows[i]["prompt"]) for i in (0, 4)):
        return None
    for start in (0, 4):
        proposed = re.search(r"Problem:\s*(\d+)\s*\+\s*(\d+)", rows[start]["completion"])
        for row in rows[start + 1 : start + 4]:
            asked = SOLVE.search(row["prompt"])
            if row["prompt"] and (asked is None or proposed is None or asked.group(1) != " + ".join(proposed.groups())):
                return None
    proposers = statistics.fmean(rows[i]["reward"] for i in (0, 4))
    hand = []
    for start in (0, 4):
        attempts = statistics.fmean(row["reward"] for row in rows[start + 1 : start + 4])
        hand += [rows[start]["reward"] - proposers] + [row["reward"] - attempts for row in rows[start + 1 : start + 4]]
    return hand


def read_run(out: Path) -> dict:
    """The first step whose logged samples are one whole group (with its rows and hand advantages), and per step
    the solvers' mean reward and the share of valid proposals."""
    checked, groups, worst = None, 0, 0.0
    for line in (out / "tables.jsonl").read_text().splitlines():
        table = json.loads(line)
        rows = [dict(zip(table["columns"], row, strict=True)) for row in table["rows"]]
        hand = hand_advantages(rows)
        if hand is None:
            continue
        groups += 1
        worst = max(worst, *(abs(row["advantage"] - h) for row, h in zip(rows, hand, strict=True)))
        # The group to show: the proposers' rewards differ and some solver's advantage is not 0 (both levels act).
        if checked is None and rows[0]["reward"] != rows[4]["reward"] and any(hand[i] for i in (1, 2, 3, 5, 6, 7)):
            checked = {"step": table["step"], "rows": rows, "hand": hand}
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    orch = [m for m in metrics if m["process"] == "orchestrator" and "reward/propose-solve/solver/mean" in m]
    solve = [m["reward/propose-solve/solver/mean"] for m in orch]
    valid = [m["metrics/valid_proposal"] for m in orch]
    rate = [m.get("metrics/solve_rate") for m in orch]
    return {"checked": checked, "groups": groups, "worst": worst, "solve": solve, "valid": valid, "rate": rate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--output-dir", type=Path, default=CACHE / "rl")
    parser.add_argument("--read-only", action="store_true", help="only read the run already in --output-dir")
    args = parser.parse_args()
    if not args.read_only:
        model = build_start()
        cmd = [str(BIN / "rl"), "@", str(CONFIGS / "rl.toml"), "--model.name", str(model)]
        cmd += ["--max-steps", str(args.steps), "--output-dir", str(args.output_dir)]
        start = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            sys.exit(f"rl exited with {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        print(f"rl: {args.steps} steps in {time.monotonic() - start:.0f} s ({args.output_dir})")
    run = read_run(args.output_dir)
    checked = run["checked"]
    if checked is None:
        print("no step logged one whole group of two valid proposals with differing rewards")
    else:
        print(f"\nstep {checked['step']}: one group, logged advantage against the rule by hand\n")
        print("| seat | prompt | completion | reward | advantage (logged) | by hand |")
        print("|---|---|---|---|---|---|")
        for row, hand in zip(checked["rows"], checked["hand"], strict=True):
            seat = "proposer" if PROPOSE.search(row["prompt"]) else "solver"
            asked = SOLVE.search(row["prompt"])
            prompt = "(source task)" if seat == "proposer" else asked.group(1) if asked else "(none: not run)"
            completion = row["completion"].replace("\n", " / ")
            print(f"| {seat} | {prompt} | {completion} | {row['reward']:.3f} | {row['advantage']:.4f} | {hand:.4f} |")
    print(f"\n{run['groups']} steps logged one whole group; largest |logged - by hand| over them: {run['worst']:.2e}")
    solve, valid, rate = run["solve"], run["valid"], run["rate"]
    print("\n| steps | valid proposals | solve rate on valid ones | solvers' mean reward (0 on invalid ones) |")
    print("|---|---|---|---|")
    width = max(1, len(solve) // 10)  # ten rows; a step has only ~2 episodes
    for i in range(0, len(solve), width):
        rates = [r for r in rate[i : i + width] if r is not None]
        on_valid = f"{statistics.fmean(rates):.3f}" if rates else "-"
        mean_valid, mean_solve = statistics.fmean(valid[i : i + width]), statistics.fmean(solve[i : i + width])
        print(f"| {i + 1}-{min(i + width, len(solve))} | {mean_valid:.3f} | {on_valid} | {mean_solve:.3f} |")


if __name__ == "__main__":
    main()
