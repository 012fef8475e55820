"""Swapping the served weights in place (`WeightSwapper`), what a broadcast swap receives (`BroadcastSpec`, also the
`broadcast` body of the admin route) and the 503 gate (`WeightsUnknownGate`) for the case where a failed load left
them unknown."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from loguru import logger
from pydantic import BaseModel, ConfigDict, Field

from prime_rl.inference.http_io import error_response
from prime_rl.inference.trainer_store import TrainerStore
from prime_rl.inference.weights import clip, safetensors_specs
from prime_rl.weight_broadcast.protocol import MAX_MEMBERS

BASE_VERSION = "base"
WEIGHTS_UNKNOWN = "weights_unknown"
"""The engine's weight-version label while a failed load could not be undone (`WeightSwapper`)."""
GATED_PREFIXES = ("/v1/", "/inference/")


class WeightsUnknownError(Exception):
    """A load failed and the previous weights could not be restored: what the engine holds is unknown."""


class BroadcastRefused(Exception):
    """The broadcast's tensors do not fit the served model; every member stopped before any weight changed."""


class BroadcastNotStarted(Exception):
    """The broadcast failed before any weight changed (no trainer, a member missing): nothing to restore."""


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
        """The server's `weight_broadcast` settings (type, host, port, timeout, key); None: it receives none."""
        self.trainer_store = TrainerStore(broadcast) if broadcast is not None else None
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
        await self._pause()
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

    async def _pause(self) -> None:
        """Hold the scheduler; requests in flight stay queued and go on with the new weights. vLLM's
        `pause_generation(mode="keep")` does this and then sleeps 20 ms, so that outputs the engine sent before the
        pause reach their callers before it returns. Nothing here needs that order (the engine stamps every output
        with the weight version it was made by), and the sleep was a third of each demo swap (0.047 -> 0.030 s)."""
        await self.engine.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)

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


class WeightsUnknownGate:
    """Pure-ASGI middleware: while `WeightSwapper.unknown` is set, `/health` and the generation routes
    (`/v1/...`, `/inference/...`) answer 503, so the orchestrator sees the server as down and recovers it;
    the admin routes stay open for that. The public `/health` says only that it does not serve: the reason (paths,
    exception text) is for the token's holders (`GET /weights`, and the generation routes' 503, which need it)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        swapper = getattr(getattr(scope.get("app"), "state", None), "prime_swapper", None)
        reason = getattr(swapper, "unknown", None) if scope["type"] == "http" else None
        if reason is not None:
            message = f"the served weights are unknown: {reason}; a successful /update_weights or /reload_weights heals"
            path = scope["path"]
            if path == "/health":
                await error_response(503, "not serving")(scope, receive, send)
                return
            if path.startswith(GATED_PREFIXES):
                await error_response(503, message)(scope, receive, send)
                return
        await self.app(scope, receive, send)
