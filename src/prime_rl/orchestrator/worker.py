"""Rollout worker processes.

verifiers spends ~20 ms of CPU per model turn (harness HTTP hop, interception server, trace bookkeeping), so a
single process tops out around 45 turns/s. The orchestrator therefore runs rollouts in `workers` spawned
processes and keeps its own event loop for scheduling, weight swaps and batches. Each worker loads every
environment once, serves their interception servers, and runs the groups it is sent concurrently. It turns
finished traces into compact, token-exact samples itself, so only small msgpack messages cross the process
boundary (ZeroMQ DEALER -> the orchestrator's ROUTER).

Per-token policy versions: vLLM reports which weights sampled each token (`weight_versions`), but verifiers
drops that field. The worker wraps `renderers.client.generate` (which verifiers' train client calls per model
turn) to record it, keyed by the trace id verifiers sends as `X-Session-ID`. In adapter mode they are not used:
vLLM labels tokens with the base weights' version whichever adapter sampled them, so the scheduler counts the
group at the policy it was started on.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from prime_rl.orchestrator.envs import load_env
from prime_rl.orchestrator.samples import SampleTokens, expand_version_spans, trace_samples
from prime_rl.utils.loop_lag import LoopLagMonitor

# ---------------------------------------------------------------------------------------------------------
# Messages between the orchestrator and its workers (msgpack, tagged unions).


class RunGroup(msgspec.Struct, tag=True):
    id: int
    env: str
    task: dict[str, Any]
    """The task's `TaskData`, JSON-dumped; the worker rebuilds the task from it (the orchestrator owns the taskset)."""
    n: int
    base_url: str
    model: str | None = None
    """The `model` the group's requests name: the policy it was started on (in adapter mode, the adapter from step 1
    on); None: the config's `model.api_name`."""
    temperature: float | None = None
    """The temperature the group samples at (the orchestrator's temperature scaling); None: `sampling.temperature`.
    A seat that sets its own temperature keeps it."""


class Shutdown(msgspec.Struct, tag=True):
    pass


class RolloutResult(msgspec.Struct):
    """One trace of the policy (a seat's part of an episode): its reward, and its samples if it sampled tokens.

    A trace without samples and without an error (a seat that never had to act) is a rollout like any other for
    rewards and metrics; it is simply not trained on."""

    reward: float
    samples: list[SampleTokens]
    error: str | None = None
    """Why the rollout is excluded from rewards and training (None: fine)."""
    retryable: bool = False
    """The error came from the inference server (connection, 5xx): running the group again may succeed."""
    truncated: bool = False
    metrics: dict[str, float] = {}
    num_turns: int = 0
    prompt: str = ""
    completion: str = ""
    seconds: float = 0.0
    messages: list[dict] | None = None
    """The final branch's conversation as OpenAI chat messages (only when the worker keeps them: `synthesize`)."""
    tools: list[dict] | None = None
    """The tools offered to the model, OpenAI function schemas (with `messages`)."""
    prompt_tokens: int = 0
    """Tokens of the first prompt."""
    completion_tokens: int = 0
    """Tokens the model generated, all turns."""
    seat: str = "agent"
    """The env seat that produced the trace (`agent` for single-agent envs); advantages are computed per seat."""
    episode: int = 0
    """Which episode of its group the trace belongs to (an episode of a multi-agent env has a trace per seat)."""
    temperature: float | None = None
    """The temperature the seat sampled with (a seat may set its own), None where the trace does not say."""


class GroupDone(msgspec.Struct, tag=True):
    id: int
    rollouts: list[RolloutResult]
    loop_lag: float = 0.0
    """Worst event-loop lag (s) this worker saw since its previous message."""


class Ready(msgspec.Struct, tag=True):
    worker: int


class Failed(msgspec.Struct, tag=True):
    worker: int
    message: str


ToWorker = RunGroup | Shutdown
FromWorker = GroupDone | Ready | Failed

# ---------------------------------------------------------------------------------------------------------
# Capture of vLLM's per-token weight versions.

_captured: dict[str, dict[tuple[int, ...], list[int]]] = {}
_response_sink: contextvars.ContextVar[list | None] = contextvars.ContextVar("prime_rl_response_sink", default=None)


def install_version_capture() -> None:
    import renderers.client as rc
    from verifiers.v1.clients.client import SESSION_ID_HEADER

    if getattr(rc.generate, "_prime_rl", False):
        return
    parse, generate = rc.parse_generate_response, rc.generate

    def parse_and_keep(raw):
        data = parse(raw)
        sink = _response_sink.get()
        if sink is not None:
            sink.append(data)
        return data

    async def generate_and_record(*args, **kwargs):
        sink: list = []
        token = _response_sink.set(sink)
        try:
            result = await generate(*args, **kwargs)
        finally:
            _response_sink.reset(token)
        session = (kwargs.get("extra_headers") or {}).get(SESSION_ID_HEADER)
        if session and sink:
            completion = result["completion_ids"]
            spans = (sink[-1].get("choices") or [{}])[0].get("weight_versions")
            _captured.setdefault(session, {})[tuple(completion)] = expand_version_spans(spans, len(completion))
        return result

    generate_and_record._prime_rl = True
    rc.parse_generate_response, rc.generate = parse_and_keep, generate_and_record


