"""`orchestrator` entry point: rollouts in, one training batch per step out.

    uv run orchestrator @ cfg.toml
    uv run orchestrator @ cfg.toml --bench [--bench.steps N]    # throughput of the running servers, no trainer

Start: load the environments and their tasks -> wait for the inference servers -> base weights on a fresh
start, or the resumed step's weights -> spawn rollout workers. Step n: the scheduler collects finished
groups that respect the off-policy bound (swapping weights as the trainer publishes them) -> advantages per
group, then over the batch -> `rollouts/step_n/batch.bin`, atomically -> metrics -> maybe checkpoint. With
`[eval]`, held-out passes run beside the training groups (`evals.py`); after the last batch the orchestrator serves
the trainer's last policy and evaluates it before it exits.

`--bench` runs the same loop on the weights the servers serve at start, with no trainer: nothing is loaded or
waited for, no batch or checkpoint is written (nothing a trainer could consume later), and the step metrics end
as one table.
"""

import asyncio
import signal
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from loguru import logger

from prime_rl.batch import TrainingBatch, TrainingSample, batch_path, write_batch
from prime_rl.config.algorithm import ESTIMATOR_ALGOS, TEACHER_ALGOS
from prime_rl.config.loader import load_config, write_resolved_config
from prime_rl.models.tokenizers import load_tokenizer
from prime_rl.orchestrator import ckpt
from prime_rl.orchestrator.advantage import (
    RunningMean,
    compute_advantages,
    normalize_batch_advantages,
    seat_members,
)
from prime_rl.orchestrator.algorithms import RaeBaselines, group_advantages
from prime_rl.orchestrator.broadcast import BroadcastClient
from prime_rl.orchestrator.buffer import Buffer
from prime_rl.orchestrator.config import LogExtrasConfig, OrchestratorConfig
from prime_rl.orchestrator.echo import echo_metrics, echo_weights
from prime_rl.orchestrator.envs import EnvTasks, check_prompts_fit, load_tasks
from prime_rl.orchestrator.evals import OnlineEvals, load_eval_tasks
from prime_rl.orchestrator.scheduler import Group, Scheduler, StepStats, seat_rewards
from prime_rl.orchestrator.self_distill import SelfDistiller
from prime_rl.orchestrator.servers import InferenceServers
from prime_rl.orchestrator.teacher import TeacherClient, samples_by_key
from prime_rl.orchestrator.temperature import TemperatureController
from prime_rl.orchestrator.worker import rollout_workers
from prime_rl.utils.bench import Column, format_bench_table
from prime_rl.utils.fs import remove_steps_after
from prime_rl.utils.gc_tuning import freeze_setup_objects
from prime_rl.utils.locks import OutputDirLock
from prime_rl.utils.logging import setup_logging
from prime_rl.utils.loop_lag import LoopLagMonitor
from prime_rl.utils.monitor import Monitor
from prime_rl.utils.processes import SigtermCancels
from prime_rl.utils.secret import take_keys_at_start

SAMPLE_ROWS = 8
"""Rollouts in the samples table of the log extras."""

BENCH_COLUMNS = [
    Column("step", "step", "d"),
    Column("seconds", "time/step", ".2f", summary=True),
    Column("rollouts", "rollouts", "d"),
    Column("rollouts/s", "rollouts_per_s", ".1f", summary=True),
    Column("sampled tok/s", "sampled_tokens_per_s", ".0f", summary=True),
    Column("total tok/s", "tokens_per_s", ".0f", summary=True),
    Column("rollouts s", "time/rollouts", ".2f"),
    Column("batch s", "time/batch", ".3f"),
]
"""`--bench`'s table: step time = waiting for the rollouts (generation and environments) + building the batch
(advantages, samples); with `--bench` nothing waits for or loads weights."""


