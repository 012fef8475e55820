"""Rollouts for `eval` and `synthesize`: the orchestrator's worker code, run in this process, with retries.

The orchestrator's `Worker` loads the environments and turns verifiers traces into results; here it runs in the
same event loop (no trainer is waiting, so there is no loop to keep free). A rollout that failed on the server
(connection refused, 5xx) is run again after `retry_backoff * 2**i` seconds, up to `max_retries` times; after that,
and for every other failure (a reward function raising, a bad request), it is recorded with its error.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from loguru import logger
from tqdm import tqdm

from prime_rl.config.loader import to_toml
from prime_rl.eval.config import RolloutsConfig
from prime_rl.orchestrator.envs import check_prompts_fit, load_tasks
from prime_rl.orchestrator.messages import RolloutResult, RunGroup
from prime_rl.orchestrator.patches import (
    close_pooled_clients,
    install_speed_patches,
)
from prime_rl.orchestrator.worker import Worker, hold_token
from prime_rl.utils.fs import write_atomic
from prime_rl.utils.gc_tuning import freeze_setup_objects
from prime_rl.utils.health import wait_healthy
from prime_rl.utils.processes import Process, SigtermCancels, stop_all
from prime_rl.utils.secret import KEY_VARS, RunKeys, new_secret

BIN = Path(sys.executable).parent
T = TypeVar("T")
P = TypeVar("P")


@dataclass
class Job:
    """All rollouts of one task."""

    env: str
    example_id: int
    task: dict
    n: int
    results: list[RolloutResult] = field(default_factory=list)
    attempts: int = 0


def plan_jobs(config: RolloutsConfig) -> list[Job]:
    """The first `num_examples` tasks of every environment (read lazily: a procedural taskset generates only those),
    `rollouts_per_example` episodes each. Loading the environments here, before any server starts, reports a bad
    environment config at once."""
    limits = {env.display_name: env.num_examples for env in config.env}
    tasks = load_tasks(config.env, config.seq_len, limits)
    for name, env_tasks in tasks.items():
        if env_tasks.size is None:
            raise ValueError(f"environment {name!r} has an infinite taskset: set num_examples")
    check_prompts_fit(tasks, config.model, config.seq_len, config.sampling.max_tokens)
    jobs = []
    for env in config.env:
        selected = tasks[env.display_name].items
        jobs += [Job(env.display_name, i, task, env.rollouts_per_example) for i, task in enumerate(selected)]
    return jobs


@contextlib.asynccontextmanager
async def rollout_worker(config: RolloutsConfig, keep_messages: bool = False) -> AsyncIterator[Worker]:
    """The orchestrator's worker in this process, its environments serving (interception servers, harnesses)."""
    from prime_chat import close_shared_client

    for name in ("verifiers", "aiohttp.access", "uvicorn.access"):
        logging.getLogger(name).setLevel(logging.WARNING)
    install_speed_patches()
    worker = Worker(config, 0, keep_messages, chat_api=config.api == "chat")
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(close_shared_client)
        stack.push_async_callback(close_pooled_clients)
        for env in worker.envs.values():
            await stack.enter_async_context(env.serving())
        freeze_setup_objects()
        yield worker


async def run_jobs(
    worker: Worker,
    jobs: list[Job],
    config: RolloutsConfig,
    description: str,
    on_rollout: Callable[[Job, RolloutResult], None] | None = None,
    model: str | None = None,
) -> float:
    """Run every job to completion (results land in `job.results`), requesting `model` (None: the config's
    `model.api_name`); returns the wall time in seconds.

    A progress bar on stderr counts finished episodes (an episode of a multi-agent env yields a rollout per seat)
    and shows the running mean reward of the rollouts."""
    urls = itertools.cycle(config.client.base_url)
    ids = itertools.count()
    limit = asyncio.Semaphore(config.max_concurrent)
    total = sum(job.n for job in jobs)
    done_rewards: list[float] = []
    bar = tqdm(total=total, desc=description, unit="episode", dynamic_ncols=True, leave=True)

    async def run(job: Job) -> None:
        pending = job.n
        while pending:
            async with limit:
                reply = await worker.run_group(RunGroup(next(ids), job.env, job.task, pending, next(urls), model))
            episodes: dict[int, list[RolloutResult]] = {}
            for result in reply.rollouts:
                episodes.setdefault(result.episode, []).append(result)
            # A retry reruns whole episodes: the seats of an episode are judged together.
            retry = [e for e in episodes.values() if any(r.error and r.retryable for r in e)]
            final = [e for e in episodes.values() if not any(r.error and r.retryable for r in e)]
            if retry and job.attempts < config.max_retries:
                delay = config.retry_backoff * 2**job.attempts
                job.attempts += 1
                error = next(r.error for e in retry for r in e if r.error)
                logger.info(
                    f"{job.env} example {job.example_id}: {len(retry)} episode(s) failed on the server ({error}); "
                    f"retry {job.attempts}/{config.max_retries} in {delay:.0f}s"
                )
                await asyncio.sleep(delay)
            else:
                final += retry
                retry = []
            for result in (r for e in final for r in e):
                job.results.append(result)
                if result.error is None:
                    done_rewards.append(result.reward)
                if on_rollout is not None:
                    on_rollout(job, result)
            bar.update(len(final))
            if done_rewards:
                bar.set_postfix(reward=f"{sum(done_rewards) / len(done_rewards):.3f}", refresh=False)
            pending = len(retry)

    start = time.perf_counter()
    try:
        await asyncio.gather(*(run(job) for job in jobs))
    finally:
        bar.close()
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------------------------------
# Serving the model ourselves.


