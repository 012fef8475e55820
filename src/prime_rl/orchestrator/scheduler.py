"""Keeps groups in flight, enforces the off-policy bound, and fails the run when no progress is possible.

Batch `n` is trained by trainer step `n`, which publishes `pi_n`. With `k = max_async_level`, no rollout of
batch `n` may start on a policy older than `pi_{n-1-k}`. The scheduler therefore tags each new group with the
batch it is started for: finished rollouts and in-flight groups count towards the batch being filled first, and
once that batch is covered new groups count towards the next one, which needs a newer policy. The count is in
rollouts, not groups: a group that lost rollouts (an error, no sampled token within `seq_len`) covers less of its
batch, so another group for the same batch may start at once. A group that may not start yet simply waits; when
the batch being filled itself needs a newer policy, the scheduler waits for the trainer to publish it (its
`broadcasts/step_m/STABLE`, or the step announced for an in-memory broadcast) and moves every server to it first
(the async barrier). Newer published weights are loaded as soon as they appear, so most groups run on a fresher
policy than required.

The rollouts do not idle while the trainer trains: when no group the served policy may run is in flight and
those finished cover every batch it may serve (at k = 0: the batch is complete), the next groups start *gated* on
the next policy step. They set up (task, runtime, program, rendered prompt) at once, and their model calls wait in
the worker until the scheduler announces that the servers serve that step (`patches.PolicyGate`): the set-up
overlaps the trainer's step instead of following it. Not earlier: set-up beside running groups competes with them
for the worker's event loop and delays the batch the trainer waits for. Gated groups count towards batches only
after groups that can finish now, and a batch short of rollouts (a group failed) always gets an ungated group, so
groups waiting for a policy never hold up the batch the trainer needs to make that policy.

A group's version is the oldest policy that produced any of its tokens: vLLM's per-token versions where it
reports them, else the policy served when the group started (always in adapter mode, where vLLM labels tokens with
the base weights' version). Its requests name the model of the policy it started on: in adapter mode the base model
for step 0, the run's adapter after. Finished groups that are too old for the batch
they would land in (longer than expected in flight) are dropped, as are groups spanning more than
`max_off_policy_steps` updates. A group of an `sft` environment is sampled by its frozen teacher instead (`frozen`):
it goes to the teacher's URL, waits for no policy, is no policy server's load and never goes stale.

Online evals (`evals.OnlineEvals`, when configured) run beside the training groups, in the same workers: a pass starts
when the servers first serve a policy it is due at (at k = 0 once the batch sampled on it is complete, so it runs
while the trainer trains), and before every swap the scheduler asks the pass in flight to
hold the swap (it then waits, pumping finished groups, until the pass is done) or to be discarded and rerun on the new
policy; see that module for which. Eval groups have negative ids and are handed to it.

Liveness: every wait is bounded. A run in which nothing trainable arrives (every rollout failing or too long,
every group filtered, no weights from the trainer) stops with a message naming what it waited for and what it
saw instead: after `unusable_limit` consecutive groups without a usable rollout, or `stall_timeout` seconds
without an accepted group or published weights.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from loguru import logger

from prime_rl.config.algorithm import ESTIMATOR_ALGOS
from prime_rl.orchestrator.advantage import group_has_signal
from prime_rl.orchestrator.algorithms import group_has_signal as algo_has_signal
from prime_rl.orchestrator.broadcast import TrainerGone
from prime_rl.orchestrator.buffer import Buffer
from prime_rl.orchestrator.concurrency import InflightControl
from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.orchestrator.envs import EnvTasks
from prime_rl.orchestrator.evals import OnlineEvals
from prime_rl.orchestrator.gate import rejects as gate_rejects
from prime_rl.orchestrator.messages import GroupDone, RolloutResult, RunGroup
from prime_rl.orchestrator.samples import cut_to_seq_len
from prime_rl.orchestrator.servers import InferenceServers
from prime_rl.orchestrator.temperature import TemperatureController
from prime_rl.orchestrator.worker import RolloutWorkers

WAIT_WARNING_INTERVAL = 60.0
"""Seconds between the warnings of a long wait (for weights)."""


class StallError(RuntimeError):
    """No progress is possible, or none was made for too long; the message says what was waited for."""


def min_policy_for(batch: int, max_async_level: int) -> int:
    """Oldest policy step a rollout of `batch` may start on."""
    return max(0, batch - 1 - max_async_level)


def target_batch(filling: int, rollouts_counted: int, batch_size: int) -> int:
    """The batch a new group is for, when `rollouts_counted` rollouts (finished, or expected from groups in flight)
    already count towards batch `filling` and later ones."""
    return filling + rollouts_counted // batch_size


def trained_rollouts(groups: list[Group]) -> int:
    """Rollouts of `groups` that carry samples to train on (a seat that never acted has none)."""
    return sum(1 for g in groups for r in g.rollouts if r.samples)


@dataclass
class Group:
    id: int
    env: str
    task_idx: int
    task: dict
    """The task's JSON data (the workers rebuild the task from it)."""
    start_version: int
    url: str
    attempts: int = 1
    started: float = field(default_factory=time.perf_counter)
    rollouts: list[RolloutResult] = field(default_factory=list)
    temperature: float | None = None
    """The temperature the group was (last) started at by the temperature scaling; None: `sampling.temperature`."""
    gate: int | None = None
    """The policy step its model calls wait for (started before the servers served it); None: none."""
    frozen: bool = False
    """Sampled by a frozen teacher (`sft`), not the policy: no policy version, never stale, not a policy server's
    load; `url` is the teacher's."""

    @property
    def version(self) -> int:
        """Oldest policy step behind any sampled token (vLLM's per-token report, else the start version)."""
        known = [] if self.frozen else [v for r in self.rollouts for s in r.samples for v in s.versions if v >= 0]
        return min(known, default=self.start_version)

    @property
    def newest_version(self) -> int:
        known = [] if self.frozen else [v for r in self.rollouts for s in r.samples for v in s.versions if v >= 0]
        return max(known, default=self.start_version)


