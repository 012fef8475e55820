"""Rollout worker processes.

verifiers spends ~20 ms of CPU per model turn (harness HTTP hop, interception server, trace bookkeeping), so a
single process tops out around 45 turns/s. The orchestrator therefore runs rollouts in `workers` spawned
processes and keeps its own event loop for scheduling, weight swaps and batches. Each worker loads every
environment once, serves their interception servers, and runs the groups it is sent concurrently. It turns
finished traces into compact, token-exact samples itself (`results`), so only small msgpack messages (`messages`)
cross the process boundary (ZeroMQ DEALER -> the orchestrator's ROUTER). Each worker process first installs the
library patches of `patches` (capture of vLLM's per-token weight versions; in adapter mode they are not used).

This module holds both ends of that socket: the worker process (`Worker`, which eval also runs in its own process)
and the orchestrator's side (`RolloutWorkers`, or `InProcessWorker` for `workers = 0`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import secrets
import sys
import time
from pathlib import Path

import msgspec
from loguru import logger

from prime_rl.orchestrator.envs import load_env
from prime_rl.orchestrator.messages import (
    Failed,
    FromWorker,
    GroupDone,
    PolicyServed,
    Ready,
    RolloutResult,
    RunGroup,
    Shutdown,
    ToWorker,
)
from prime_rl.orchestrator.patches import (
    GATE_KEY,
    POLICY_GATE,
    close_pooled_clients,
    install_speed_patches,
    install_version_capture,
)
from prime_rl.orchestrator.results import episode_results
from prime_rl.utils.gc_tuning import freeze_setup_objects
from prime_rl.utils.loop_lag import LoopLagMonitor
from prime_rl.utils.processes import SigtermCancels, exit_when_parent_changes
from prime_rl.utils.secret import client_token

# ---------------------------------------------------------------------------------------------------------
# The worker process.


def request_sampling(sampling, chat_api: bool = False) -> dict:
    """The sampling fields of every generation request.

    On the token route every knob that shapes the distribution is sent, neutral where we have no setting: the
    trainer scores tokens with the full softmax at `temperature`, and a server that filled a left-out field
    from the model's generation_config.json (Qwen3's says top_k 20, top_p 0.95), as vLLM's chat route does,
    would sample from another distribution without the logprobs showing it. A chat API gets the OpenAI fields
    only (OpenAI rejects the others); what it leaves out is the server's default.
    """
    fields = {"temperature": sampling.temperature, "top_p": sampling.top_p}
    if not chat_api:
        fields |= {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
    if sampling.max_tokens is not None:
        fields["max_tokens"] = sampling.max_tokens
    if sampling.seed is not None:
        fields["seed"] = sampling.seed
    return fields


class Worker:
    """Runs rollout groups. By default against vLLM's token route (`/inference/v1/generate`, verifiers' train
    client: the chat template is applied here, responses carry token ids and logprobs); with `chat_api`
    against `/v1/chat/completions` of any OpenAI-compatible endpoint (verifiers' eval client: no token ids,
    so nothing to train on; `eval`/`synthesize` only)."""

    def __init__(self, config, index: int, keep_messages: bool = False, chat_api: bool = False, training: bool = False):
        import verifiers.v1 as vf

        self.vf, self.config, self.index = vf, config, index
        client_cls, client_args = vf.EvalClientConfig, {"api_key_var": config.client.api_key_var}
        if not chat_api:
            client_cls = vf.TrainClientConfig
            client_args |= {
                "renderer": config.model.renderer_config(),
                "renderer_model_name": config.model.name,
            }
        self.clients = {url: client_cls(base_url=url, **client_args) for url in config.client.base_url}
        for teacher in sampling_teachers(config):  # `sft`: a frozen teacher samples, through the same token route
            self.clients[teacher.base_url] = client_cls(**(client_args | {"api_key_var": teacher.api_key_var}),
                                                        base_url=teacher.base_url)  # fmt: skip
        # By the name groups give: the training environments and, in the orchestrator, its online evals' (`eval/x`),
        # each with its own sampling; only a training environment's traces are judged for training.
        rollout_envs = config.rollout_envs()
        self.envs = {name: load_env(e.spec, config.seq_len) for name, e in rollout_envs.items()}
        self.sampling = {
            name: vf.SamplingConfig(**request_sampling(e.sampling, chat_api)) for name, e in rollout_envs.items()
        }
        options = {"keep_messages": keep_messages, "chat_api": chat_api}
        if getattr(config, "adapter", None) is not None:
            options["token_versions"] = False  # vLLM labels adapter tokens with the base's version
        self.result_options = {
            name: options | {"training": training and e.training} for name, e in rollout_envs.items()
        }
        self.loop_lag: LoopLagMonitor | None = None
        """Set by a worker process that watches its event loop; its worst lag goes back with each group."""

    async def warm_renderers(self) -> None:
        """Build the renderer the train clients will use (its tokenizer, and transformers with it) before we report
        ready. verifiers builds it on the first rollout, which put seconds of imports into the first batch; the
        worker starts while the servers do, so here they are off the critical path. The pool is verifiers'
        process-wide one, keyed as the clients key it, so their first rollout finds this renderer."""
        from verifiers.v1.clients.train import ElasticRendererPool

        for client in self.clients.values():
            if isinstance(client, self.vf.TrainClientConfig):  # one renderer serves them all: the rest reuse it
                await ElasticRendererPool(
                    client.renderer_model_name, client.renderer, multiplex=client.multiplex
                ).grow()

    def build_task(self, env_name: str, data: dict):
        env = self.envs[env_name]
        task_cls = type(env.taskset).task_type()
        return task_cls(task_cls.data_type().model_validate(data), env.config.taskset.task)

    async def run_group(self, request: RunGroup) -> GroupDone:
        env = self.envs[request.env]
        task = self.build_task(request.env, request.task)
        model = request.model or self.config.model.api_name
        sampling, options = self.sampling[request.env], self.result_options[request.env]
        if request.temperature is not None:
            # Every seat's sampling is merged over the context's (verifiers' resolve_agent), so the trace records it.
            sampling = sampling.model_copy(update={"temperature": request.temperature})
        if request.policy_gate is not None:  # carried to the model call, which waits for the policy (`patches`)
            sampling = sampling.model_copy(update={GATE_KEY: request.policy_gate})
        ctx = self.vf.ModelContext(model=model, client=self.clients[request.base_url], sampling=sampling)

        async def one(index: int) -> list[RolloutResult]:
            start = time.perf_counter()
            try:
                episode = await env.run_episode(task, ctx)
                results = episode_results(episode, time.perf_counter() - start, **options)
            except Exception as e:  # the episode boundary records hook failures; this is a last resort
                results = [RolloutResult(reward=0.0, samples=[], error=f"{type(e).__name__}: {e}"[:500])]
            for result in results:
                result.episode = index
            return results

        groups = await asyncio.gather(*(one(i) for i in range(request.n)))
        lag = self.loop_lag.pop()[0] if self.loop_lag is not None else 0.0
        return GroupDone(id=request.id, rollouts=[r for g in groups for r in g], loop_lag=lag)


@contextlib.asynccontextmanager
async def serving(worker: Worker):
    """A worker's environments served (their interception and tool servers) and its renderer built, on the running
    loop; on exit the servers are stopped and the loop's HTTP pools closed."""
    from prime_chat import close_shared_client

    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(close_shared_client)  # prime-chat's HTTP pool lives on this loop
        stack.push_async_callback(close_pooled_clients)  # and the server clients' pools
        for env in worker.envs.values():
            await stack.enter_async_context(env.serving())
        await worker.warm_renderers()
        yield worker