def load_environments(config: OrchestratorConfig) -> tuple[dict[str, EnvTasks], dict[str, EnvTasks]]:
    """Every environment and its tasks, checked against `seq_len`, and the online evals' (`eval.env`): a failure
    here names the environment and the cause before any server or worker is touched (`rl` runs this too, before it
    starts anything)."""
    tasks = load_tasks(config.env, config.seq_len)
    check_prompts_fit(tasks, config.model, config.seq_len, config.sampling.max_tokens)
    return tasks, load_eval_tasks(config)


def batch_samples(
    groups: list[Group],
    config: OrchestratorConfig,
    baselines: dict[str, float] | None = None,
    rae: dict[str, RaeBaselines] | None = None,
    refs: dict[tuple[int, int, int], list[float]] | None = None,
) -> tuple[list[TrainingSample], list[float], int]:
    """The batch's training samples, the advantage of each of its rollouts in order (one scalar per rollout, on every
    token of its samples), and how many seats had a single rollout (no other rollout to compare with).

    Advantages are computed per group and seat (see `seat_members`; `baselines`: `reinforce_mean`'s running mean per
    environment), then once over the whole batch (`normalize_batch_advantages`). Rollouts without sampled tokens (a
    seat that never had to act) take part in the statistics but yield no sample. Environments of another algorithm
    than `grpo` get theirs from `algorithms.group_advantages` (`rae`: each rae environment's baselines, updated in
    batch order). `refs`: a frozen reference's log-probs of each sample's tokens by (group, rollout, sample) index
    (`score_with_teachers`); such a sample trains its sampled tokens with the `ref_kl` component, not `rl`."""
    rollouts = [(g, r) for g in groups for r in g.rollouts]
    members, per_group, tokens = [], [], []  # per (group, seat): indices into `rollouts`, advantages, loss tokens
    advantages = [0.0] * len(rollouts)
    singletons, offset = 0, 0
    for group in groups:
        algo = config.env_algo(group.env)
        if algo.type not in ESTIMATOR_ALGOS:
            seats, episodes = [r.seat for r in group.rollouts], [r.episode for r in group.rollouts]
            rewards = [r.reward for r in group.rollouts]
            values = group_advantages(algo, seats, episodes, rewards, (rae or {}).get(group.env))
            advantages[offset : offset + len(values)] = values
            offset += len(group.rollouts)
            continue
        for seat in seat_members([r.seat for r in group.rollouts]):
            idx = [offset + i for i in seat]
            rewards = np.array([[rollouts[i][1].reward for i in idx]], dtype=np.float64)
            loss_tokens = [sum(sum(s.loss_mask) for s in rollouts[i][1].samples) for i in idx]
            lengths = np.array([[max(1, n) for n in loss_tokens]])
            baseline = (baselines or {}).get(group.env, 0.0)
            per_group.append(compute_advantages(rewards, lengths, config.advantage, baseline)[0])
            tokens.append(np.array(loss_tokens, dtype=np.float64))
            members.append(idx)
            singletons += len(idx) == 1
        offset += len(group.rollouts)
    for idx, values in zip(members, normalize_batch_advantages(per_group, config.advantage, tokens), strict=True):
        for i, advantage in zip(idx, values.tolist(), strict=True):
            advantages[i] = advantage
    samples = []
    where = [(g, r) for g, group in enumerate(groups) for r in range(len(group.rollouts))]
    for (group, rollout), advantage, (g, r) in zip(rollouts, advantages, where, strict=True):
        masked = config.mask_truncated_completions and rollout.truncated
        algo = config.env_algo(group.env)
        imitated = algo.type == "sft"  # a teacher sampled it: ce on its tokens, no policy
        for i, s in enumerate(rollout.samples):
            versions = sorted({v for v in s.versions if v >= 0}) or [group.start_version]
            mask = [False] * len(s.loss_mask) if masked else s.loss_mask
            ref = (refs or {}).get((g, r, i))
            policy_gradient = ref is None and not imitated
            samples.append(
                TrainingSample(
                    token_ids=s.token_ids,
                    loss_mask=mask if policy_gradient else [False] * len(mask),
                    inference_logprobs=s.logprobs,
                    advantages=[advantage] * len(s.token_ids),
                    # ce fits the policy's plain softmax to the teacher's tokens, whatever temperature it sampled at
                    temperature=1.0
                    if imitated
                    else rollout.temperature or group.temperature or config.sampling.temperature,
                    policy_versions=[] if imitated else versions,
                    reward=rollout.reward,
                    ce_weights=[float(m) for m in mask] if imitated else [] if masked else echo_weights(s, algo),
                    ref_logprobs=ref or [],
                    ref_kl_mask=mask if ref is not None else [],
                )
            )
    return samples, advantages, singletons


