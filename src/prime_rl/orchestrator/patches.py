"""What a rollout worker process patches into the libraries it runs: capture of vLLM's per-token weight versions
(and the policy gate in front of each model call), caches for what verifiers recomputes on every model turn or hook
(a pydantic check, a task's content hash, a hook's signature), aiohttp's connection pool under the client that calls
the server, model calls posted on aiohttp without the OpenAI SDK's request machinery, and tokenizers loaded without
transformers' modeling imports.

Per-token policy versions: vLLM reports which weights sampled each token (`weight_versions`), but verifiers
drops that field. The worker wraps `renderers.client.generate` (which verifiers' train client calls per model
turn) to record it, keyed by the trace id verifiers sends as `X-Session-ID`; `results.rollout_result` takes a trace's
versions with `take_versions`. In adapter mode they are not used: vLLM labels tokens with the base weights' version
whichever adapter sampled them, so the scheduler counts the group at the policy it was started on.

Policy gate: the same wrapper holds a model call whose sampling carries `GATE_KEY` until `POLICY_GATE` says the
servers serve that policy step (the key is taken out of what is sent). The scheduler starts a group for the next
policy while the trainer still trains it: everything before the group's first model call (the task, the runtime,
the program, rendering the prompt) overlaps training instead of following it (docs/orchestrator.md).

Their own module because they patch other packages' functions process-wide, apart from the code that runs rollouts:
`worker_main` installs them all in each worker process, eval's in-process `Worker` all but the versions (it trains
nothing, so it needs none). Each is idempotent and changes nothing else those packages do.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
import types
import weakref

from prime_rl.orchestrator import coalesce
from prime_rl.orchestrator.samples import expand_version_spans
from prime_rl.utils import net

_captured: dict[str, dict[tuple[int, ...], list[int]]] = {}
_pooled_clients: weakref.WeakSet = weakref.WeakSet()
_model_call_posters: dict = {}  # event loop -> _ModelCallPoster (post_generate_on_aiohttp)
_response_sink: contextvars.ContextVar[list | None] = contextvars.ContextVar("prime_rl_response_sink", default=None)

GATE_KEY = "prime_rl_policy_gate"
"""Sampling key of a group started before its policy: the step its model calls wait for (never sent to a server)."""


class PolicyGate:
    """The policy step the servers serve, as the scheduler last said, and the model calls waiting for a newer one.

    One per process (the model calls reach it through a process-wide patch); futures are made on the waiting loop,
    so it outlives loops. A wait ends when the scheduler announces the step, or with the run: the scheduler bounds
    its own wait for the trainer's weights (`stall_timeout`) and a worker process exits with the orchestrator."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Nothing served yet (a run starting in this process)."""
        self.served = -1
        self.waiters: list[tuple[int, asyncio.Future]] = []

    def advance(self, step: int) -> None:
        """The servers now serve `step`: release every call waiting for it or an older one."""
        self.served = max(self.served, step)
        waiting = []
        for gate, future in self.waiters:
            if gate > self.served:
                waiting.append((gate, future))
            elif not future.done():
                future.set_result(None)
        self.waiters = waiting

    async def wait(self, step: int) -> None:
        if step <= self.served:
            return
        future = asyncio.get_running_loop().create_future()
        self.waiters.append((step, future))
        await future


POLICY_GATE = PolicyGate()


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
        sampling = kwargs.get("sampling_params") or {}
        if GATE_KEY in sampling:
            sampling = dict(sampling)
            await POLICY_GATE.wait(sampling.pop(GATE_KEY))
            kwargs["sampling_params"] = sampling
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


def take_versions(trace_id: str) -> dict[tuple[int, ...], list[int]]:
    """The versions captured for a trace's model turns (completion token ids -> each token's version), forgotten
    once taken ({} where none were captured)."""
    return _captured.pop(trace_id, {})


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
            _version("pydantic"),
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