def cache_default_factory_signatures() -> None:
    """Memoise pydantic's check whether a field's `default_factory` takes the validated data.

    pydantic 2.14 answers it with `inspect.signature(factory)` on every `model_construct`, uncached, and verifiers
    builds a graph node that way on every model turn; for builtin factories (`list`, `time.time`) the signature is
    parsed from text with `ast`. That was ~12% of a rollout worker's CPU at 256 rollouts in flight. The answer
    depends only on the factory, so caching it changes nothing else.
    """
    from pydantic._internal import _fields

    original = getattr(_fields, "takes_validated_data_argument", None)
    if original is None:  # a pydantic outside the range pyproject pins: run without the speed-up
        logging.getLogger(__name__).warning(
            "pydantic %s has no _fields.takes_validated_data_argument: rollout workers run without its cache",
            _pydantic_version(),
        )
        return
    if getattr(original, "_prime_rl", False):
        return
    cached = functools.lru_cache(maxsize=None)(original)

    def takes_validated_data_argument(default_factory) -> bool:
        try:
            return cached(default_factory)
        except TypeError:  # an unhashable factory: ask pydantic every time, as before
            return original(default_factory)

    takes_validated_data_argument._prime_rl = True
    _fields.takes_validated_data_argument = takes_validated_data_argument


def _pydantic_version() -> str:
    import pydantic

    return pydantic.VERSION


# ---------------------------------------------------------------------------------------------------------
# Traces -> results.


def _error_of(trace) -> tuple[str | None, bool]:
    errors = list(trace.errors or [])
    if not errors and not trace.has_error:
        return None, False
    if not errors:
        return f"stop condition {trace.stop_condition}", False
    first = errors[0]
    retryable = first.type == "ProviderError" and (first.status_code is None or first.status_code >= 500)
    return f"{first.type}: {first.message}"[:500], retryable


def _text(message) -> str:
    content = getattr(message, "content", None)
    return content if isinstance(content, str) else ""


def chat_message(message) -> dict:
    return message.model_dump(mode="json", exclude_none=True) if hasattr(message, "model_dump") else dict(message)


def tool_schema(tool) -> dict:
    function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
    return {"type": "function", "function": function}


def _token_counts(trace, samples: list[SampleTokens]) -> tuple[int, int]:
    """(first prompt, generated) token counts: exact from the samples, else as the server's usage reports them."""
    if samples:
        first = samples[0].loss_mask
        return (first.index(True) if any(first) else 0), sum(sum(s.loss_mask) for s in samples)
    first_call = next((c for c in trace.calls if c.usage is not None), None)
    total = trace.usage
    return (first_call.usage.prompt_tokens if first_call else 0), (total.completion_tokens if total else 0)


def untrainable_sampling(sampling) -> str | None:
    """Why tokens sampled with `sampling` cannot be trained on, or None.

    The trainer scores tokens with the full softmax at the sampling temperature; a seat that sets its own top_p,
    top_k or min_p, or samples greedily, produced tokens from another distribution than the one it is scored on."""
    if sampling is None:
        return None
    extra = sampling.model_extra or {}
    top_k, min_p = extra.get("top_k", -1), extra.get("min_p", 0.0)
    if (sampling.top_p or 1.0) < 1.0 or top_k not in (-1, 0, None) or (min_p or 0.0) > 0.0:
        return f"the seat samples with top_p={sampling.top_p}, top_k={top_k}, min_p={min_p}: not the full softmax"
    if not sampling.temperature:
        return f"the seat samples with temperature={sampling.temperature}: greedy tokens cannot be trained on"
    return None


