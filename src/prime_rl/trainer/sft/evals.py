"""`sft`'s held-out evals: after the last step, `eval` on the starting model (step 0) and every exported
`weights/step_n`, logged into the run's metrics like the orchestrator's online evals.

`sft` trains without an inference server, so it does not evaluate while it trains: once training is done, rank 0 runs
the real `eval` command with the `eval` config file the run names (`eval = "configs/x/eval.toml"`: environments,
sampling, and the server, `[inference]` to start one or `client.base_url` of a running one), with `model.name` the
model SFT started from and `--weights-dir {output_dir}/weights`, so one server lifetime evaluates them all. Its
results land in `{output_dir}/eval/` (`results.jsonl`, `summary.json`, `reward_vs_step.png`), its console in
`{output_dir}/logs/eval.out`; each policy's metrics (`eval/<env>/...`, which `eval` computes into its summary) go
through the run's monitor at the policy's step, and `report` draws the held-out curve. A process, not an import:
the trainer imports no eval or rollout code. The config is checked when `sft` starts (`eval --dry-run`: a bad key is
exit 2 before training); an eval that fails or runs past `eval_timeout` fails the run (exit 1).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from loguru import logger

from prime_rl.utils.monitor import Monitor

BIN = Path(sys.executable).parent
CHECK_TIMEOUT = 120.0
"""Seconds `eval --dry-run` may take to check the config (it imports the config modules only)."""


class EvalFailed(RuntimeError):
    """The eval after training exited non-zero or ran too long."""


def eval_command(config) -> list[str]:
    """`eval` with the run's eval file, over it the model sft started from, the exported weights and an output dir
    of the run's own."""
    out = config.output_dir
    command = [str(BIN / "eval"), "@", str(config.eval), "--model.name", config.model.name]
    command += ["--output-dir", str(out / "eval"), "--weights-dir", str(out / "weights")]
    return command + (["--model.trust-remote-code"] if config.model.trust_remote_code else [])


def check_eval_config(config) -> None:
    """Load the eval config as the run will (`eval --dry-run`); a bad file or key ends `sft` now with eval's message
    (exit 2), not after training."""
    check = subprocess.run([*eval_command(config), "--dry-run"], capture_output=True, text=True, timeout=CHECK_TIMEOUT)
    if check.returncode != 0:
        print(f"sft: eval = {config.eval}: {check.stderr.strip()}", file=sys.stderr)
        sys.exit(2)


def policy_step(label: str) -> int:
    """`base` is step 0, `step_N` step N."""
    match = re.fullmatch(r"step_(\d+)", label)
    return int(match.group(1)) if match else 0


def score_line(step: int, metrics: dict) -> str:
    """The console line of one policy, e.g. `eval step 2 | reverse-text avg@2 0.5000 pass@2 0.7500`."""
    scores = [f"{k.removeprefix('eval/').replace('/', ' ')} {v:.4f}" for k, v in metrics.items() if "@" in k]
    return f"eval step {step} | {' | '.join(scores)}"


def evaluate_exports(config, monitor: Monitor) -> None:
    """Run `eval` on the exported weights and log each policy's metrics at its step (bounded by `eval_timeout`)."""
    out = config.output_dir / "eval"
    log = config.output_dir / "logs" / "eval.out"
    log.parent.mkdir(parents=True, exist_ok=True)
    logger.info(f"evaluating the starting model and every weights/step_* with {config.eval} (output: {log})")
    with open(log, "w") as f:
        try:
            command = eval_command(config)
            code = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, timeout=config.eval_timeout).returncode
        except subprocess.TimeoutExpired:
            raise EvalFailed(f"the eval did not finish within {config.eval_timeout:.0f}s (eval_timeout)") from None
    if code != 0 or not (out / "summary.json").exists():
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-20:])
        raise EvalFailed(f"the eval exited with code {code}; the end of {log}:\n{tail}")
    monitor.define_axis("eval/", "eval/step")
    for policy in json.loads((out / "summary.json").read_text())["policies"]:
        step = policy_step(policy["label"])
        seconds = max(env["seconds"] for env in policy["envs"].values())  # the policy's wall time, its envs at once
        metrics = policy["metrics"] | {"eval/step": step, "eval/seconds": seconds}
        logger.info(score_line(step, policy["metrics"]))
        monitor.log(step, metrics)