def cache_task_hashes() -> None:
    """Compute a task's content hash once per data object, not on every read.

    verifiers' `Task.hash` dumps the task's data to JSON and hashes it on every read, and an episode reads it four
    times (`key` defaults to it): ~4% of the orchestrator's busy time in the demo (py-spy, 2026-11-28). The data is a
    frozen pydantic model that a task replaces (`with_data`) rather than changes, so the hash is kept on the task with
    the data object it belongs to, and computed again when the task holds another one. Subclasses with their own
    `hash` keep it.
    """
    from verifiers.v1.task import Task

    original = Task.__dict__.get("hash")
    if not isinstance(original, property):  # a verifiers whose Task.hash is not a property: run without the cache
        logging.getLogger(__name__).warning(
            "verifiers %s: Task.hash is not a property, task hashes are not cached", _version("verifiers")
        )
        return
    if getattr(original.fget, "_prime_rl", False):
        return
    compute = original.fget

    def cached_hash(task) -> str:
        data, kept = task.data, getattr(task, "_prime_rl_hash", None)
        if kept is not None and kept[0] is data:
            return kept[1]
        value = compute(task)
        task._prime_rl_hash = (data, value)
        return value

    cached_hash._prime_rl = True
    Task.hash = property(cached_hash, doc=original.__doc__)


class _InspectWithCachedSignatures:
    """`inspect` as verifiers' hook invoker sees it: `signature` read once per function (for a bound method, per
    underlying function: the signature does not depend on the instance); everything else is `inspect`'s."""

    MAX_CACHED = 4096  # hooks are few; a run that makes new functions all the time refills the cache from empty

    def __init__(self) -> None:
        self.signatures: dict[tuple, inspect.Signature] = {}

    def __getattr__(self, name: str):
        return getattr(inspect, name)

    def signature(self, fn) -> inspect.Signature:
        if isinstance(fn, types.MethodType):
            key = (fn.__func__, True)
        elif isinstance(fn, types.FunctionType):
            key = (fn, False)
        else:
            return inspect.signature(fn)
        signature = self.signatures.get(key)
        if signature is None:
            if len(self.signatures) >= self.MAX_CACHED:
                self.signatures.clear()
            signature = self.signatures[key] = inspect.signature(fn)
        return signature


def cache_hook_signatures() -> None:
    """verifiers' `invoke` runs every scoring, stop and lifecycle hook (several per rollout) and parses the hook's
    signature with `inspect.signature` on every call: ~3.7% of the orchestrator's busy time in the demo (py-spy,
    2026-11-28). A function's signature does not change, so the module that holds `invoke` reads it from a cache."""
    from verifiers.v1.utils import decorators

    if isinstance(getattr(decorators, "inspect", None), _InspectWithCachedSignatures):
        return
    if getattr(decorators, "inspect", None) is not inspect:
        logging.getLogger(__name__).warning(
            "verifiers %s: its hook invoker does not read signatures through `inspect`, they are not cached",
            _version("verifiers"),
        )
        return
    decorators.inspect = _InspectWithCachedSignatures()


def _version(distribution: str) -> str:
    """An installed package's version, for the warnings of patches that cannot apply to it."""
    from importlib.metadata import version

    return version(distribution)