INTERCEPTION_LOGGER = "verifiers.v1.interception.server"


class LateRequests(logging.Filter):
    """Drops the interception server's "unauthorized request" warning. A group cancelled at shutdown ends its rollouts'
    sessions while a request their harness already sent may still be on its way: the server refuses it (401), as it
    should, and would log one warning per rollout at the end of a run that stops with groups in flight."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "unauthorized request" not in record.getMessage()


@contextlib.contextmanager
def late_requests_refused_quietly():
    """While in flight groups are cancelled: see `LateRequests`. Any other time such a request is worth a warning."""
    quiet = LateRequests()
    logging.getLogger(INTERCEPTION_LOGGER).addFilter(quiet)
    try:
        yield
    finally:
        logging.getLogger(INTERCEPTION_LOGGER).removeFilter(quiet)


def install_worker_patches(level: str) -> None:
    """What every process that runs rollouts sets up once: quiet per-request loggers and the library patches."""
    # verifiers logs every rollout and its interception server (aiohttp) every request: file only, and only when
    # debugging (an access line per model turn also cost ~3% of a worker's CPU).
    for name in ("verifiers", "aiohttp.access", "uvicorn.access"):
        logging.getLogger(name).setLevel(logging.DEBUG if level == "debug" else logging.WARNING)
    install_version_capture()
    install_speed_patches()


async def _serve(config, index: int, address: str, proof: bytes) -> None:
    import zmq
    import zmq.asyncio

    context = zmq.asyncio.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(ToWorker)
    try:
        worker = Worker(config, index, training=True)
    except Exception as e:
        await socket.send(encoder.encode(Failed(worker=index, message=str(e), proof=proof)))
        await asyncio.sleep(0.5)  # let zmq flush before the process exits
        raise SystemExit(1) from None
    parent = os.getppid()
    async with serving(worker):
        worker.loop_lag = LoopLagMonitor()
        background = {asyncio.create_task(worker.loop_lag.run())}

        async def run_and_reply(request: RunGroup) -> None:
            await socket.send(encoder.encode(await worker.run_group(request)))

        exit_when_parent_changes(parent)  # orphaned (orchestrator killed): exit instead of lingering
        freeze_setup_objects()
        await socket.send(encoder.encode(Ready(worker=index, proof=proof)))
        running: set[asyncio.Task] = set()
        sigterm = SigtermCancels()  # SIGTERM reaches us with the orchestrator's process group
        try:
            while True:
                message = decoder.decode(await socket.recv())
                if isinstance(message, Shutdown):
                    break
                if isinstance(message, PolicyServed):
                    POLICY_GATE.advance(message.step)
                    continue
                task = asyncio.create_task(run_and_reply(message))
                running.add(task)
                task.add_done_callback(running.discard)
        finally:  # Shutdown, or SIGTERM: the rollouts in flight end (and clean up) while their servers still run
            sigterm.disarm()
            for task in running | background:
                task.cancel()
            with late_requests_refused_quietly():
                await asyncio.gather(*running, *background, return_exceptions=True)
    socket.close()
    context.term()


def sampling_teachers(config) -> list:
    """The frozen teachers that sample an environment's groups in place of the policy (`sft`); a training
    orchestrator's config only (eval and synthesize have no algorithms)."""
    if not hasattr(config, "env_algo"):
        return []
    return [config.env_teacher(e.display_name) for e in config.env if config.env_algo(e.display_name).type == "sft"]