async def score_with_teachers(
    groups: list[Group], teachers: dict[str, TeacherClient]
) -> dict[tuple[int, int, int], list[float]]:
    """Each sample of a group of an `opd` environment scored by its environment's teacher (all at once, each teacher
    bounded by its `max_concurrency`): log-probs by (group, rollout, sample) index, as `batch_samples` takes them."""
    found = samples_by_key(groups, teachers)
    scored = await asyncio.gather(*(teachers[group.env].logprobs(sample.token_ids) for _, group, sample in found))
    return {key: logprobs for (key, _, _), logprobs in zip(found, scored, strict=True)}


def teacher_sampler_kl(samples: list[TrainingSample]) -> float | None:
    """Mean of `log mu - log teacher` over the tokens trained towards a teacher (mu: the sampler's log-probs): the
    per-token reverse KL of the policy that sampled the batch, as the orchestrator sees it. None without such tokens."""
    diffs = [
        mu - ref
        for s in samples
        for mu, ref, on in zip(s.inference_logprobs, s.ref_logprobs, s.ref_kl_mask, strict=False)
        if on
    ]
    return statistics.fmean(diffs) if diffs else None


def batch_mean_rewards(groups: list[Group]) -> dict[str, float]:
    """Mean reward of each environment's rollouts in the batch (what `reinforce_mean`'s running mean folds in)."""
    by_env: dict[str, list[float]] = {}
    for group in groups:
        by_env.setdefault(group.env, []).extend(r.reward for r in group.rollouts)
    return {env: statistics.fmean(rewards) for env, rewards in by_env.items()}


def batch_metrics(
    groups: list[Group], step: int, stats: StepStats, seconds: float, collect_seconds: float, urls: list[str]
) -> dict:
    """The step's metrics; `seconds` is the whole step, `collect_seconds` its part in `Scheduler.collect` (waiting
    for weights, swapping them, waiting for rollouts); the rest built the batch."""
    rollouts = [(g, r) for g in groups for r in g.rollouts]
    rewards = [r.reward for _, r in rollouts]
    lengths = [len(s.token_ids) for _, r in rollouts for s in r.samples]
    sampled = [sum(sum(s.loss_mask) for s in r.samples) for _, r in rollouts if r.samples]
    lags = [max(0, step - 1 - g.version) for g, _ in rollouts]  # 0 = on-policy (or fresher than required)
    metrics = {
        "rollouts/untrained": sum(1 for _, r in rollouts if not r.samples),
        "reward/mean": statistics.fmean(rewards),
        "reward/std": statistics.pstdev(rewards),
        "seq_len/mean": statistics.fmean(lengths),
        "seq_len/max": max(lengths),
        "completion_len/mean": statistics.fmean(sampled),
        "truncated_fraction": statistics.fmean(float(r.truncated) for _, r in rollouts),
        "turns/mean": statistics.fmean(r.num_turns for _, r in rollouts),
        "async_lag/max": max(lags),
        "async_lag/mean": statistics.fmean(lags),
        "rollouts": len(rollouts),
        "tokens_per_s": sum(lengths) / seconds,
        "sampled_tokens_per_s": sum(sampled) / seconds,
        "rollouts_per_s": len(rollouts) / seconds,
        "time/step": seconds,
        "time/wait_for_weights": stats.wait_for_weights,
        "time/update_weights": stats.update_weights,
        "time/rollouts": max(
            0.0, collect_seconds - stats.wait_for_weights - stats.update_weights - stats.wait_for_evals
        ),
        "time/wait_for_evals": stats.wait_for_evals,
        "time/batch": seconds - collect_seconds,
        "weight_swaps": stats.swaps,
        "errors": stats.errors,
        "retries": stats.retries,
        "dropped/stale": stats.dropped_stale,
        "dropped/too_long": stats.dropped_too_long,
        "cut_to_seq_len": stats.cut_to_seq_len,
        "dropped/failed": stats.dropped_failed,
        "filtered": stats.filtered,
        "worker_loop_lag/max": stats.worker_loop_lag,
    }
    for i, url in enumerate(urls):
        metrics[f"groups_started/server_{i}"] = stats.groups_per_server.get(url, 0)
    if sampled_by_teachers := sum(n for url, n in stats.groups_per_server.items() if url not in urls):
        metrics["groups_started/teacher"] = sampled_by_teachers  # sft's groups
    metrics["groups_started/gated"] = stats.gated
    metrics["groups_in_flight/peak"] = stats.peak_inflight
    for env in sorted({g.env for g in groups}):
        env_rewards = [r.reward for g, r in rollouts if g.env == env]
        metrics[f"reward/{env}/mean"] = statistics.fmean(env_rewards)
        metrics[f"reward/{env}/std"] = statistics.pstdev(env_rewards)
        metrics[f"rollouts/{env}"] = len(env_rewards)
        seats = sorted({r.seat for g, r in rollouts if g.env == env})
        for seat in seats if len(seats) > 1 else []:
            metrics[f"reward/{env}/{seat}/mean"] = statistics.fmean(
                r.reward for g, r in rollouts if g.env == env and r.seat == seat
            )
    for name in sorted({k for _, r in rollouts for k in r.metrics}):
        values = [r.metrics[name] for _, r in rollouts if name in r.metrics]
        metrics[f"metrics/{name}"] = statistics.fmean(values)
    return metrics