@dataclass
class StepStats:
    """Counters of one step, reset when the batch is handed over."""

    wait_for_weights: float = 0.0
    update_weights: float = 0.0
    swaps: int = 0
    errors: int = 0
    retries: int = 0
    dropped_stale: int = 0
    dropped_too_long: int = 0
    """Rollouts without a sampled token within `seq_len` (their context alone fills it)."""
    cut_to_seq_len: int = 0
    """Rollouts longer than `seq_len`, trained on their first `seq_len` tokens and marked truncated."""
    dropped_failed: int = 0
    filtered: int = 0
    worker_loop_lag: float = 0.0
    groups_per_server: dict[str, int] = field(default_factory=dict)
    gated: int = 0
    """Groups started before their policy was served (they set up while the trainer trained it)."""
    wait_for_evals: float = 0.0
    """Seconds a swap waited for the online eval pass in flight to finish."""
    peak_inflight: int = 0
    """Most groups in flight at once."""
    gate_rejected: dict[str, int] = field(default_factory=dict)
    """Groups an environment's admission gate rejected (each replaced by a new group; also counted in `filtered`)."""


class Liveness:
    """Tells a run that is only slow from one that cannot make progress, and says which one it is.

    `unusable_limit` consecutive groups whose every rollout was unusable (failed, or no sampled token within
    `seq_len`) end the run at once: retrying the same environment and settings will not help. Groups that were
    usable but filtered or too old only waste time, so they are left to the `stall_timeout` clock, which restarts
    whenever a group is accepted or new weights arrive."""

    def __init__(self, stall_timeout: float, unusable_limit: int, seq_len: int):
        self.stall_timeout, self.unusable_limit, self.seq_len = stall_timeout, unusable_limit, seq_len
        self.last_progress = time.monotonic()
        self.streak = 0
        self.reasons: Counter[str] = Counter()  # why rollouts were unusable, during the streak
        self.example = ""
        self.longest = 0
        self.wasted: Counter[str] = Counter()  # usable groups not accepted, since the last progress

    def progress(self) -> None:
        self.last_progress = time.monotonic()
        self.wasted.clear()

    def usable(self) -> None:
        self.streak, self.longest, self.example = 0, 0, ""
        self.reasons.clear()

    def unusable(self, rollouts: list[RolloutResult], reason: str | None = None) -> None:
        """A finished group none of whose rollouts can be used (`reason` for the whole group, e.g. retries spent)."""
        self.streak += 1
        for r in rollouts:
            if reason is not None:
                self.reasons[reason] += 1
            elif r.error is not None:
                self.reasons["failed"] += 1
                self.example = self.example or r.error
            else:
                self.reasons["too_long"] += 1
                self.longest = max([self.longest, *(len(s.token_ids) for s in r.samples)])
        if self.streak >= self.unusable_limit:
            raise StallError(self._unusable_message())

    def _unusable_message(self) -> str:
        parts = []
        if self.reasons["too_long"]:
            parts.append(
                f"{self.reasons['too_long']} with no sampled token within seq_len={self.seq_len} (the longest "
                f"{self.longest} tokens): raise seq_len or shorten the prompts"
            )
        if self.reasons["failed"]:
            parts.append(f"{self.reasons['failed']} failed, e.g. {self.example!r}")
        for reason, count in self.reasons.items():
            if reason not in ("too_long", "failed"):
                parts.append(f"{count} {reason}")
        total = sum(self.reasons.values())
        return f"no usable rollout in the last {self.streak} groups ({total} rollouts): " + "; ".join(parts)

    def check(self, inflight: dict[int, Group]) -> None:
        """Raise if nothing was accepted for `stall_timeout` seconds."""
        idle = time.monotonic() - self.last_progress
        if idle <= self.stall_timeout:
            return
        oldest = max((time.perf_counter() - g.started for g in inflight.values()), default=0.0)
        wasted = ", ".join(f"{n} {why}" for why, n in self.wasted.items()) or "none"
        raise StallError(
            f"no group accepted for {idle:.0f}s (stall_timeout): {len(inflight)} group(s) in flight, the oldest for "
            f"{oldest:.0f}s; finished but not accepted: {wasted}. Raise orchestrator.stall_timeout if rollouts are "
            "legitimately this slow"
        )