def worker_tokens(config) -> dict[str, str]:
    """Key variable -> token of every endpoint the rollouts call: the policy servers', and each sampling teacher's
    (`teacher_token`: a teacher of another variable never gets the run's token)."""
    from prime_rl.orchestrator.teacher import teacher_token

    var = config.client.api_key_var
    tokens = {t.api_key_var: teacher_token(t, var) for t in sampling_teachers(config)}
    return {name: token for name, token in (tokens | {var: client_token(var)}).items() if token}


def hold_token(tokens: dict[str, str]) -> None:
    """Where verifiers' clients look for the servers' tokens (they read `api_key_var` from the environment on every
    request), set after this process started: it is not in the block `/proc/<pid>/environ` shows, and verifiers'
    subprocess runtime passes no variable named `*API_KEY*` to the programs it runs (`rl` picks such a name)."""
    os.environ.update(tokens)


def worker_main(
    config_json: str, index: int, address: str, log_dir: str | None, level: str, proof: bytes, tokens: dict[str, str]
) -> None:
    """Entry point of a spawned worker process; `proof`: the orchestrator's channel token (`Ready.proof`), `tokens`:
    the servers' bearer tokens by key variable (spawn arguments: they reach the worker through the spawn pipe, never
    by environment)."""
    from prime_rl.orchestrator.config import OrchestratorConfig
    from prime_rl.utils.logging import setup_logging

    config = OrchestratorConfig.model_validate_json(config_json)
    hold_token(tokens)
    setup_logging(f"orchestrator_worker_{index}", level, Path(log_dir) if log_dir else None, console_level="warning")
    install_worker_patches(level)
    try:
        asyncio.run(_serve(config, index, address, proof))
    except (KeyboardInterrupt, asyncio.CancelledError):  # Ctrl-C, or SIGTERM with the orchestrator's process group
        pass
    sys.exit(0)