def seat_line(groups: list[Group]) -> str:
    """Each multi-seat environment's mean reward per seat, e.g. `nim first 0.7500 second -0.7500` (a zero-sum
    game's mean over its seats is always 0, which hides that each seat learns); empty without such environments."""
    parts = []
    for env in sorted({g.env for g in groups}):
        seats = seat_rewards([r for g in groups if g.env == env for r in g.rollouts])
        if len(seats) > 1:
            parts.append(" ".join([env, *(f"{seat} {statistics.fmean(v):.4f}" for seat, v in sorted(seats.items()))]))
    return ", ".join(parts)


def log_step(step: int, metrics: dict, monitor: Monitor, seats: str = "") -> None:
    """The step's console line (`seats`: `seat_line` of the batch, shown after the reward) and its metrics."""
    logger.info(
        f"step {step} | reward {metrics['reward/mean']:.4f}{f' ({seats})' if seats else ''} | "
        f"seq {metrics['seq_len/mean']:.0f} | "
        f"{metrics['tokens_per_s']:.0f} tok/s {metrics['rollouts_per_s']:.1f} rollouts/s | "
        f"lag max {metrics['async_lag/max']} mean {metrics['async_lag/mean']:.2f} | "
        f"wait {metrics['time/wait_for_weights']:.2f}s swap {metrics['time/update_weights']:.2f}s | "
        f"errors {metrics['errors']} "
        f"dropped {metrics['dropped/stale'] + metrics['dropped/too_long'] + metrics['dropped/failed']} "
        f"filtered {metrics['filtered']}"
    )
    monitor.log(step, metrics)


