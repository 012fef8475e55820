"""The demo's RL stage while strangers attack the trainer's weight-broadcast store (issue 52): step times with no
attack and under each attack, back to back, on the same machine.

Each run is `rl @ <config> --max-steps N` with the store on a fixed port; an attack is one or more processes of
`tests/unit/store_attacker.py` (no run secret) started with `rl` and stopped when it exits: a reconnect flood (64
threads connecting and closing as fast as they can), a slow trickle (64 connections sending one byte every 2 s), or
both. Before the fix a trickle or a 64-thread flood held every handshake slot: every broadcast answered 502 and no
step was made for 240 s. Prints, per run: wall time, steady s/step, the longest gap between two steps, the reward
of the last steps and how many times the trainer's log reported the attack.

    uv run python benchmarks/bench_rl_under_attack.py [--steps 30] [--runs 1] [--attacks none both]

Needs the demo's SFT weights (`bash configs/reverse_text/run.sh` once).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_vs_trl import StepWatcher  # noqa: E402

from prime_rl.utils.net import free_port  # noqa: E402

RL = str(Path(sys.executable).parent / "rl")
ATTACKER = ROOT / "tests" / "unit" / "store_attacker.py"
ATTACKS = {
    "none": [],
    "flood": [["flood", "--threads", "64", "--keep", "0"]],
    "trickle": [["trickle", "--connections", "64", "--every", "2"]],
    "both": [["flood", "--threads", "64", "--keep", "0"], ["trickle", "--connections", "64", "--every", "2"]],
}


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def one_run(config: str, out: Path, steps: int, attack: str, skip: int) -> dict:
    port = free_port()
    log = out.with_suffix(".log")
    args = [RL, "@", config, "--max-steps", str(steps), "--output-dir", str(out)]
    args += ["--weight-broadcast.port", str(port)]
    out.parent.mkdir(parents=True, exist_ok=True)
    launch = time.time()
    rl = subprocess.Popen(args, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=ROOT)
    while rl.poll() is None and not listening(port):  # a trickle opened against a closed port is just refused
        time.sleep(0.1)
    attackers = [
        subprocess.Popen(
            [sys.executable, str(ATTACKER), a[0], "127.0.0.1", str(port), "--seconds", "3600", *a[1:]],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for a in ATTACKS[attack]
    ]
    watcher = StepWatcher(out / "metrics.jsonl")
    try:
        while rl.poll() is None:
            watcher.poll()
            time.sleep(0.1)
        watcher.poll()
    finally:
        for a in attackers:
            a.terminate()
        summaries = [a.communicate(timeout=30)[0].strip().splitlines()[-1:] for a in attackers]
    exit_ = time.time()
    ends = watcher.ends
    done = sorted(ends)
    gaps = [ends[b] - ends[a] for a, b in zip(done, done[1:], strict=False)]
    first = min(skip, max(done) - 1) if done else 0
    steady = (ends[max(done)] - ends[first]) / (max(done) - first) if len(done) > 1 else float("nan")
    rewards = [
        row["reward/mean"]
        for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
        if row.get("process") == "orchestrator" and "reward/mean" in row
    ]
    trainer_log = (out / "logs" / "trainer.log").read_text(errors="replace") if (out / "logs").exists() else ""
    return {
        "attack": attack,
        "exit": rl.returncode,
        "steps": len(done),
        "wall_s": exit_ - launch,
        "step_s": steady,
        "max_gap_s": max(gaps, default=float("nan")),
        "reward_last5": statistics.mean(rewards[-5:]) if rewards else float("nan"),
        "attack_log_lines": trainer_log.count("did not authenticate"),
        "attacker": [s[0] if s else "" for s in summaries],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/reverse_text/rl.toml")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--runs", type=int, default=1, help="runs of each attack, interleaved")
    parser.add_argument("--attacks", nargs="+", default=["none", "both"], choices=sorted(ATTACKS))
    parser.add_argument("--skip", type=int, default=5, help="steps left out of the steady state")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench-rl-under-attack")
    args = parser.parse_args()
    rows = []
    for i in range(args.runs):
        for attack in args.attacks:
            row = one_run(args.config, args.out / f"{attack}-{i}", args.steps, attack, args.skip)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(
        f"\n{'attack':8} {'exit':>4} {'steps':>5} {'wall s':>7} {'s/step':>7} {'max gap s':>9} {'reward':>7} {'logged':>6}"
    )
    for r in rows:
        print(
            f"{r['attack']:8} {r['exit']:>4} {r['steps']:>5} {r['wall_s']:>7.1f} {r['step_s']:>7.3f} "
            f"{r['max_gap_s']:>9.2f} {r['reward_last5']:>7.3f} {r['attack_log_lines']:>6}"
        )


if __name__ == "__main__":
    main()
