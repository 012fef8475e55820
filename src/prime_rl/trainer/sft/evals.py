"""`sft`'s held-out evals: after the last step, `eval` on the starting model (step 0) and every exported
`weights/step_n`, logged into the run's metrics like the orchestrator's online evals.

`sft` trains without an inference server, so it does not evaluate while it trains: once training is done, rank 0 runs
the real `eval` with the `eval` config file the run names (`eval = "configs/x/eval.toml"`: environments, sampling,
and the server, `[inference]` to start one or `client.base_url` of a running one), with `model.name` the model SFT
started from and `--weights-dir {output_dir}/weights`, so one server lifetime evaluates them all. Its results land in
`{output_dir}/eval/` (`results.jsonl`, `summary.json`, `reward_vs_step.png`); each policy's `eval/<env>/...` metrics
(`orchestrator.evals.env_metrics`) go to metrics.jsonl at its step, and `report` draws the held-out curve. The
eval config is checked when `sft` starts (a bad key is exit 2 before training); an eval that fails after training
fails the run (exit 1), its output in `{output_dir}/logs/eval.out`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from loguru import logger

from prime_rl.config.loader import load_config
from prime_rl.eval.config import EvalConfig
from prime_rl.eval.eval import STEP_DIR, summarize
from prime_rl.orchestrator.evals import env_metrics, eval_line
from prime_rl.utils.monitor import Monitor

BIN = Path(sys.executable).parent


class EvalFailed(RuntimeError):
    """The eval after training exited non-zero."""


def eval_argv(config) -> list[str]:
    """`eval`'s arguments for an sft run's config: its eval file, over it the model sft started from, the exported
    weights and an output dir of the run's own."""
    argv = ["@", str(config.eval), "--model.name", config.model.name, "--output-dir", str(config.output_dir / "eval")]
    argv += ["--weights-dir", str(config.output_dir / "weights")]
    return argv + (["--model.trust-remote-code"] if config.model.trust_remote_code else [])


def check_eval_config(config) -> EvalConfig | None:
    """The eval config the run will use, loaded now: a bad file or key ends `sft` (exit 2) before it trains."""
    if config.eval is None:
        return None
    return load_config(EvalConfig, "sft: eval", eval_argv(config))[0]


def policy_step(label: str) -> int:
    """`base` is step 0, `step_N` step N."""
    match = STEP_DIR.match(label)
    return int(match.group(1)) if match else 0


def evaluate_exports(config, eval_config: EvalConfig, monitor: Monitor) -> None:
    """Run `eval` on the exported weights and log each policy's metrics at its step (bounded by `eval_timeout`)."""
    out = config.output_dir / "eval"
    log = config.output_dir / "logs" / "eval.out"
    log.parent.mkdir(parents=True, exist_ok=True)
    logger.info(f"evaluating the starting model and every weights/step_* with {config.eval} (output: {log})")
    with open(log, "w") as f:
        try:
            code = subprocess.run([str(BIN / "eval"), *eval_argv(config)], stdout=f, stderr=subprocess.STDOUT,
                                  timeout=config.eval_timeout).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            raise EvalFailed(f"the eval did not finish within {config.eval_timeout:.0f}s (eval_timeout)") from None
    if code != 0 or not (out / "summary.json").exists():
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-20:])
        raise EvalFailed(f"the eval exited with code {code}; the end of {log}:\n{tail}")
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    policies = json.loads((out / "summary.json").read_text())["policies"]
    monitor.define_axis("eval/", "eval/step")
    envs = {e.display_name: e.rollouts_per_example for e in eval_config.env}
    for policy in policies:
        label, step, metrics = policy["label"], policy_step(policy["label"]), {}
        for env, n in envs.items():
            mine = [r for r in records if r["policy"] == label and r["env"] == env]
            summary = summarize(mine, n, eval_config.pass_threshold)
            metrics |= env_metrics(env, summary, n, eval_config.pass_threshold, mine)
        seconds = max(s["seconds"] for s in policy["envs"].values())  # the policy's wall time (all its envs at once)
        metrics |= {"eval/step": step, "eval/seconds": seconds}
        logger.info(eval_line(step, metrics, list(envs), envs, seconds))
        monitor.log(step, metrics)
