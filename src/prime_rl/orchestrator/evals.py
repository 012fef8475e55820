"""Online evals: the held-out reward of the policy during `rl`, on the servers that sample the training rollouts.

A pass evaluates one policy version on the environments due at it: the policy before step 1 (step 0), then every
`interval` steps per environment (the first version served at or after the due step), and the final policy. It
starts as soon as the servers serve that version (at k = 0: once the batch sampled on it is complete, while the
trainer trains and the servers would idle) and runs beside the training rollouts, in the same rollout workers (the
eval environments are served there as `eval/<name>`, with their own sampling).

One version per pass: all servers serve one policy, and the only thing that changes it is the scheduler's swap. So
a swap first asks the pass in flight (`holds_swaps`): at k = 0 (where training waits for that swap anyway), for the
step-0 pass, and for a pass already discarded `MAX_INTERRUPTIONS` times, the swap waits until the pass is done (the
cost of evals at k = 0); otherwise, at k >= 1, the swap goes ahead, the pass is discarded (its groups still in flight
are dropped when they come back) and it reruns on the new version, so training never waits for it. A finished pass
is checked against vLLM's per-token versions: a token of another version (a server that restarted on other weights)
discards it too. The version measured is the step the pass is logged at (`eval/step`) and each rollout record's
`step` and `policy_versions`.

Output: the metrics `eval/<env>/...` (metrics.jsonl at the measured step, W&B plotted against `eval/step`,
TensorBoard), one console line per pass, and `{output_dir}/evals/step_<n>/` (`results.jsonl`, one line per rollout
as `eval` writes them, and `summary.json`), written atomically once the pass is done. A resumed run does not
evaluate a step again whose `evals/step_<n>/summary.json` exists; the passes of steps after the resumed one are an
earlier life's and are deleted.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from loguru import logger

from prime_rl.eval.eval import env_metrics, eval_line, rollout_record, summarize
from prime_rl.eval.rollouts import Job
from prime_rl.orchestrator.config import EVAL_ENV_PREFIX, OrchestratorConfig
from prime_rl.orchestrator.envs import EnvTasks, check_prompts_fit, load_tasks
from prime_rl.orchestrator.messages import GroupDone, RolloutResult, RunGroup
from prime_rl.utils.fs import atomic_dir, remove_steps_after
from prime_rl.utils.monitor import Monitor

MAX_INTERRUPTIONS = 2
"""A pass discarded this many times by swaps holds the next swap until it is done, so every due pass completes."""

EVALS_DIR = "evals"


def load_eval_tasks(config: OrchestratorConfig) -> dict[str, EnvTasks]:
    """The first `num_examples` tasks of each eval environment, checked against `seq_len` like training's: a bad
    eval environment fails the run before anything starts."""
    if config.eval is None:
        return {}
    limits = {env.display_name: env.num_examples for env in config.eval.env}
    tasks = load_tasks(config.eval.env, config.seq_len, limits)
    for name, env_tasks in tasks.items():
        if env_tasks.size is None:
            raise ValueError(f"eval environment {name!r} has an infinite taskset: set its num_examples")
    check_prompts_fit(tasks, config.model, config.seq_len, config.eval_sampling().max_tokens)
    return tasks


# ---------------------------------------------------------------------------------------------------------
# The math and the bookkeeping (pure).


def next_due(step: int, interval: int) -> int:
    """The first step after `step` an environment evaluated at `step` is due again."""
    return (step // interval + 1) * interval


def resumed_due(step: int, interval: int, done: bool) -> int:
    """When an environment is next due in a run resumed at `step`: at `step` itself if it was due there and its
    pass did not complete before the restart (`done`), else at its next interval."""
    return step if step % interval == 0 and not done else next_due(step, interval)


def token_versions(rollouts: list[RolloutResult]) -> set[int]:
    """The policy versions vLLM reported for the sampled tokens of `rollouts` (unknown ones left out)."""
    return {v for r in rollouts for s in r.samples for v in s.versions if v >= 0}


# ---------------------------------------------------------------------------------------------------------
# The passes.


@dataclass
class EvalPass:
    step: int
    """The policy version it measures: the one the servers served when it started."""
    envs: list[str]
    jobs: list[Job]
    interruptions: int = 0
    """Times an earlier pass of these environments was discarded by a swap."""
    inflight: dict[int, tuple[Job, str]] = field(default_factory=dict)
    """Group id -> its job and server."""
    started: float = field(default_factory=time.perf_counter)


class OnlineEvals:
    """The orchestrator's eval passes; the scheduler starts them (`start`, after each new policy is served), asks them
    before a swap (`holds_swaps`, `interrupt`) and hands them their finished groups (`owns`, `on_done`)."""

    def __init__(self, config: OrchestratorConfig, tasks: dict[str, EnvTasks], servers, workers, monitor: Monitor,
                 resumed_step: int | None):  # fmt: skip
        assert config.eval is not None
        self.config, self.eval, self.tasks = config, config.eval, tasks
        self.servers, self.workers, self.monitor = servers, workers, monitor
        self.final = config.max_steps
        self.dir = Path(config.output_dir) / EVALS_DIR
        self.envs = {e.display_name: e for e in self.eval.env}
        self.ids = itertools.count(-1, -1)  # training groups count up from 0
        self.current: EvalPass | None = None
        self.dropped: dict[int, str] = {}
        """Groups of discarded passes still in flight -> their server."""
        self.interruptions = 0
        self.due = dict.fromkeys(self.envs, 0)
        """Per environment, the first policy step it is due at."""
        if resumed_step is None:
            remove_steps_after(self.dir, -1)  # an earlier run's passes in this output dir
        else:
            remove_steps_after(self.dir, resumed_step)  # an earlier life's passes of policies we train again
            done = self.evaluated(resumed_step)
            for name, env in self.envs.items():
                self.due[name] = resumed_due(resumed_step, self.eval.env_interval(env), name in done)
            if done:
                logger.info(
                    f"policy step {resumed_step} was evaluated on {sorted(done)} before the restart "
                    f"({self.dir / f'step_{resumed_step}'}): not again"
                )
        monitor.define_axis("eval/", "eval/step")

    def evaluated(self, step: int) -> set[str]:
        """The environments a completed pass measured at `step` (an earlier life's, when resuming)."""
        path = self.dir / f"step_{step}" / "summary.json"
        return set(json.loads(path.read_text())["envs"]) if path.exists() else set()

    @property
    def running(self) -> bool:
        return self.current is not None

    @staticmethod
    def owns(group_id: int) -> bool:
        return group_id < 0

    def holds_swaps(self) -> bool:
        """Whether a swap waits for the pass in flight (else it discards it): at k = 0 training needs that swap's
        policy before anything else can run, so waiting is the only way a pass completes; the step-0 pass is always
        kept (the run's starting point); and a pass discarded `MAX_INTERRUPTIONS` times is kept at last."""
        p = self.current
        if p is None:
            return False
        return self.config.max_async_level == 0 or p.step == 0 or p.interruptions >= MAX_INTERRUPTIONS

    def interrupt(self, new_step: int) -> None:
        """The servers move to `new_step` now: the pass in flight is discarded; it reruns on `new_step`."""
        p, self.current = self.current, None
        self.dropped |= {gid: url for gid, (_, url) in p.inflight.items()}
        self.interruptions = p.interruptions + 1
        logger.info(
            f"eval of policy step {p.step} discarded: the servers move to step {new_step} meanwhile (k >= 1 does not "
            f"wait for evals); it reruns on step {new_step}"
        )

    async def start(self, step: int) -> None:
        """Start the pass of the environments due at policy `step`, which the servers serve now."""
        if self.current is not None:
            return
        done = self.evaluated(step)
        envs = [n for n in self.envs if (step >= self.due[n] or step == self.final) and n not in done]
        if not envs:
            return
        jobs = [
            Job(name, i, task, self.envs[name].rollouts_per_example)
            for name in envs
            for i, task in enumerate(self.tasks[name].items)
        ]
        self.current = EvalPass(step, envs, jobs, self.interruptions)
        self.interruptions = 0
        for job in jobs:
            await self._submit(job)
        logger.debug(f"eval of policy step {step} started: {envs}, {sum(j.n for j in jobs)} rollouts")

    async def _submit(self, job: Job) -> None:
        url = self.servers.least_loaded() or self.servers.urls[0]  # all recovering: it fails and is retried
        group_id = next(self.ids)
        self.current.inflight[group_id] = (job, url)
        self.servers.load[url] += 1
        model = self.servers.model_name(self.current.step, self.config.model.api_name)
        await self.workers.submit(RunGroup(group_id, EVAL_ENV_PREFIX + job.env, job.task, job.n, url, model))

    async def on_done(self, done: GroupDone) -> None:
        """A finished eval group: kept, retried (it failed on the server), or dropped (its pass was discarded)."""
        if done.id in self.dropped:
            self.servers.load[self.dropped.pop(done.id)] -= 1
            return
        p = self.current
        if p is None or done.id not in p.inflight:  # cannot happen while the ids are ours; never crash the run on it
            logger.warning(f"eval group {done.id} finished but no pass waits for it; dropped")
            return
        job, url = p.inflight.pop(done.id)
        self.servers.load[url] -= 1
        failed = [r for r in done.rollouts if r.retryable]
        if failed and job.attempts < self.config.max_retries:
            job.attempts += 1
            self.servers.mark_failed(url, failed[0].error or "generation failed")
            await self._submit(job)
            return
        job.results = list(done.rollouts)
        if not p.inflight:
            await self._finish(p)

    async def _finish(self, p: EvalPass) -> None:
        self.current = None
        versions = token_versions([r for job in p.jobs for r in job.results])
        if versions - {p.step}:
            logger.warning(
                f"eval of policy step {p.step} discarded: its tokens came from policy steps {sorted(versions)} (a "
                f"server changed weights during the pass); it reruns on step {self.servers.version}"
            )
            self.interruptions = p.interruptions + 1
            await self.start(self.servers.version)
            return
        records = []
        for job in p.jobs:
            for i, result in enumerate(job.results):
                record = rollout_record(f"step_{p.step}", job, i, result)
                records.append(record | {"step": p.step, "policy_versions": sorted(token_versions([result]))})
        seconds = time.perf_counter() - p.started
        summaries, metrics = {}, {"eval/step": p.step, "eval/seconds": seconds, "eval/interruptions": p.interruptions}
        for name in p.envs:
            n = self.envs[name].rollouts_per_example
            mine = [r for r in records if r["env"] == name]
            summaries[name] = summarize(mine, n, self.eval.pass_threshold)
            metrics |= env_metrics(name, summaries[name], n, self.eval.pass_threshold, mine)
        with atomic_dir(self.dir / f"step_{p.step}") as tmp:
            (tmp / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
            summary = {"step": p.step, "seconds": seconds, "interruptions": p.interruptions, "envs": summaries}
            (tmp / "summary.json").write_text(json.dumps(summary, indent=2))
        for name in p.envs:
            self.due[name] = next_due(p.step, self.eval.env_interval(self.envs[name]))
        rpe = {name: self.envs[name].rollouts_per_example for name in p.envs}
        logger.info(eval_line(p.step, metrics, p.envs, rpe, seconds))
        self.monitor.log(p.step, metrics)