def pool_http_clients_on_aiohttp() -> None:
    """Give verifiers' OpenAI clients (the train client that calls the inference server) an aiohttp-backed httpx client.

    Every rollout in flight holds one connection to the server, and httpcore's pool walks all of its connections,
    probing each idle socket, on every request and every response: at 64 rollouts in flight that was ~19% of a
    rollout worker's CPU in the demo's RL stage (py-spy, 2026-11-26), the worker being the busiest process there.
    `httpx_aiohttp` is the transport the OpenAI SDK itself offers for this (`DefaultAioHttpClient`); the client is
    still an `httpx.AsyncClient`, with verifiers' timeout, so nothing else changes. verifiers never closes these
    clients (httpx does not mind; aiohttp warns about an unclosed session at exit): `close_pooled_clients` does.
    An idle connection is dropped after `net.KEEPALIVE_EXPIRY` seconds, before the server would close it.
    """
    import httpx
    import httpx_aiohttp
    from verifiers.v1.clients import base

    if getattr(base.build_async_httpx, "_prime_rl", False):
        return

    limits = httpx.Limits(
        max_connections=base.DEFAULT_LIMITS.max_connections,
        max_keepalive_connections=base.DEFAULT_LIMITS.max_keepalive_connections,
        keepalive_expiry=net.KEEPALIVE_EXPIRY,
    )

    def build_async_httpx(config) -> httpx.AsyncClient:
        timeout = httpx.Timeout(**config.timeout.model_dump())
        client = httpx_aiohttp.HttpxAiohttpClient(timeout=timeout, limits=limits)
        _pooled_clients.add(client)
        return client

    build_async_httpx._prime_rl = True
    base.build_async_httpx = build_async_httpx


async def close_pooled_clients() -> None:
    """Close the clients `pool_http_clients_on_aiohttp` made and the running loop's `_ModelCallPoster` (call before
    the event loop ends)."""
    for client in list(_pooled_clients):
        await client.aclose()
    _pooled_clients.clear()
    if (poster := _model_call_posters.pop(asyncio.get_running_loop(), None)) is not None:
        await poster.close()


class _ModelCallPoster:
    """One event loop's way to the inference server for model calls: an aiohttp pool with no cap on connections (one
    per rollout in flight, as with verifiers' own limits; idle ones dropped after `net.KEEPALIVE_EXPIRY` s, before the
    server would drop them) and the merger of identical calls in front of it (`coalesce`)."""

    def __init__(self) -> None:
        import aiohttp
        from verifiers.v1.clients.client import SESSION_ID_HEADER

        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=net.KEEPALIVE_EXPIRY)
        self.session = aiohttp.ClientSession(connector=connector)
        self.merger = coalesce.Coalescer(self.send, session_header=SESSION_ID_HEADER)

    async def send(self, url: str, data: str, headers: dict[str, str], timeout) -> coalesce.Reply:
        async with self.session.post(url, data=data, headers=headers, timeout=timeout) as response:
            return response.status, response.headers, await response.read()

    async def close(self) -> None:
        """End merged requests still in flight, then the pool."""
        await self.merger.close()
        await self.session.close()

    @staticmethod
    def of_running_loop() -> _ModelCallPoster:
        loop = asyncio.get_running_loop()
        if (poster := _model_call_posters.get(loop)) is None:
            poster = _model_call_posters[loop] = _ModelCallPoster()
        return poster


class DirectGeneratePost:
    """An OpenAI client as `renderers.client.generate` uses it, whose `post` of a raw reply sends the request on
    aiohttp itself: the same URL, JSON body, auth and extra headers, and the same errors (an `APIStatusError` made
    by the client's own mapping, `APIConnectionError`, `APITimeoutError`), without the SDK's request machinery.
    Identical calls in flight together share one request for n samples (`coalesce`). Every other attribute is the
    client's."""

    def __init__(self, client) -> None:
        """Raises AttributeError for an SDK without the (partly private) client attributes this reads."""
        import aiohttp

        self.client = client
        self.prepare_url, self.status_error = client._prepare_url, client._make_status_error_from_response
        timeout = client.timeout  # verifiers' config, which the SDK takes from its http client
        self.timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=timeout.connect, sock_read=timeout.read, connect=timeout.pool
        )
        custom = {key: value for key, value in client._custom_headers.items() if isinstance(value, str)}
        self.headers = {"Accept": "application/json", "Content-Type": "application/json"}
        self.headers |= client.auth_headers | custom

    def __getattr__(self, name: str):
        return getattr(self.client, name)

    async def post(self, path: str, *, cast_to, body, options=None):
        import aiohttp
        import httpx
        import openai

        if cast_to is not httpx.Response or set(options or {}) - {"headers"}:
            return await self.client.post(path, cast_to=cast_to, body=body, options=options or {})
        url = str(self.prepare_url(path))
        headers = self.headers | ((options or {}).get("headers") or {})
        try:
            status, reply_headers, content = await _ModelCallPoster.of_running_loop().merger.post(
                url, body, headers, self.timeout
            )
        except TimeoutError as e:
            raise openai.APITimeoutError(request=httpx.Request("POST", url)) from e
        except aiohttp.ClientError as e:
            raise openai.APIConnectionError(request=httpx.Request("POST", url)) from e
        if status >= 400:  # the whole reply, as the SDK's error mapping reads it (headers, request)
            request = httpx.Request("POST", url)
            raise self.status_error(
                httpx.Response(status, headers=reply_headers.items(), content=content, request=request)
            )
        # Status and body only: all `generate` reads is `.content`, and the headers and request cost ~70 us a call.
        return httpx.Response(status, content=content)