def rollout_result(
    trace,
    seconds: float,
    keep_messages: bool = False,
    chat_api: bool = False,
    training: bool = False,
    token_versions: bool = True,
) -> RolloutResult:
    """One trace of the policy -> what the orchestrator needs: reward, samples, error state, a little text.

    A trace that sampled no tokens (a seat that never had to act, or any trace on a chat-completions endpoint,
    which returns no token ids) has no samples; that is no error. `training`: refuse traces whose seat sampled
    from another distribution than the trainer scores. `token_versions`: take vLLM's per-token versions (False:
    every sampled token's version is unknown, and the group counts at its start version)."""
    error, retryable = _error_of(trace)
    versions = _captured.pop(trace.id, {})
    if not token_versions:
        versions = {}
    sampling = getattr(trace.agent.config, "sampling", None)
    if error is None and training:
        error = untrainable_sampling(sampling)
    samples = [] if error or chat_api else trace_samples(trace.branches, versions)
    prompt_tokens, completion_tokens = _token_counts(trace, samples)
    metrics = {k: float(v) for k, v in (trace.metrics or {}).items() if isinstance(v, int | float)}
    for name, reward in (trace.rewards or {}).items():
        if reward is not None:
            metrics[f"reward/{name}"] = float(reward.score)
    messages = trace.messages or []
    prompt = next((_text(m) for m in messages if getattr(m, "role", None) == "user"), "")
    return RolloutResult(
        reward=float(trace.reward or 0.0) if not error else 0.0,
        samples=samples,
        error=error,
        retryable=retryable,
        truncated=bool(trace.is_truncated),
        metrics=metrics,
        num_turns=int(trace.num_turns or 0),
        prompt=prompt[:2000],
        completion=(trace.last_reply or "")[:2000],
        seconds=seconds,
        messages=[chat_message(m) for m in messages] if keep_messages else None,
        tools=[tool_schema(t) for t in trace.tools] or None if keep_messages else None,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        seat=trace.agent.name,
        temperature=getattr(sampling, "temperature", None),
    )


def episode_results(episode, seconds: float, **options) -> list[RolloutResult]:
    """The policy's traces of one episode (seats the env made untrainable, e.g. a simulated user, are not the
    policy); `options` go to `rollout_result`."""
    traces = [t for t in episode.traces if getattr(t.agent, "trainable", True)]
    if not traces:
        errors = "; ".join(f"{e.type}: {e.message}" for e in episode.errors) or "episode produced no trace"
        return [RolloutResult(reward=0.0, samples=[], error=errors[:500], seconds=seconds)]
    results = [rollout_result(t, seconds, **options) for t in traces]
    if not episode.ok and episode.errors:
        # An env hook failed after the agents ran (setup/run/finalize): the rewards are not trustworthy.
        message = "; ".join(f"{e.type}: {e.message}" for e in episode.errors)[:500]
        for r in results:
            r.error, r.samples = r.error or message, []
    return results


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
        self.sampling = vf.SamplingConfig(**request_sampling(config.sampling, chat_api))
        self.envs = {e.display_name: load_env(e, config.seq_len) for e in config.env}
        self.result_options = {"keep_messages": keep_messages, "chat_api": chat_api, "training": training}
        if getattr(config, "adapter", None) is not None:
            self.result_options["token_versions"] = False  # vLLM labels adapter tokens with the base's version
        self.loop_lag: LoopLagMonitor | None = None
        """Set by a worker process that watches its event loop; its worst lag goes back with each group."""

    def build_task(self, env_name: str, data: dict):
        env = self.envs[env_name]
        task_cls = type(env.taskset).task_type()
        return task_cls(task_cls.data_type().model_validate(data), env.config.taskset.task)

    async def run_group(self, request: RunGroup) -> GroupDone:
        env = self.envs[request.env]
        task = self.build_task(request.env, request.task)
        model = request.model or self.config.model.api_name
        sampling = self.sampling
        if request.temperature is not None:
            # Every seat's sampling is merged over the context's (verifiers' resolve_agent), so the trace records it.
            sampling = sampling.model_copy(update={"temperature": request.temperature})
        ctx = self.vf.ModelContext(model=model, client=self.clients[request.base_url], sampling=sampling)

        async def one(index: int) -> list[RolloutResult]:
            start = time.perf_counter()
            try:
                episode = await env.run_episode(task, ctx)
                results = episode_results(episode, time.perf_counter() - start, **self.result_options)
            except Exception as e:  # the episode boundary records hook failures; this is a last resort
                results = [RolloutResult(reward=0.0, samples=[], error=f"{type(e).__name__}: {e}"[:500])]
            for result in results:
                result.episode = index
            return results

        groups = await asyncio.gather(*(one(i) for i in range(request.n)))
        lag = self.loop_lag.pop()[0] if self.loop_lag is not None else 0.0
        return GroupDone(id=request.id, rollouts=[r for g in groups for r in g], loop_lag=lag)


