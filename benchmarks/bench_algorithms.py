"""Advantage estimators and policy losses side by side on reverse-text: held-out reward and wall time per choice.

    uv run python benchmarks/bench_algorithms.py                      # every variant below (needs run.sh's SFT)
    uv run python benchmarks/bench_algorithms.py --variants grpo,rloo --out outputs/bench-algorithms [--reuse]

Each variant is one `rl @ configs/reverse_text/rl.toml` from the same SFT weights with the same settings (steps,
batch, task seed 0, trainer seed, learning rate) and one or two keys changed; each runs from scratch into its own
output dir, one after the other. Then one `eval` (a single vLLM server, `/update_weights` between policies) scores
the SFT policy and every variant's last policy on the demo's 200 held-out tasks (taskset seed 1, 2 rollouts each).
Prints per variant: the keys it sets, held-out reward (mean ± std over rollouts), training reward (orchestrator's
`reward/mean`, mean of the last three steps), the trainer's mean step time (forward, backward and optimizer, after
step 1), the `rl` wall time and that time without vLLM's start. `--reuse` keeps the variants already run into `--out`
(their times are saved beside them) and runs only the others, and keeps an earlier evaluation of the same policies.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import tomli_w
from bench_multi_run import launch

from prime_rl.utils.bench import Column, format_bench_table
from prime_rl.utils.metrics import load_metrics, series

EVAL = str(Path(sys.executable).parent / "eval")

VARIANTS: dict[str, list[str]] = {
    "grpo": [],  # the demo's own settings: group-mean baseline (Dr. GRPO), truncated-IS REINFORCE loss (aipo)
    "grpo-std-clip": ["--orchestrator.advantage.std-normalize", "--trainer.loss.objective", "grpo"],
    "rloo": ["--orchestrator.advantage.estimator", "rloo"],
    "gspo": ["--trainer.loss.objective", "gspo"],
    "cispo": ["--trainer.loss.objective", "cispo"],
    "reinforce-pp": ["--orchestrator.advantage.estimator", "reinforce_pp"],
    "gpg": ["--orchestrator.advantage.estimator", "gpg"],
    "reinforce": ["--orchestrator.advantage.estimator", "reinforce"],
    # The critic gets the policy's learning rate (its default, 1e-5, suits pretrained models, not 30 steps of this one).
    "ppo-critic": ["--trainer.critic.optim.lr", "1e-3", "--trainer.loss.objective", "grpo"],
    "grpo-ref-kl": ["--trainer.reference.beta", "0.05"],
    # Rewards are LCS ratios, so a group rarely scores exactly the same: "not varying" means a std of at most 0.05.
    "grpo-temp-scaling": ["--orchestrator.sampling.temperature-scaling.std-threshold", "0.05"],
}
"""Name -> the `rl` flags that make the variant (on top of configs/reverse_text/rl.toml)."""

COLUMNS = [
    Column("variant", "variant", "s"),
    Column("flags", "flags", "s"),
    Column("held-out reward", "heldout", "s"),
    Column("train reward last 3", "train_last", ".3f"),
    Column("trainer s/step", "step_s", ".2f"),
    Column("rl wall s", "wall", ".0f"),
    Column("without vLLM start s", "rest", ".0f"),
]


def train_reward_last3(run_dir: Path) -> float:
    _, rewards = series(load_metrics(run_dir / "metrics.jsonl"), "orchestrator", "reward/mean")
    return sum(rewards[-3:]) / len(rewards[-3:])


def evaluate(eval_config: Path, out: Path, policies: dict[str, Path], port: int) -> dict[str, dict]:
    """One `eval` of `policies` (label -> weights dir) plus the SFT policy it serves; label -> reward summary."""
    config = tomllib.loads(eval_config.read_text()) | {"weights": {label: str(p) for label, p in policies.items()}}
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench-eval.toml").write_text(tomli_w.dumps(config))  # the CLI would merge into eval.toml's [weights]
    args = [EVAL, "@", str(out / "bench-eval.toml"), "--output-dir", str(out), "--inference.server.port", str(port)]
    done = subprocess.run(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {p["label"]: next(iter(p["envs"].values())) for p in summary["policies"]}


def previous_scores(summary: Path, policies: dict[str, Path]) -> dict[str, dict] | None:
    """The scores of an earlier `eval` in `--out` if it evaluated exactly these policies (else None: evaluate)."""
    previous = {p["label"]: p for p in json.loads(summary.read_text())["policies"]}
    if set(policies) - set(previous):
        return None
    print(f"reusing the evaluation in {summary.parent}", flush=True)
    return {label: next(iter(previous[label]["envs"].values())) for label in policies}


def trainer_seconds_per_step(run_dir: Path) -> float:
    """Mean `time_train` after the first step (which also pays for warming up): the algorithm's compute."""
    steps, times = series(load_metrics(run_dir / "metrics.jsonl"), "trainer", "time_train")
    after_first = [t for step, t in zip(steps, times, strict=True) if step > 1]
    return sum(after_first) / len(after_first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path("configs/reverse_text/rl.toml"))
    parser.add_argument("--eval-config", type=Path, default=Path("configs/reverse_text/eval.toml"))
    parser.add_argument("--sft", type=Path, default=Path("outputs/reverse-text/sft/weights/step_450"))
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names from VARIANTS")
    parser.add_argument("--out", type=Path, default=Path("outputs/bench-algorithms"))
    parser.add_argument("--reuse", action="store_true", help="keep variants already run into --out (and their times)")
    parser.add_argument("--port", type=int, default=8000, help="the inference server's port (rl's and eval's)")
    args = parser.parse_args()
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        sys.exit(f"unknown variant(s) {unknown}; known: {list(VARIANTS)}")

    times = {}
    for name in names:
        out = args.out / name
        if args.reuse and (out / "bench-times.json").exists():
            times[name] = json.loads((out / "bench-times.json").read_text())
            print(f"{name}: reusing the run in {out}", flush=True)
            continue
        print(f"{name}: rl @ {args.config} --output-dir {out} {' '.join(VARIANTS[name])}", flush=True)
        times[name] = launch(args.config, out, None, [*VARIANTS[name], "--inference.server.port", str(args.port)])
        (out / "bench-times.json").write_text(json.dumps(times[name]))
        print(f"{name}: {times[name]['wall']:.0f} s", flush=True)
    policies = {"sft": args.sft} | {name: args.out / name / "broadcasts" for name in names}
    summary = args.out / "eval" / "summary.json"
    scores = previous_scores(summary, policies) if args.reuse and summary.exists() else None
    if scores is None:
        scores = evaluate(args.eval_config, args.out / "eval", policies, args.port)

    rows = []
    for name in ["sft", *names]:
        score = scores[name]
        row = {"variant": name, "flags": " ".join(VARIANTS.get(name, ["(the RL start)"])) or "(demo defaults)"}
        row["heldout"] = f"{score['reward_mean']:.3f} ± {score['reward_std']:.3f}"
        if name in times:
            run_dir = args.out / name
            row |= times[name] | {
                "train_last": train_reward_last3(run_dir),
                "step_s": trainer_seconds_per_step(run_dir),
            }
        rows.append(row)
    print("\n".join(format_bench_table(rows, COLUMNS).splitlines()[:-1]))  # no per-step summary line


if __name__ == "__main__":
    main()