def direct_post_or_false(client) -> DirectGeneratePost | bool:
    try:
        return DirectGeneratePost(client)
    except AttributeError as e:
        logging.getLogger(__name__).warning("openai %s: model calls go through the SDK (%s)", _version("openai"), e)
        return False


def post_generate_on_aiohttp() -> None:
    """Have `renderers.client.generate` (verifiers' train client calls it per model turn) post to the inference
    server through `DirectGeneratePost`. The OpenAI SDK's path for that one POST (request options as pydantic models,
    URL parsing, an httpx request translated to aiohttp and the reply back) cost 1.0-1.2 ms of CPU per model turn,
    aiohttp alone 0.4-0.6 ms (`benchmarks/bench_generate_post.py`), of the ~10 ms a rollout worker spends per
    single-turn rollout. An SDK without the attributes `DirectGeneratePost` reads keeps its own path (a warning)."""
    import renderers.client as rc

    if getattr(rc.generate, "_prime_rl_direct", False):
        return
    generate = rc.generate

    @functools.wraps(generate)
    async def generate_posting_directly(*args, **kwargs):
        client = kwargs.get("client")
        if client is not None and not isinstance(client, DirectGeneratePost):
            if getattr(client, "_provider_runtime", None) is None:  # a plain API key: nothing the SDK must sign
                direct = getattr(client, "_prime_rl_direct_post", None)
                if direct is None:  # one per client (verifiers' interception server owns it, for many rollouts)
                    direct = client._prime_rl_direct_post = direct_post_or_false(client)
                if direct:
                    kwargs["client"] = direct
        return await generate(*args, **kwargs)

    generate_posting_directly._prime_rl_direct = True
    rc.generate = generate_posting_directly


def install_speed_patches() -> None:
    """The patches that only make running rollouts cheaper (every one but the version capture), installed once by
    every process that runs rollouts: rollout workers, the orchestrator's in-process worker, eval and synthesize."""
    cache_default_factory_signatures()
    cache_hook_signatures()
    cache_task_hashes()
    pool_http_clients_on_aiohttp()
    post_generate_on_aiohttp()
    load_tokenizers_lightly()


def load_tokenizers_lightly() -> None:
    """Have renderers load a tokenizer with `models.tokenizers.load_tokenizer`: the class `AutoTokenizer` would pick,
    without importing transformers' modeling stack where the directory says which (~120 MiB less per process)."""
    import renderers.base as rb

    from prime_rl.models.tokenizers import load_tokenizer

    if getattr(rb._load_tokenizer_via_auto, "_prime_rl", False):
        return
    load = functools.partial(load_tokenizer, fallback=rb._load_tokenizer_via_auto)  # renderers' own, with its fallbacks
    load._prime_rl = True
    rb._load_tokenizer_via_auto = load