# ---------------------------------------------------------------------------------------------------------
# The orchestrator's side: spawn, feed and stop the workers.


class RolloutWorkers:
    """`config.workers` spawned worker processes behind one ZeroMQ ROUTER socket.

    The socket listens on loopback, which any local process reaches, the code a model writes included: a stranger
    could send a finished group of its own making (rewards and tokens the trainer would train on), or a failure that
    ends the run. So a connection counts only once its first message, `Ready` or `Failed`, carries this
    orchestrator's random channel token, which its workers get at spawn; anything else, a message that does not
    parse included, is dropped (and logged, at most once a minute). ZeroMQ names each connection itself and refuses
    a peer's own name that could pass for one of those, so one connection cannot speak for another."""

    def __init__(self, config, log_dir: Path | None, level: str):
        import multiprocessing

        import zmq
        import zmq.asyncio

        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        spawn = multiprocessing.get_context("spawn")
        config_json = config.model_dump_json()
        tokens = worker_tokens(config)
        self.proof = secrets.token_bytes(32)
        address, logs = f"tcp://127.0.0.1:{port}", str(log_dir) if log_dir else None
        self.processes = [
            spawn.Process(
                target=worker_main,
                args=(config_json, i, address, logs, level, self.proof, tokens),
                name=f"rollout-worker-{i}",
                daemon=True,
            )
            for i in range(config.workers)
        ]
        self.identities: dict[int, bytes] = {}
        self.workers: dict[bytes, int] = {}
        """Connection -> worker index, for the connections that proved they are our workers."""
        self.last_warning = 0.0
        self.pending = {i: 0 for i in range(config.workers)}
        self.owner: dict[int, int] = {}  # group id -> worker index
        self.encoder, self.decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(FromWorker)

    def launch(self) -> None:
        """Spawn the workers. Do it early: each imports verifiers and loads every environment (seconds of CPU), which
        overlaps the orchestrator's own set-up and the inference servers' start."""
        for process in self.processes:
            process.start()

    async def ready(self, timeout: float = 600.0) -> None:
        """Wait until each launched worker has loaded every environment."""
        deadline = time.monotonic() + timeout
        while len(self.identities) < len(self.processes):
            self.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"rollout workers not ready after {timeout:.0f}s")
            if not await self.socket.poll(1000):
                continue
            await self._next()

    def check_alive(self) -> None:
        for i, process in enumerate(self.processes):
            if process.exitcode is not None:
                raise RuntimeError(f"rollout worker {i} exited with code {process.exitcode} (see its log)")

    async def submit(self, request: RunGroup) -> None:
        worker = min(self.identities, key=lambda i: self.pending[i])
        self.pending[worker] += 1
        self.owner[request.id] = worker
        await self.socket.send_multipart([self.identities[worker], self.encoder.encode(request)])

    async def policy_served(self, step: int) -> None:
        """Tell every worker the servers serve `step` (after the groups sent before: one socket keeps the order)."""
        for identity in self.identities.values():
            await self.socket.send_multipart([identity, self.encoder.encode(PolicyServed(step))])

    async def receive(self, timeout: float) -> GroupDone | None:
        """The next finished group, or None after `timeout` seconds."""
        if not await self.socket.poll(int(timeout * 1000)):
            self.check_alive()
            return None
        message = await self._next()
        if isinstance(message, GroupDone) and message.id in self.owner:
            self.pending[self.owner.pop(message.id)] -= 1
            return message
        return None

    async def _next(self) -> FromWorker | None:
        """The next message, if it comes from one of our workers (else None, and it is dropped): a connection proves
        itself with its first message (`Ready`, or `Failed` when the worker could not start). A failure ends the
        run."""
        frames = await self.socket.recv_multipart()
        try:
            identity, payload = frames
            message = self.decoder.decode(payload)
        except (ValueError, msgspec.DecodeError):
            return self._stranger(f"a message that does not parse ({len(frames)} frame(s))")
        worker = self.workers.get(identity)
        if worker is None:
            proven = isinstance(message, Ready | Failed) and hmac.compare_digest(message.proof, self.proof)
            if not proven or not 0 <= message.worker < len(self.processes) or message.worker in self.identities:
                return self._stranger(f"a {type(message).__name__} from a connection that is not our worker's")
            worker = message.worker
            if isinstance(message, Ready):
                self.workers[identity], self.identities[worker] = worker, identity
        if isinstance(message, Failed):
            raise RuntimeError(f"rollout worker {worker}: {message.message}")
        return message

    def _stranger(self, what: str) -> None:
        now = time.monotonic()
        if now - self.last_warning > 60:
            self.last_warning = now
            logger.warning(
                f"rollout workers' socket: dropped {what}; some local process is connecting to it (logged once a "
                "minute)"
            )

    async def close(self, grace: float = 5.0) -> None:
        for identity in self.identities.values():
            with contextlib.suppress(Exception):
                await self.socket.send_multipart([identity, self.encoder.encode(Shutdown())])
        deadline = time.monotonic() + grace
        for i, process in enumerate(self.processes):
            if process.pid is None:  # never started (the run failed before the workers were needed)
                continue
            if i in self.identities:  # a ready worker finishes what it has in hand; one still loading has nothing
                process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(1.0)
        self.socket.close()
        self.context.term()