class Scheduler:
    def __init__(
        self,
        config: OrchestratorConfig,
        buffer: Buffer,
        tasks: dict[str, EnvTasks],
        servers: InferenceServers,
        workers: RolloutWorkers,
        temperatures: TemperatureController | None = None,
        evals: OnlineEvals | None = None,
    ):
        self.config, self.buffer, self.tasks, self.servers, self.workers = config, buffer, tasks, servers, workers
        self.temperatures, self.evals = temperatures, evals
        self.gates = {e.display_name: g for e in config.env if (g := config.env_gate(e.display_name)) is not None}
        """Each gated environment's admission gate (`gate.py`)."""
        self.teachers = {env: config.env_teacher(env) for env in tasks if config.env_algo(env).type == "sft"}
        """The frozen model that samples each `sft` environment's groups, in place of the policy."""
        self.oldest = 0
        """The oldest policy the batch being collected accepts."""
        self.k = config.max_async_level
        self.inflight: dict[int, Group] = {}
        self.retry_queue: list[Group] = []
        self.finished: list[Group] = []  # accepted groups not yet handed to a batch
        self.ids = itertools.count()
        self.stats = StepStats()
        self.target_inflight = config.groups_in_flight
        self.peak_inflight = 0
        """Most groups in flight at once since the target last moved."""
        self.control = None if config.concurrency is None else InflightControl(*config.inflight_bounds(),
                                                                                 config.groups_in_flight)  # fmt: skip
        self.announced = -1
        """The newest policy step the workers were told the servers serve."""
        unusable_limit = max(16, 2 * config.groups_per_batch)
        self.liveness = Liveness(config.stall_timeout, unusable_limit, config.seq_len)
        # With an in-memory broadcast the trainer waits until its new policy is taken: look for it often (a look is
        # one store request), so the trainer hardly waits, and every 5 ms while a batch cannot start without it (at
        # k = 0 every step: the rollouts wait for it too). Files on a shared filesystem are looked for less often.
        broadcast = config.weight_broadcast.in_memory
        self.poll = min(config.weights_poll_interval, 0.05) if broadcast else config.weights_poll_interval
        self.weights_poll = min(config.weights_poll_interval, 0.005) if broadcast else config.weights_poll_interval

    # -- policy --------------------------------------------------------------------------------------------

    async def ensure_policy(self, batch: int) -> None:
        """Barrier: the servers serve at least `pi_{batch-1-k}`; load anything newer that is published."""
        needed = min_policy_for(batch, self.k)
        latest = await self.servers.latest_published()  # a directory listing, and a store request for a broadcast
        if self.servers.version < needed and latest < needed:
            latest = await self._wait_for(needed, f"batch {batch} needs policy step {needed} (k={self.k})")
        if latest > self.servers.version:
            await self.swap(max(latest, needed))

    async def _wait_for(self, step: int, why: str) -> int:
        """Until the trainer published `step` or newer; returns the newest published step."""
        logger.info(f"{why}: waiting for the trainer to publish it")
        start = warned = time.monotonic()
        while (latest := await self.servers.latest_published()) < step:
            if self.evals is not None and self.evals.running:
                await self.receive(self.weights_poll)  # the eval pass goes on meanwhile: take its groups as they end
            else:
                await asyncio.sleep(self.weights_poll)
            self._check_fatal()
            if (ended := self.servers.trainer_error()) is not None:
                raise StallError(f"{why}, but the trainer will not publish it: {ended}")
            now = time.monotonic()
            if now - start > self.config.stall_timeout:
                raise StallError(
                    f"{why}, but it did not appear within {now - start:.0f}s (stall_timeout) in "
                    f"{self.servers.where(step)}: the trainer publishes it after that training step; is it running "
                    "and training?"
                )
            if now - warned > WAIT_WARNING_INTERVAL:
                logger.warning(f"{why}: still waiting ({now - start:.0f}s) for {self.servers.where(step)}")
                warned = now
        self.stats.wait_for_weights += time.monotonic() - start
        return latest

    async def swap(self, step: int, from_disk: bool = False) -> None:
        if self.evals is not None and self.evals.running:
            if self.evals.holds_swaps():
                await self._finish_eval_pass(step)
            else:
                self.evals.interrupt(step)
        old = self.servers.version
        seconds = await self.servers.load_policy(step, from_disk)
        if self.servers.version == old:
            return  # no server to give it to (all recovering): they get the current policy when back
        self.stats.update_weights += seconds
        self.stats.swaps += 1
        self.liveness.progress()  # the trainer moved: time spent waiting for it is no rollout stall
        n = len(self.servers.healthy())
        logger.info(f"policy step {old} -> {self.servers.version} on {n} server(s) in {seconds:.3f}s")

    async def _finish_eval_pass(self, step: int) -> None:
        """Hold the swap to `step` until the eval pass in flight is done (training groups finishing meanwhile are
        taken as usual); at most `stall_timeout` seconds."""
        start = time.monotonic()
        logger.debug(f"policy step {step} waits for the eval of policy step {self.evals.current.step}")
        while self.evals.running:
            self._check_fatal()
            await self.receive()
            if (waited := time.monotonic() - start) > self.config.stall_timeout:
                raise StallError(
                    f"the eval of policy step {self.evals.current.step} did not finish within {waited:.0f}s "
                    f"(stall_timeout): {len(self.evals.current.inflight)} eval group(s) in flight"
                )
        self.stats.wait_for_evals += time.monotonic() - start

    async def final_evals(self, step: int) -> None:
        """After the last batch: serve each newer policy as the trainer publishes it (a broadcast trainer waits until
        each is taken) up to its last, `step`, and finish the eval passes due on the way and on it. The trainer writes
        its last policy to `broadcasts/` and never announces it, and may exit as soon as it is written (its store
        gone): that one is read from disk. At most `stall_timeout` seconds without a new policy."""
        final = self.servers.weight_dir(step) / "STABLE"
        logger.info(f"the final eval needs policy step {step}: waiting for the trainer to publish it")
        waiting = time.monotonic()
        while self.servers.version < step:
            if final.exists():
                await self.swap(step, from_disk=True)
            elif (latest := await self._latest_or_final(final)) > self.servers.version:
                await self.swap(min(latest, step))
                waiting = time.monotonic()
            else:
                await self.receive(self.weights_poll)  # the eval pass in flight goes on meanwhile
                self._check_fatal()
                if (ended := self.servers.trainer_error()) is not None:
                    raise StallError(
                        f"the final eval needs policy step {step}, but the trainer will not publish it: {ended}"
                    )
                if time.monotonic() - waiting > self.config.stall_timeout:
                    raise StallError(
                        f"the final eval needs policy step {step}, which did not appear within "
                        f"{self.config.stall_timeout:.0f}s (stall_timeout) in {self.servers.where(step)}"
                    )
            await self.announce_policy()
        await self.evals.start(self.servers.version)  # the final pass (none if it ran before a restart)
        while self.evals.running:
            await self._finish_eval_pass(step)

    async def _latest_or_final(self, final: Path) -> int:
        """The newest published policy; the one served now when the trainer's store is gone because the trainer wrote
        its last policy (`final`) and exited."""
        try:
            return await self.servers.latest_published()
        except TrainerGone:
            if final.exists():
                return self.servers.version
            raise

    async def receive(self, timeout: float | None = None) -> None:
        """Take the next finished group, if one comes within `timeout` (default: a poll): an eval group goes to the
        evals, a training group is judged (`on_done`) and, if accepted but too old for the batch being collected,
        dropped."""
        done = await self.workers.receive(timeout=self.poll if timeout is None else timeout)
        if done is None:
            return
        if self.evals is not None and self.evals.owns(done.id):
            await self.evals.on_done(done)
            return
        accepted = len(self.finished)
        self.on_done(done)
        # Only a group accepted just now can be too old: the others passed this check with the same `oldest`
        # (re-checking them all costs a pass over every token of every finished group, per finished group).
        fresh = [g for g in self.finished[accepted:] if g.version >= self.oldest]
        self.stats.dropped_stale += len(self.finished) - accepted - len(fresh)
        self.finished[accepted:] = fresh

    def _check_fatal(self) -> None:
        if self.servers.fatal is not None:
            raise self.servers.fatal

    # -- groups --------------------------------------------------------------------------------------------

    def gated(self, group: Group) -> bool:
        """Its model calls still wait: it was started for a policy the servers do not serve yet."""
        return group.gate is not None and group.gate > self.servers.version

    def next_group_gate(self, filling: int) -> int | None:
        """The policy step the next group would wait for: None if it may run now, `version + 1` if it may start gated,
        -1 if it may not start at all.

        Rollouts count towards the batches being filled in order: finished trainable ones, then what the groups
        that can run now should bring (`rollouts_per_example` each; one that brings fewer makes room for another
        group), then the gated groups'. A new group is for the first batch they do not cover."""
        rpe, version = self.config.rollouts_per_example, self.servers.version
        gated = sum(1 for g in self.inflight.values() if self.gated(g))
        running = len(self.inflight) - gated
        counted = trained_rollouts(self.finished) + rpe * running
        if min_policy_for(target_batch(filling, counted, self.config.batch_size), self.k) <= version:
            return None if running < self.target_inflight else -1
        needed = min_policy_for(target_batch(filling, counted + rpe * gated, self.config.batch_size), self.k)
        if needed > version + 1 or running or len(self.inflight) >= self.target_inflight or self.retry_queue:
            return -1  # one policy ahead at most; only beside no running group; a retry runs ungated, when needed
        return version + 1

    async def top_up(self, filling: int) -> None:
        """Start groups until `target_inflight` are in flight, as far as the policy bound allows: ungated while the
        served policy may run them, then gated on the next policy."""
        while (gate := self.next_group_gate(filling)) != -1:
            url = self.servers.least_loaded()
            if url is None:
                return  # every server is recovering
            start_version = self.servers.version if gate is None else gate
            if self.retry_queue:
                group = self.retry_queue.pop(0)
                group.start_version, group.attempts = start_version, group.attempts + 1
                group.rollouts, group.started, group.gate = [], time.perf_counter(), gate
                if not group.frozen:
                    group.url = url
                self.stats.retries += 1
            else:
                env, idx = self.buffer.sample_task()
                tasks = self.tasks[env]
                task = tasks.next() if tasks.size is None else tasks[idx]
                group = Group(next(self.ids), env, idx, task, start_version, url, gate=gate)
                if env in self.teachers:
                    group.url, group.frozen = self.teachers[env].base_url, True
            if group.frozen:  # a teacher's calls wait for no policy
                group.start_version, group.gate = self.servers.version, None
            await self._submit(group)

    async def announce_policy(self) -> None:
        """Tell the workers which policy the servers serve, once per new step: gated model calls go."""
        if self.servers.version > self.announced:
            self.announced = self.servers.version
            await self.workers.policy_served(self.announced)
            if self.evals is not None and self.k > 0:  # at k = 0 once its batch is complete (`collect`)
                await self.evals.start(self.announced)

    async def adapt_inflight(self) -> None:
        """Once per step with `concurrency`: the next target from the servers' loads (`concurrency.py`)."""
        if self.control is None:
            return
        before, loads = self.target_inflight, await self.servers.loads()
        self.target_inflight = self.control.update(loads, self.peak_inflight)
        self.peak_inflight = len(self.inflight)
        if self.target_inflight != before:
            seen = ", ".join(f"{load.waiting:.0f} waiting, KV {load.kv_usage:.0%}" for load in loads)
            logger.info(f"groups in flight: {before} -> {self.target_inflight} (servers: {seen})")

    async def _submit(self, group: Group) -> None:
        self.inflight[group.id] = group
        self.stats.peak_inflight = max(self.stats.peak_inflight, len(self.inflight))
        self.peak_inflight = max(self.peak_inflight, len(self.inflight))
        if not group.frozen:
            self.servers.load[group.url] += 1
        self.stats.groups_per_server[group.url] = self.stats.groups_per_server.get(group.url, 0) + 1
        self.stats.gated += group.gate is not None
        if self.temperatures is not None:
            group.temperature = self.temperatures.temperature(group.env)
        request = RunGroup(
            id=group.id,
            env=group.env,
            task=group.task,
            n=self.config.rollouts_per_example,
            base_url=group.url,
            model=self.teachers[group.env].name
            if group.frozen
            else self.servers.model_name(group.start_version, self.config.model.api_name),
            temperature=group.temperature,
            policy_gate=group.gate,
        )
        await self.workers.submit(request)

    def on_done(self, done: GroupDone) -> None:
        group = self.inflight.pop(done.id)
        if not group.frozen:
            self.servers.load[group.url] -= 1
        self.stats.worker_loop_lag = max(self.stats.worker_loop_lag, done.loop_lag)
        failed = [r for r in done.rollouts if r.retryable]
        if failed:
            self.stats.errors += len(failed)
            if group.frozen:  # the teacher is not one of the pool's servers: retried as it is
                logger.warning(f"teacher {group.url} failed a group of {group.env}: {failed[0].error}")
            else:
                self.servers.mark_failed(group.url, failed[0].error or "generation failed")
            if group.attempts <= self.config.max_retries:
                self.retry_queue.append(group)
            else:
                logger.warning(f"group of task {group.env}/{group.task_idx} failed {group.attempts} times; dropped")
                self.stats.dropped_failed += 1
                self.liveness.unusable(done.rollouts, f"failed on the inference server {group.attempts} times")
            return
        good = []
        for rollout in done.rollouts:
            if rollout.error is not None:
                self.stats.errors += 1
                logger.debug(f"{group.env}/{group.task_idx}: rollout excluded: {rollout.error}")
            elif any(len(s.token_ids) > self.config.seq_len for s in rollout.samples):
                samples = cut_to_seq_len(rollout.samples, self.config.seq_len)
                if samples:
                    self.stats.cut_to_seq_len += 1
                    good.append(msgspec.structs.replace(rollout, samples=samples, truncated=True))
                else:
                    self.stats.dropped_too_long += 1
            else:
                good.append(rollout)
        if not good:
            if done.rollouts and any(r.error for r in done.rollouts):
                logger.warning(f"every rollout of {group.env}/{group.task_idx} failed: {done.rollouts[0].error}")
            self.liveness.unusable(done.rollouts)
            return
        if not any(r.samples for r in good):  # rewards, but no seat of the policy sampled a token: nothing to train
            self.stats.filtered += 1
            self.liveness.unusable(good, "sampled no token")
            return
        self.liveness.usable()
        group.rollouts = good
        rewards = seat_rewards(good)
        if self.temperatures is not None:  # every scored group, also those filtered below: they are the signal
            self.temperatures.observe(group.env, rewards)
        if group.version < group.start_version:
            # The server sampled with older weights than we believe it serves: it restarted on base weights.
            self.servers.mark_failed(group.url, f"served policy {group.version}, expected {group.start_version}")
            self._waste("stale")
            return
        if group.newest_version - group.version > self.config.max_off_policy_steps:
            self._waste("stale")
            return
        status = self.buffer.add_group(group.env, group.task_idx, [r.reward for r in good])
        if status != "kept":
            self._waste("filtered")
            return
        if self.config.filter_zero_advantage and not self._has_signal(group.env, good, rewards):
            # No seat can get a non-zero advantage (with a group baseline: equal rewards per seat).
            self._waste("filtered")
            return
        gate = self.gates.get(group.env)
        if gate is not None and gate_rejects(gate, good, self.config.advantage, self.config.mask_truncated_completions):
            # Its slot in flight is free again: the next `top_up` starts a replacement group.
            self.stats.gate_rejected[group.env] = self.stats.gate_rejected.get(group.env, 0) + 1
            self._waste("rejected by the gate")
            return
        self.finished.append(group)
        self.liveness.progress()

    def _has_signal(self, env: str, rollouts: list[RolloutResult], rewards: dict[str, list[float]]) -> bool:
        algo = self.config.env_algo(env)
        if algo.type in ESTIMATOR_ALGOS:
            return any(group_has_signal(r, self.config.advantage.estimator) for r in rewards.values())
        seats, episodes = [r.seat for r in rollouts], [r.episode for r in rollouts]
        return algo_has_signal(algo, seats, episodes, [r.reward for r in rollouts])

    def _waste(self, why: str) -> None:
        if why == "stale":
            self.stats.dropped_stale += 1
        else:
            self.stats.filtered += 1
        self.liveness.wasted[why] += 1

    # -- batches -------------------------------------------------------------------------------------------

    async def collect(self, batch: int) -> list[Group]:
        """Groups for `batch`: at least `batch_size` trained rollouts, each started on a policy the bound allows."""
        await self.adapt_inflight()
        self.oldest = oldest = min_policy_for(batch, self.k)
        usable = [g for g in self.finished if g.frozen or g.version >= oldest]  # a teacher's never age
        self.stats.dropped_stale += len(self.finished) - len(usable)
        self.finished = usable
        while trained_rollouts(self.finished) < self.config.batch_size:
            self._check_fatal()
            await self.top_up(batch)  # before a wait for the trainer: gated groups set up meanwhile
            await self.ensure_policy(batch)
            await self.announce_policy()
            await self.top_up(batch)
            if not self.inflight and not self.servers.recovering:
                raise StallError(  # cannot happen while the accounting above holds; never loop silently if it does
                    f"batch {batch}: nothing in flight and no group may start (policy step {self.servers.version}, "
                    f"{trained_rollouts(self.finished)} of {self.config.batch_size} rollouts finished)"
                )
            await self.receive()
            self.liveness.check(self.inflight)
        if self.evals is not None and self.k == 0:
            # At k = 0 the servers idle while the trainer trains this batch: the pass of the policy that sampled it
            # runs then, not beside the batch the trainer waits for (the swap to the next policy waits for it).
            await self.evals.start(self.servers.version)
        return self._take_batch()

    def _take_batch(self) -> list[Group]:
        """The fewest finished groups whose trained rollouts reach `batch_size`, oldest first."""
        total = 0
        for n, group in enumerate(self.finished, start=1):
            total += sum(1 for r in group.rollouts if r.samples)
            if total >= self.config.batch_size:
                batch, self.finished = self.finished[:n], self.finished[n:]
                return batch
        raise AssertionError("collect() returns only once the finished groups fill a batch")


def seat_rewards(rollouts: list[RolloutResult]) -> dict[str, list[float]]:
    """Rewards by seat: each seat of a multi-agent env is its own group for advantages (a first mover and its
    opponent do not share a baseline); a single-agent env has one seat."""
    seats: dict[str, list[float]] = {}
    for r in rollouts:
        seats.setdefault(r.seat, []).append(r.reward)
    return seats