def start_inference(name: str, config: RolloutsConfig, weight_paths: list[Path]) -> Process:
    """Our inference server on `model.name`, allowed to load `weight_paths`, started (`wait_served` waits for it). Its
    config goes to `{output_dir}/configs/<name>/inference.toml`, named after the command that served it."""
    inference = config.inference
    if inference.allowed_weight_roots is None:
        inference.allowed_weight_roots = sorted({p.resolve().parent for p in weight_paths}) or None
    inference.output_dir = config.output_dir
    launch_dir = config.output_dir / "configs" / name
    cfg = launch_dir / "inference.toml"
    keyless = inference.model_copy(update={"server": inference.server.model_copy(update={"api_key": None})})
    write_atomic(cfg, to_toml(keyless).encode())  # the file would hold the key masked, and a file value beats stdin
    # Its token: the configured API key, else a fresh random one (loopback is no boundary: any local user, or a web
    # page's cross-site request, could otherwise swap its weights). It goes on the server's stdin and into this
    # process's memory; the server takes part in no run's weight transfer, so it gets no store key.
    key = inference.server.api_key
    token = key.get_secret_value() if key is not None else new_secret()
    env = {k: v for k, v in os.environ.items() if k not in KEY_VARS and k != config.client.api_key_var}
    hold_token({config.client.api_key_var: token})
    log_dir = config.output_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    keys = RunKeys(http=token)
    server = Process("inference", [str(BIN / "inference"), "@", str(cfg)], env, log_dir / "inference.out", keys)
    server.start()
    return server


def wait_served(config: RolloutsConfig, server: Process) -> None:
    """Until the server `start_inference` started is healthy (at most `inference_timeout`)."""
    url = config.client.base_url[0].removesuffix("/v1")
    logger.info(f"serving {config.model.name} at {url} (vLLM takes seconds to a few minutes to start on CPU)")
    asyncio.run(wait_healthy([url], config.inference_timeout, process=server, warn_every=120))


def attach_inference(config: RolloutsConfig, weight_paths: list[Path]):
    """The attachable server on `inference.server.port` (`inference/attach.py`), checked to serve `model.name` and to
    be allowed to load `weight_paths`, reset to its base weights; returns the held attachment lock."""
    from prime_rl.inference.attach import AttachError, claim, reset

    card, lock = claim(config.inference.server, config.inference.model, None, weight_paths)
    try:
        before = reset(card)
    except AttachError:
        lock.close()
        raise
    hold_token({config.client.api_key_var: card.http})
    logger.info(f"attached to the inference server at {card.url} (pid {card.pid}; it served {before}, now the base)")
    return lock


async def stoppable(run: Callable[[], Awaitable[T]]) -> T:
    """`run()`, which SIGTERM cancels as Ctrl-C does (the rollouts in flight unwind and verifiers removes their
    working directories) instead of ending the process before any cleanup."""
    sigterm = SigtermCancels()
    try:
        return await run()
    finally:
        sigterm.disarm()


def serve_and_run(
    name: str,
    config: RolloutsConfig,
    weight_paths: list[Path],
    prepare: Callable[[], P],
    run: Callable[[P], Awaitable[T]],
) -> T:
    """Serve the model if `[inference]` asks for it (or attach to a running one: `attach`), run `run(prepare())`, stop
    a server it started. `prepare()` (loading the environments) runs while the server starts, which it takes seconds
    to do: a `ValueError` or `RuntimeError` there is a bad config, one line and exit 2, as is a server that cannot be
    attached to. A failure later is one log line and exit 1 (the log file has the traceback at debug level), Ctrl-C
    exit 130, SIGTERM 143."""
    from prime_rl.inference.attach import AttachError

    server = attached = None
    try:
        try:
            if config.attach:
                attached = attach_inference(config, weight_paths)
            elif config.inference is not None:
                server = start_inference(name, config, weight_paths)
            prepared = prepare()
        except (ValueError, RuntimeError, AttachError) as e:
            print(f"{name}: error: {e}", file=sys.stderr)
            sys.exit(2)
        if server is not None:
            wait_served(config, server)
        return asyncio.run(stoppable(lambda: run(prepared)))
    except KeyboardInterrupt:
        logger.warning("interrupted")
        sys.exit(130)
    except asyncio.CancelledError:
        logger.warning(f"{name} stopped (SIGTERM)")
        sys.exit(143)
    except Exception as e:
        logger.opt(exception=e).debug(f"{name} failed")
        logger.error(f"{name} failed: {type(e).__name__}: {e}")
        sys.exit(1)
    finally:
        if server is not None:
            stop_all([server], grace=15.0)
        if attached is not None:
            attached.close()  # the server stays for the next run
