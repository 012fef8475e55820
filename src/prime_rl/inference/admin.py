"""The admin routes: swap the served weights in place, from a directory or the trainer's broadcast, and load or
unload LoRA adapters.

Routes (every one needs the server's token, see `prime_rl.inference.access`):
  POST /update_weights {"weight_dir": str, "version": str?} -> {"status", "version", "seconds"}
  POST /update_weights {"broadcast": {...}, "version": str?} -> {"status", "version", "step", "seconds"}
  POST /reload_weights (empty body or {})                   -> back to the base model
  POST /load_lora_adapter {"lora_name": str, "lora_path": str, "version": str?}
                                                            -> {"status", "lora_name", "version", "seconds"}
  POST /unload_lora_adapter {"lora_name": str}              -> {"status", "lora_name"}
  GET  /weights                                             -> {"version", "source", "workers", "adapters"}
Status codes: see docs/inference.md, "Swapping weights by hand" and "LoRA adapters".
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from loguru import logger
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from prime_rl.inference.adapters import ADAPTER_NAME_PATTERN, AdapterError, Adapters
from prime_rl.inference.http_io import error_response, parse_request
from prime_rl.inference.swapper import (
    BASE_VERSION,
    WEIGHTS_UNKNOWN,
    BroadcastNotStarted,
    BroadcastRefused,
    BroadcastSpec,
    WeightsUnknownError,
    WeightSwapper,
)
from prime_rl.inference.weights import WeightDirError, check_weight_dir, clip
from prime_rl.weight_broadcast.wire import StoreAuthError, StoreError

VERSION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}$"
"""Version labels: echoed in every generate reply and written to the log, so short and of plain characters only."""
RESERVED_VERSION = f"version {WEIGHTS_UNKNOWN!r} is reserved for weights a failed load left unknown"


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


async def _swap(swapper: WeightSwapper, path: Path, version: str) -> JSONResponse:
    try:
        seconds = await swapper.load_dir(path, version)
    except WeightsUnknownError as e:
        return error_response(503, f"{e}; serving nothing until a load succeeds")
    except Exception as e:
        return error_response(500, f"loading {path} failed ({clip(e)}); still serving {swapper.version}")
    return JSONResponse({"status": "ok", "version": version, "seconds": round(seconds, 4)})


async def _receive(swapper: WeightSwapper, spec: BroadcastSpec, version: str | None) -> JSONResponse:
    """Everything that can be checked is, before anything pauses: the server is set up to receive, the ranks fit,
    and the trainer's store answers (authenticated) and names the session the request names."""
    settings = swapper.broadcast
    if settings is None:
        return error_response(
            409,
            "this server receives no weight broadcasts: start it with --weight-broadcast.type gloo|nccl and the "
            "trainer's --weight-broadcast.host/--weight-broadcast.port (`rl` does)",
        )
    last = spec.rank + swapper.workers - 1
    if last >= spec.world_size:
        return error_response(
            422, f"ranks {spec.rank}..{last} of this server's {swapper.workers} worker(s) exceed world_size"
        )
    try:
        session = await asyncio.to_thread(swapper.trainer_store.session)
    except StoreAuthError as e:
        return error_response(502, f"cannot use the trainer's weight-broadcast store: {clip(e, 500)}")
    except (StoreError, ValueError) as e:
        message = f"the trainer's weight-broadcast store did not answer ({clip(e, 500)})"
        return error_response(502, f"{message}; still serving {swapper.version}")
    if session != spec.session:
        return error_response(409, "the request names another trainer session than the trainer's store: it is stale")
    try:
        seconds, version = await swapper.receive(spec, version)
    except BroadcastRefused as e:
        return error_response(422, f"broadcast refused: {clip(e, 1000)}; still serving {swapper.version}")
    except BroadcastNotStarted as e:
        return error_response(
            502, f"broadcast failed before any weight changed ({clip(e)}); still serving {swapper.version}"
        )
    except WeightsUnknownError as e:
        return error_response(503, f"{e}; serving nothing until a load succeeds")
    except Exception as e:
        return error_response(500, f"receiving the broadcast failed ({clip(e)}); still serving {swapper.version}")
    step = int(version.removeprefix("step_")) if version.removeprefix("step_").isdigit() else None
    return JSONResponse({"status": "ok", "version": version, "step": step, "seconds": round(seconds, 4)})


router = APIRouter()


@router.post("/update_weights")
async def update_weights(request: Request) -> JSONResponse:
    req = await parse_request(request, UpdateWeightsRequest)
    if isinstance(req, JSONResponse):
        return req
    swapper: WeightSwapper = request.app.state.prime_swapper
    if req.broadcast is not None:
        return await _receive(swapper, req.broadcast, req.version)
    try:
        path = await asyncio.to_thread(check_weight_dir, req.weight_dir, swapper.roots, swapper.expected)
    except WeightDirError as e:
        return error_response(e.status, e.message)
    version = req.version or path.name
    if version == WEIGHTS_UNKNOWN:
        return error_response(422, f'{RESERVED_VERSION}: give this directory another "version"')
    if not re.match(VERSION_PATTERN, version):
        return error_response(
            422, 'the directory\'s name is not a valid version label: give a "version" (letters, digits, _.+-)'
        )
    return await _swap(swapper, path, version)


@router.post("/reload_weights")
async def reload_weights(request: Request) -> JSONResponse:
    req = await parse_request(request, ReloadWeightsRequest, empty_ok=True)
    if isinstance(req, JSONResponse):
        return req
    swapper: WeightSwapper = request.app.state.prime_swapper
    return await _swap(swapper, swapper.base_dir, BASE_VERSION)


@router.post("/load_lora_adapter")
async def load_lora_adapter(request: Request) -> JSONResponse:
    req = await parse_request(request, LoadAdapterRequest)
    if isinstance(req, JSONResponse):
        return req
    adapters: Adapters = request.app.state.prime_adapters
    try:
        version, seconds = await adapters.load(req.lora_name, req.lora_path, req.version)
    except AdapterError as e:
        return error_response(e.status, e.message)
    except Exception as e:
        logger.exception(f"loading adapter {req.lora_name} failed")
        return error_response(500, f"loading adapter {req.lora_name} failed ({clip(e)})")
    return JSONResponse({"status": "ok", "lora_name": req.lora_name, "version": version, "seconds": round(seconds, 4)})


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> JSONResponse:
    req = await parse_request(request, UnloadAdapterRequest)
    if isinstance(req, JSONResponse):
        return req
    adapters: Adapters = request.app.state.prime_adapters
    try:
        await adapters.unload(req.lora_name)
    except AdapterError as e:
        return error_response(e.status, e.message)
    return JSONResponse({"status": "ok", "lora_name": req.lora_name})


@router.get("/weights")
async def weights(request: Request) -> JSONResponse:
    """What is served: its version, where it came from, how many workers a broadcast group needs for us, the version
    of each loaded adapter, and why nothing is served when a failed load left the weights unknown (`unknown`; null
    while they are known): what the public `/health` does not say."""
    swapper: WeightSwapper = request.app.state.prime_swapper
    source = None if swapper.unknown else (str(swapper.current_dir) if swapper.current_dir else "broadcast")
    adapters: Adapters = request.app.state.prime_adapters
    return JSONResponse(
        {
            "version": swapper.version,
            "source": source,
            "workers": swapper.workers,
            "adapters": adapters.versions(),
            "unknown": swapper.unknown,
        }
    )