class InProcessWorker:
    """`workers = 0`: the rollouts run on the orchestrator's own event loop, behind `RolloutWorkers`' interface. No
    process to spawn: on a small machine that saves a Python process that imports verifiers and the environments,
    and the seconds of CPU it takes to start; the orchestrator's own work per step is small
    next to the rollouts'. Past one core's worth of rollouts (~45 turns/s), use worker processes."""

    def __init__(self, config, level: str):
        self.config, self.level = config, level
        self.stack = contextlib.AsyncExitStack()
        self.worker: Worker | None = None
        self.finished: asyncio.Queue[GroupDone] = asyncio.Queue()
        self.running: set[asyncio.Task] = set()
        self.failure: BaseException | None = None

    def launch(self) -> None:
        """Nothing to spawn: the environments load in `ready`."""

    async def ready(self) -> None:
        hold_token(worker_tokens(self.config))
        install_worker_patches(self.level)
        POLICY_GATE.reset()  # a process may run several orchestrators in turn (tests do)
        self.worker = Worker(self.config, 0, training=True)
        # Entered (and so exited, in `close`) in the orchestrator's task: the servers' task groups need that.
        await self.stack.enter_async_context(serving(self.worker))

    async def submit(self, request: RunGroup) -> None:
        task = asyncio.create_task(self.worker.run_group(request))
        self.running.add(task)
        task.add_done_callback(self._finished)

    async def policy_served(self, step: int) -> None:
        POLICY_GATE.advance(step)

    def _finished(self, task: asyncio.Task) -> None:
        self.running.discard(task)
        if task.cancelled():
            return
        if task.exception() is not None:  # run_group catches each rollout's errors: this is a bug, end the run
            self.failure = task.exception()
            return
        self.finished.put_nowait(task.result())

    async def receive(self, timeout: float) -> GroupDone | None:
        """The next finished group, or None after `timeout` seconds."""
        if self.failure is not None:
            raise RuntimeError(f"rollouts failed: {type(self.failure).__name__}: {self.failure}")
        try:
            return await asyncio.wait_for(self.finished.get(), timeout)
        except TimeoutError:
            return None

    async def close(self) -> None:
        if self.running:
            logger.info(f"closing: {len(self.running)} group(s) in flight cancelled")
        with late_requests_refused_quietly():
            for task in list(self.running):
                task.cancel()
            await asyncio.gather(*self.running, return_exceptions=True)
            await self.stack.aclose()


def rollout_workers(config, log_dir: Path | None, level: str) -> RolloutWorkers | InProcessWorker:
    """Worker processes, or with `workers = 0` the orchestrator's own loop."""
    return RolloutWorkers(config, log_dir, level) if config.workers > 0 else InProcessWorker(config, level)
