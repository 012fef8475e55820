"""Keeps groups in flight and enforces the off-policy bound (DESIGN section 2).

Batch `n` is trained by trainer step `n`, which publishes `pi_n`. With `k = max_async_level`, no rollout of
batch `n` may start on a policy older than `pi_{n-1-k}`. The scheduler therefore tags each group with the
batch it is started for: in-flight and finished groups count towards the batch being filled first, and once
that batch is covered new groups count towards the next one, which needs a newer policy. A group that may
not start yet simply waits; when the batch being filled itself needs a newer policy, the scheduler waits for
the trainer's `broadcasts/step_m/STABLE` and moves every server to it first (the async barrier). Newer
published weights are loaded as soon as they appear, so most groups run on a fresher policy than required.

A group's version is the oldest policy that produced any of its tokens: vLLM's per-token versions where it
reports them, else the policy served when the group started. Finished groups that are too old for the batch
they would land in (longer than expected in flight) are dropped, as are groups spanning more than
`max_off_policy_steps` updates.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

from loguru import logger

from prime_rl.orchestrator.buffer import Buffer
from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.orchestrator.servers import InferenceServers
from prime_rl.orchestrator.worker import GroupDone, RolloutResult, RolloutWorkers, RunGroup


def min_policy_for(batch: int, max_async_level: int) -> int:
    """Oldest policy step a rollout of `batch` may start on."""
    return max(0, batch - 1 - max_async_level)


def target_batch(filling: int, groups_counted: int, groups_per_batch: int) -> int:
    """The batch a new group is for, when `groups_counted` groups (finished or in flight) already count
    towards batch `filling` and later ones."""
    return filling + groups_counted // groups_per_batch


@dataclass
class Group:
    id: int
    env: str
    task_idx: int
    start_version: int
    url: str
    attempts: int = 1
    started: float = field(default_factory=time.perf_counter)
    rollouts: list[RolloutResult] = field(default_factory=list)

    @property
    def version(self) -> int:
        """Oldest policy step behind any sampled token (vLLM's per-token report, else the start version)."""
        known = [v for r in self.rollouts for s in r.samples for v in s.versions if v >= 0]
        return min(known, default=self.start_version)

    @property
    def newest_version(self) -> int:
        known = [v for r in self.rollouts for s in r.samples for v in s.versions if v >= 0]
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
    filtered: int = 0
    worker_loop_lag: float = 0.0
    groups_per_server: dict[str, int] = field(default_factory=dict)


class Scheduler:
    def __init__(
        self,
        config: OrchestratorConfig,
        buffer: Buffer,
        tasks: dict[str, list],
        servers: InferenceServers,
        workers: RolloutWorkers,
    ):
        self.config, self.buffer, self.tasks, self.servers, self.workers = config, buffer, tasks, servers, workers
        self.k = config.max_async_level
        self.inflight: dict[int, Group] = {}
        self.retry_queue: list[Group] = []
        self.finished: list[Group] = []  # accepted groups not yet handed to a batch
        self.ids = itertools.count()
        self.stats = StepStats()
        self.target_inflight = max(1, round(config.groups_per_batch * config.oversampling))

    # -- policy --------------------------------------------------------------------------------------------

    async def ensure_policy(self, batch: int) -> None:
        """Barrier: the servers serve at least `pi_{batch-1-k}`; load anything newer that is published."""
        needed = min_policy_for(batch, self.k)
        if self.servers.version < needed:
            path = self.servers.weight_dir(needed) / "STABLE"
            if not path.exists():
                logger.info(f"batch {batch} needs policy step {needed} (k={self.k}): waiting for {path}")
                start = time.perf_counter()
                while not path.exists():
                    await asyncio.sleep(self.config.weights_poll_interval)
                    self._check_fatal()
                self.stats.wait_for_weights += time.perf_counter() - start
        latest = self.servers.latest_stable()
        if latest > self.servers.version:
            await self.swap(max(latest, needed))

    async def swap(self, step: int) -> None:
        old = self.servers.version
        seconds = await self.servers.load_policy(step)
        self.stats.update_weights += seconds
        self.stats.swaps += 1
        logger.info(f"policy step {old} -> {step} on {len(self.servers.healthy())} server(s) in {seconds:.3f}s")

    def _check_fatal(self) -> None:
        if self.servers.fatal is not None:
            raise self.servers.fatal

    # -- groups --------------------------------------------------------------------------------------------

    async def top_up(self, filling: int) -> None:
        """Start groups until `target_inflight` are in flight, as far as the policy bound allows."""
        while len(self.inflight) < self.target_inflight:
            url = self.servers.least_loaded()
            if url is None:
                return  # every server is recovering
            counted = len(self.finished) + len(self.inflight)
            batch = target_batch(filling, counted, self.config.groups_per_batch)
            if self.servers.version < min_policy_for(batch, self.k):
                return  # a group started now would be too old for the batch it is for
            if self.retry_queue:
                group = self.retry_queue.pop(0)
                group.start_version, group.url, group.attempts = self.servers.version, url, group.attempts + 1
                group.rollouts, group.started = [], time.perf_counter()
                self.stats.retries += 1
            else:
                env, idx = self.buffer.sample_task()
                group = Group(next(self.ids), env, idx, self.servers.version, url)
            await self._submit(group)

    async def _submit(self, group: Group) -> None:
        self.inflight[group.id] = group
        self.servers.load[group.url] += 1
        self.stats.groups_per_server[group.url] = self.stats.groups_per_server.get(group.url, 0) + 1
        task = self.tasks[group.env][group.task_idx]
        request = RunGroup(
            id=group.id, env=group.env, task=task, n=self.config.rollouts_per_example, base_url=group.url
        )
        await self.workers.submit(request)

    def on_done(self, done: GroupDone) -> None:
        group = self.inflight.pop(done.id)
        self.servers.load[group.url] -= 1
        self.stats.worker_loop_lag = max(self.stats.worker_loop_lag, done.loop_lag)
        failed = [r for r in done.rollouts if r.retryable]
        if failed:
            self.stats.errors += len(failed)
            self.servers.mark_failed(group.url, failed[0].error or "generation failed")
            if group.attempts <= self.config.max_retries:
                self.retry_queue.append(group)
            else:
                logger.warning(f"group of task {group.env}/{group.task_idx} failed {group.attempts} times; dropped")
            return
        good = []
        for rollout in done.rollouts:
            if rollout.error is not None:
                self.stats.errors += 1
                logger.debug(f"{group.env}/{group.task_idx}: rollout excluded: {rollout.error}")
            elif any(len(s.token_ids) > self.config.seq_len for s in rollout.samples):
                self.stats.dropped_too_long += 1
            else:
                good.append(rollout)
        if done.rollouts and len(good) < len(done.rollouts) and not good:
            logger.warning(f"every rollout of {group.env}/{group.task_idx} failed: {done.rollouts[0].error}")
        if not good:
            return
        group.rollouts = good
        if group.version < group.start_version:
            # The server sampled with older weights than we believe it serves: it restarted on base weights.
            self.servers.mark_failed(group.url, f"served policy {group.version}, expected {group.start_version}")
            self.stats.dropped_stale += 1
            return
        if group.newest_version - group.version > self.config.max_off_policy_steps:
            self.stats.dropped_stale += 1
            return
        rewards = [r.reward for r in good]
        status = self.buffer.add_group(group.env, group.task_idx, rewards)
        # Equal rewards give every estimator an advantage of exactly 0: no learning signal.
        if status != "kept" or (self.config.filter_zero_advantage and len(set(rewards)) == 1):
            self.stats.filtered += 1
            return
        self.finished.append(group)

    # -- batches -------------------------------------------------------------------------------------------

    async def collect(self, batch: int) -> list[Group]:
        """Groups for `batch`: at least `batch_size` rollouts, each started on a policy the bound allows."""
        oldest = min_policy_for(batch, self.k)
        usable = [g for g in self.finished if g.version >= oldest]
        self.stats.dropped_stale += len(self.finished) - len(usable)
        self.finished = usable
        while self._groups_needed() > len(self.finished):
            self._check_fatal()
            await self.ensure_policy(batch)
            await self.top_up(batch)
            done = await self.workers.receive(timeout=self.config.weights_poll_interval)
            if done is not None:
                accepted = len(self.finished)
                self.on_done(done)
                # Only a group accepted just now can be too old: the others passed this check with the same `oldest`
                # (re-checking them all costs a pass over every token of every finished group, per finished group).
                self.finished[accepted:] = [g for g in self.finished[accepted:] if g.version >= oldest]
        return self._take_batch()

    def _groups_needed(self) -> int:
        """Fewest finished groups whose rollouts reach batch_size."""
        total = 0
        for i, group in enumerate(self.finished, start=1):
            total += len(group.rollouts)
            if total >= self.config.batch_size:
                return i
        return len(self.finished) + 1

    def _take_batch(self) -> list[Group]:
        n = self._groups_needed()
        batch, self.finished = self.finished[:n], self.finished[n:]
        return batch