def log_extras(
    step: int, groups: list[Group], advantages: list[float], monitor: Monitor, config: LogExtrasConfig
) -> dict[str, float]:
    """A few rollouts spread over the batch as a table, and the batch's distributions (the per-step metrics
    only keep means, which hide a bimodal reward or a long tail of lengths); returns the distributions' summary
    statistics, which go into the step's metrics."""
    rollouts = [(g, r) for g in groups for r in g.rollouts]  # in the order of `advantages`
    if config.samples:
        every = max(1, len(rollouts) // SAMPLE_ROWS)
        rows = [
            [g.env, r.prompt, r.completion, r.reward, a]
            for (g, r), a in list(zip(rollouts, advantages, strict=True))[::every][:SAMPLE_ROWS]
        ]
        monitor.log_table(step, "samples", ["env", "prompt", "completion", "reward", "advantage"], rows)
    summary: dict[str, float] = {}
    if config.distributions:
        summary |= monitor.log_distribution(step, "distribution/reward", [r.reward for _, r in rollouts])
        summary |= monitor.log_distribution(step, "distribution/advantage", advantages)
        seq_lens = [len(s.token_ids) for _, r in rollouts for s in r.samples]
        summary |= monitor.log_distribution(step, "distribution/seq_len", seq_lens)
    return summary


class BenchScheduler(Scheduler):
    """`--bench`: no trainer publishes weights, so the servers keep the weights they serve at start and the async
    bound never applies (every batch may use policy 0, which `InferenceServers.version` says they serve)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.k = sys.maxsize  # min_policy_for(batch, k) == 0 for every batch

    async def ensure_policy(self, batch: int) -> None:
        """Nothing to wait for, nothing to load (a stale `broadcasts/` in the output dir is ignored too)."""


async def orchestrate(config: OrchestratorConfig) -> None:
    output_dir = config.output_dir
    lock = OutputDirLock(output_dir, "orchestrator")  # one orchestrator per output dir, for our whole life
    config.model.renderer_config()  # a bad renderer fails here, before any server or worker is touched
    workers = rollout_workers(config, output_dir / "logs", config.log.level)
    workers.launch()
    lag_task = servers = monitor = None
    teachers: dict[str, TeacherClient] = {}
    distiller: SelfDistiller | None = None
    exit_code = 1
    sigterm = SigtermCancels()  # how `rl` stops us: the cleanup below runs, and main() says "stopped"
    try:
        tasks, eval_tasks = load_environments(config)
        ratios = {e.display_name: e.ratio for e in config.env} if config.env[0].ratio is not None else None
        samplers = {name: config.env_sampler(name) for name in tasks}  # curricula (docs/algorithms.md)
        buffer = Buffer(config.buffer, {name: t.size for name, t in tasks.items()}, ratios, samplers)
        # reinforce_mean's baseline and the temperature scaling keep state across steps (and checkpoints).
        baseline = (
            RunningMean(config.advantage.baseline_decay) if config.advantage.estimator == "reinforce_mean" else None
        )
        temperatures = (
            TemperatureController(config.sampling, list(tasks)) if config.sampling.temperature_scaling else None
        )
        rae = {env: RaeBaselines(algo.decay) for env in tasks if (algo := config.env_algo(env)).type == "rae"}
        teachers = {  # opd's score samples; sft's sample (the scheduler calls them through the workers)
            env: TeacherClient(config.env_teacher(env), config.client.api_key_var)
            for env in tasks
            if config.env_algo(env).type in TEACHER_ALGOS
        }
        scorers = {env: teacher for env, teacher in teachers.items() if config.env_algo(env).type == "opd"}
        distiller = SelfDistiller.for_run(config, tasks)  # opsd: None without such an env; checks demonstrations
        progress = ckpt.Progress()
        resuming = config.ckpt is not None and config.ckpt.resuming
        if resuming:
            step = ckpt.resolve_resume_step(output_dir, config.ckpt.resume_step)
            progress, states = ckpt.load(output_dir, step)
            buffer.load_state_dict(states["buffer"])
            for name, part in (("advantage_baseline", baseline), ("temperature", temperatures)):
                if part is not None and name in states:
                    part.load_state_dict(states[name])
                elif part is not None:
                    logger.warning(f"checkpoint step {step} has no {name} state (saved without it): starting it afresh")
            for env, baselines in rae.items():  # a new rae environment, or one saved by another algorithm: from 0
                if env in states.get("rae_baselines", {}):
                    baselines.load_state_dict(states["rae_baselines"][env])
                    values = ", ".join(f"{seat} {b!r}" for seat, b in sorted(baselines.values.items()))
                    logger.info(f"RAE baselines of {env} restored: {values}")
                else:
                    logger.warning(f"checkpoint step {step} has no RAE baselines of {env}: they start at 0")
            for name, env_tasks in tasks.items():
                if env_tasks.size is None:  # an infinite taskset continues its stream where the checkpoint left it
                    env_tasks.skip(buffer.drawn(name))
            logger.info(f"resuming from step {step}: the next batch is {step + 1}")
        # Batches past the resume step are an earlier life's: a trainer would train them.
        remove_steps_after(Path(output_dir) / "rollouts", progress.step)
        write_resolved_config(config, "orchestrator")  # now: a LoRA trainer takes it as this run (re)starting

        monitor = Monitor(
            output_dir, "orchestrator", config.wandb, config.model_dump(mode="json"), resuming, config.tensorboard
        )
        broadcast = (
            BroadcastClient(config.weight_broadcast, config.stall_timeout)
            if config.weight_broadcast.in_memory
            else None
        )
        client = config.client
        adapter = config.adapter.name if config.adapter is not None else None
        servers = InferenceServers(client.base_url, client.api_key_var, client.timeout, output_dir, broadcast, adapter)
        lag = LoopLagMonitor()
        lag_task = asyncio.create_task(lag.run())
        bench = config.bench is not None
        max_steps = config.bench.steps if bench else config.max_steps
        bench_rows: list[dict] = []
        # Workers load their environments and renderers while the servers start: none of it needs a server.
        await workers.ready()
        logger.info(f"{config.workers} rollout worker(s) ready" if config.workers else "rollouts run in this process")
        frozen = freeze_setup_objects()
        logger.debug(f"{frozen} objects of set-up frozen: no collection walks them again (utils/gc_tuning.py)")
        await servers.wait_healthy()
        if teachers:
            tokenizer = load_tokenizer(config.model.name, trust_remote_code=config.model.trust_remote_code)
            for env, teacher in teachers.items():
                await teacher.wait_healthy()
                await teacher.check_tokenizer(tokenizer)
                logger.info(f"{env}: teacher {teacher.config.name} at {teacher.config.base_url} shares our tokenizer")
        if bench:
            logger.info(f"bench: {max_steps} steps on the weights the servers serve now; no batches, no checkpoints")
        else:
            # A fresh run starts from base weights even on a server reused from an earlier run.
            seconds = await servers.load_policy(progress.step)
            logger.info(f"inference servers serve policy step {progress.step} ({seconds:.2f}s)")
        evals = None
        if config.eval is not None and bench:
            logger.info("bench: online evals off (the table measures training rollouts alone)")
        elif config.eval is not None:
            evals = OnlineEvals(config, eval_tasks, servers, workers, monitor, progress.step if resuming else None)
        scheduler = (BenchScheduler if bench else Scheduler)(
            config, buffer, tasks, servers, workers, temperatures, evals
        )
        while max_steps is None or progress.step < max_steps:
            step = progress.step + 1
            start = time.perf_counter()
            groups = await scheduler.collect(step)
            collect_seconds = time.perf_counter() - start
            baselines = {env: baseline.value(env) for env in tasks} if baseline is not None else None
            scored = time.perf_counter()
            refs = await score_with_teachers(groups, scorers) if scorers else None
            scored = time.perf_counter() - scored
            distilled = time.perf_counter()
            if distiller is not None:  # opsd: the live policy's log-probs under the demonstration hint
                refs = (refs or {}) | await distiller.score(groups, servers)
            distilled = time.perf_counter() - distilled
            samples, advantages, singletons = batch_samples(groups, config, baselines, rae, refs)
            if baseline is not None:
                baseline.update(batch_mean_rewards(groups))
            if not bench:
                write_batch(TrainingBatch(step=step, samples=samples), batch_path(output_dir, step))
            progress = ckpt.Progress(
                step=step,
                tokens=progress.tokens + sum(len(s.token_ids) for s in samples),
                samples=progress.samples + len(samples),
                problems=progress.problems + len(groups),
            )
            seconds = time.perf_counter() - start
            metrics = batch_metrics(groups, step, scheduler.stats, seconds, collect_seconds, servers.urls)
            lag_max, lag_mean = lag.pop()
            metrics.update(
                {"event_loop_lag/max": lag_max, "event_loop_lag/mean": lag_mean, "groups/singleton": singletons}
            )
            metrics.update({f"buffer/{k}": v for k, v in buffer.metrics().items()})
            metrics.update(buffer.curriculum_metrics())
            metrics.update(
                {f"curriculum/{e}/gate_rejected": scheduler.stats.gate_rejected.get(e, 0) for e in scheduler.gates}
            )
            metrics.update(
                {"advantage/mean_abs": statistics.fmean(abs(a) for a in advantages), "policy": servers.version}
            )
            metrics.update({"progress/tokens": progress.tokens, "progress/samples": progress.samples})
            metrics.update(echo_metrics(groups, samples, config))
            if baselines is not None:  # the baseline this batch used
                metrics.update({f"advantage/baseline/{env}": b for env, b in baselines.items()})
            metrics.update({f"rae/{env}/{seat}/baseline": v for env, b in rae.items() for seat, v in b.values.items()})
            if scorers:
                metrics["time/teacher"] = scored
            if distiller is not None:
                metrics["time/self_distill"] = distilled
            if (scorers or distiller is not None) and (kl := teacher_sampler_kl(samples)) is not None:
                metrics["teacher_kl/sampler"] = kl
            if temperatures is not None:
                metrics.update(temperatures.metrics())
            if step % config.log_extras.interval == 0:
                metrics |= log_extras(step, groups, advantages, monitor, config.log_extras)
            log_step(step, metrics, monitor, seat_line(groups))
            if bench:
                bench_rows.append({"step": step, **metrics})
            scheduler.stats = StepStats()
            buffer.reset_step_metrics()
            if not bench and config.ckpt is not None and config.ckpt.due(step, max_steps):
                states = {"buffer": buffer.state_dict()}
                if baseline is not None:
                    states["advantage_baseline"] = baseline.state_dict()
                if temperatures is not None:
                    states["temperature"] = temperatures.state_dict()
                if rae:
                    states["rae_baselines"] = {env: baselines.state_dict() for env, baselines in rae.items()}
                logger.info(f"checkpoint {ckpt.save(output_dir, progress, states, config.ckpt)}")
        if evals is not None and max_steps is not None:
            await scheduler.final_evals(max_steps)
        if bench:
            print(format_bench_table(bench_rows, BENCH_COLUMNS), flush=True)
        exit_code = 0
    finally:
        sigterm.disarm()
        if lag_task is not None:
            lag_task.cancel()
        await workers.close()
        if servers is not None:
            await servers.close(finished=exit_code == 0)
        for teacher in teachers.values():
            await teacher.close()
        if distiller is not None:
            await distiller.close()
        if monitor is not None:
            monitor.close(exit_code)
        lock.release()


def main(argv: list[str] | None = None) -> None:
    take_keys_at_start("orchestrator")  # first: nothing this process starts may inherit the secret (`utils.secret`)
    config, _ = load_config(OrchestratorConfig, "orchestrator", argv)
    setup_logging("orchestrator", config.log.level, config.output_dir / "logs", file_name=config.log.file)
    try:
        asyncio.run(orchestrate(config))
    except KeyboardInterrupt:
        logger.warning("interrupted")
        sys.exit(130)
    except asyncio.CancelledError:  # SIGTERM (how `rl` stops it): rollouts in flight were cancelled and cleaned up
        logger.warning("stopped (SIGTERM)")
        sys.exit(128 + signal.SIGTERM)
    except Exception as e:
        logger.error(f"orchestrator failed: {type(e).__name__}: {e}")
        if config.log.level == "debug":
            logger.exception(e)
        sys.exit(1)


if __name__ == "__main__":
    main()