async def _serve(config, index: int, address: str) -> None:
    import zmq
    import zmq.asyncio

    from prime_chat import close_shared_client

    context = zmq.asyncio.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(ToWorker)
    try:
        worker = Worker(config, index, training=True)
    except Exception as e:
        await socket.send(encoder.encode(Failed(worker=index, message=str(e))))
        await asyncio.sleep(0.5)  # let zmq flush before the process exits
        raise SystemExit(1) from None
    parent = os.getppid()
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(close_shared_client)  # prime-chat's HTTP pool lives on this loop
        for env in worker.envs.values():
            await stack.enter_async_context(env.serving())
        worker.loop_lag = LoopLagMonitor()
        background = {asyncio.create_task(worker.loop_lag.run())}

        async def run_and_reply(request: RunGroup) -> None:
            await socket.send(encoder.encode(await worker.run_group(request)))

        async def watch_parent() -> None:
            while os.getppid() == parent:  # orphaned (orchestrator killed): exit instead of lingering
                await asyncio.sleep(1.0)
            os._exit(1)

        background.add(asyncio.create_task(watch_parent()))
        await socket.send(encoder.encode(Ready(worker=index)))
        running: set[asyncio.Task] = set()
        while True:
            message = decoder.decode(await socket.recv())
            if isinstance(message, Shutdown):
                break
            task = asyncio.create_task(run_and_reply(message))
            running.add(task)
            task.add_done_callback(running.discard)
        for task in running | background:
            task.cancel()
    socket.close()
    context.term()


def worker_main(config_json: str, index: int, address: str, log_dir: str | None, level: str) -> None:
    """Entry point of a spawned worker process."""
    from prime_rl.orchestrator.config import OrchestratorConfig
    from prime_rl.utils.logging import setup_logging

    config = OrchestratorConfig.model_validate_json(config_json)
    setup_logging(f"orchestrator_worker_{index}", level, Path(log_dir) if log_dir else None, console_level="warning")
    # verifiers logs every rollout and its interception server (aiohttp) every request: file only, and only when
    # debugging (an access line per model turn also cost ~3% of a worker's CPU).
    for name in ("verifiers", "aiohttp.access", "uvicorn.access"):
        logging.getLogger(name).setLevel(logging.DEBUG if level == "debug" else logging.WARNING)
    install_version_capture()
    cache_default_factory_signatures()
    try:
        asyncio.run(_serve(config, index, address))
    except KeyboardInterrupt:
        pass
    sys.exit(0)


# ---------------------------------------------------------------------------------------------------------
# The orchestrator's side: spawn, feed and stop the workers.


class RolloutWorkers:
    """`config.workers` spawned worker processes behind one ZeroMQ ROUTER socket."""

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
        self.processes = [
            spawn.Process(
                target=worker_main,
                args=(config_json, i, f"tcp://127.0.0.1:{port}", str(log_dir) if log_dir else None, level),
                name=f"rollout-worker-{i}",
                daemon=True,
            )
            for i in range(config.workers)
        ]
        self.identities: dict[int, bytes] = {}
        self.pending = {i: 0 for i in range(config.workers)}
        self.owner: dict[int, int] = {}  # group id -> worker index
        self.encoder, self.decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(FromWorker)

    async def start(self, timeout: float = 600.0) -> None:
        """Spawn the workers and wait until each has loaded every environment."""
        for process in self.processes:
            process.start()
        deadline = time.monotonic() + timeout
        while len(self.identities) < len(self.processes):
            self.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"rollout workers not ready after {timeout:.0f}s")
            if not await self.socket.poll(1000):
                continue
            identity, payload = await self.socket.recv_multipart()
            message = self.decoder.decode(payload)
            if isinstance(message, Failed):
                raise RuntimeError(f"rollout worker {message.worker}: {message.message}")
            if isinstance(message, Ready):
                self.identities[message.worker] = identity

    def check_alive(self) -> None:
        for i, process in enumerate(self.processes):
            if process.exitcode is not None:
                raise RuntimeError(f"rollout worker {i} exited with code {process.exitcode} (see its log)")

    async def submit(self, request: RunGroup) -> None:
        worker = min(self.identities, key=lambda i: self.pending[i])
        self.pending[worker] += 1
        self.owner[request.id] = worker
        await self.socket.send_multipart([self.identities[worker], self.encoder.encode(request)])

    async def receive(self, timeout: float) -> GroupDone | None:
        """The next finished group, or None after `timeout` seconds."""
        if not await self.socket.poll(int(timeout * 1000)):
            self.check_alive()
            return None
        _, payload = await self.socket.recv_multipart()
        message = self.decoder.decode(payload)
        if isinstance(message, Failed):
            raise RuntimeError(f"rollout worker {message.worker}: {message.message}")
        if isinstance(message, GroupDone):
            self.pending[self.owner.pop(message.id)] -= 1
            return message
        return None

    async def close(self, grace: float = 5.0) -> None:
        for identity in self.identities.values():
            with contextlib.suppress(Exception):
                await self.socket.send_multipart([identity, self.encoder.encode(Shutdown())])
        deadline = time.monotonic() + grace
        for process in self.processes:
            if process.pid is None:  # never started (the run failed before the workers were needed)
                continue
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(1.0)
        self.socket.close()
        self.context.term()
