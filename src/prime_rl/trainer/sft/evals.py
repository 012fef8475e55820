"""`sft`'s held-out evals while it trains: the starting model (step 0), then each `weights/step_n` export as it appears,
logged into the run's metrics like the orchestrator's online evals.

When training starts, rank 0 starts the real `eval` command as a child process with the `eval` config file the run
names (`eval = "configs/x/eval.toml"`: environments, sampling, and the server, `[inference]` to start one or
`client.base_url` of a running one), `model.name` the model SFT started from and `--weights-dir {output_dir}/weights
--follow-until max_steps`: one server lifetime evaluates the starting model, then each export once it is complete,
and eval exits after the last step's. The evaluated policies are the exports (`weights_interval`, and the last step).
Eval rewrites `{output_dir}/eval/policies.jsonl` atomically after each policy; between steps rank 0 logs the policies
finished since it last looked through the run's monitor at the policy's step, so the console, W&B and `report` show
the held-out curve while training goes on. After the last step it waits for the eval (`eval_timeout`). Its other
results land in `{output_dir}/eval/` (`results.jsonl`, `summary.json`, `reward_vs_step.png`), its console in
`{output_dir}/logs/eval.out`. A process, not an import: the trainer imports no eval or rollout code. The child is in its
own process group with a parent-death signal, so it (and the server it started) never outlives `sft`, however sft
ends. The config is checked when `sft` starts (`eval --dry-run`: a bad key is exit 2 before training); an eval that
fails or runs past `eval_timeout` after the last step fails the run (exit 1).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from loguru import logger

from prime_rl.utils.fs import remove_steps_after
from prime_rl.utils.monitor import Monitor
from prime_rl.utils.processes import Process, stop_all

BIN = Path(sys.executable).parent
CHECK_TIMEOUT = 120.0
"""Seconds `eval --dry-run` may take to check the config (it imports the config modules only)."""
POLICIES_FILE = "policies.jsonl"
"""What `eval` rewrites atomically after each policy it finished: one summary per line, in order."""
WAIT_POLL = 1.0
"""Seconds between looks at the eval while sft waits for it after the last step."""
STOP_GRACE = 30.0
"""Seconds a stopped eval gets to unwind (it stops a server of its own within 15 s) before it is killed."""


class EvalFailed(RuntimeError):
    """The eval exited non-zero, or did not finish within `eval_timeout` after the last step."""


def eval_command(config) -> list[str]:
    """`eval` with the run's eval file, over it the model sft started from, the run's exports up to its last step and
    an output dir of the run's own."""
    out = config.output_dir
    command = [str(BIN / "eval"), "@", str(config.eval), "--model.name", config.model.name]
    command += ["--output-dir", str(out / "eval"), "--weights-dir", str(out / "weights")]
    command += ["--follow-until", str(config.max_steps)]
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


def read_policies(path: Path, seen: int) -> list[dict]:
    """The policies of eval's `policies.jsonl` after the first `seen` (none while it is missing). Eval replaces the
    file whole, but a line without its newline is taken for unfinished all the same and left for the next read."""
    try:
        lines = path.read_text().splitlines(keepends=True)
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines[seen:] if line.endswith("\n")]


def policy_metrics(policy: dict) -> tuple[int, dict]:
    """A finished policy's step and the metrics to log at it: eval's `eval/<env>/...`, `eval/step` (W&B's x axis for
    them) and `eval/seconds`, the policy's wall time (its environments run at once)."""
    step = policy_step(policy["label"])
    seconds = max(env["seconds"] for env in policy["envs"].values())
    return step, policy["metrics"] | {"eval/step": step, "eval/seconds": seconds}


class FollowingEval:
    """Rank 0's `eval` child: started when training starts, read between steps, waited for after the last step, and
    stopped when sft ends any other way."""

    def __init__(self, config, monitor: Monitor):
        self.config, self.monitor = config, monitor
        self.results = config.output_dir / "eval" / POLICIES_FILE
        self.log = config.output_dir / "logs" / "eval.out"
        self.process: Process | None = None
        self.logged: list[int] = []
        """The steps of the policies logged so far, in eval's order."""
        self.seen_file: tuple[int, int] | None = None
        """(inode, mtime) of the results file when last read: eval replaces it whole (a new inode), and a step reads it
        only then."""
        self.reported_exit = False

    def start(self, step: int) -> None:
        """Start the eval of a run that trains on from `step` (0, or the step it resumed at). Exports after `step` are
        an earlier run's and are removed first: the eval would take them for this run's."""
        remove_steps_after(self.config.output_dir / "weights", step)
        self.results.unlink(missing_ok=True)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.log.write_bytes(b"")
        self.monitor.define_axis("eval/", "eval/step")
        logger.info(f"evaluating the starting model and each weights/step_* as it is exported (output: {self.log})")
        self.process = Process("eval", eval_command(self.config), dict(os.environ), self.log)
        self.process.start()

    def poll(self) -> None:
        """Log each policy eval finished since the last call at its step, with its console line; an eval that died is
        reported at once (training goes on; `finish` fails the run)."""
        try:
            stat = self.results.stat()
            current = (stat.st_ino, stat.st_mtime_ns)
        except FileNotFoundError:
            current = None
        if current is not None and current != self.seen_file:
            self.seen_file = current
            for policy in read_policies(self.results, len(self.logged)):
                step, metrics = policy_metrics(policy)
                logger.info(score_line(step, policy["metrics"]))
                self.monitor.log(step, metrics)
                self.logged.append(step)
        code = self.process.poll()
        if code not in (None, 0) and not self.reported_exit:
            self.reported_exit = True
            logger.error(
                f"the eval exited with code {code} (training goes on; the run fails at its end): see {self.log}"
            )

    def finish(self) -> None:
        """After the last step: wait for the eval to evaluate the last export, logging policies as they finish; a
        failed eval, or one still running `eval_timeout` seconds from now, is `EvalFailed`."""
        last = self.config.max_steps
        if not (self.config.output_dir / "weights" / f"step_{last}").is_dir():
            raise EvalFailed(f"weights/step_{last} is missing (removed?): the eval waits for it")
        logger.info(f"waiting for the eval to finish (at most {self.config.eval_timeout:.0f}s, eval_timeout)")
        deadline = time.monotonic() + self.config.eval_timeout
        while (code := self.process.poll()) is None:
            self.poll()
            if time.monotonic() > deadline:
                raise EvalFailed(f"the eval did not finish within {self.config.eval_timeout:.0f}s (eval_timeout)")
            time.sleep(WAIT_POLL)
        self.poll()
        if code != 0:
            raise EvalFailed(f"the eval exited with code {code}; the end of {self.log}:\n{self.process.tail()}")
        if last not in self.logged:
            raise EvalFailed(f"the eval ended without a result for step {last}; see {self.log}")

    def stop(self) -> None:
        """Stop the eval if it still runs (sft is ending early: an error, Ctrl-C); it stops its own server."""
        if self.process is not None and self.process.poll() is None:
            logger.info("stopping the eval")
            stop_all([self.process], STOP_GRACE)
