"""LoRA adapters on the server: loading, replacing and unloading them under a name, in vLLM's name table.

Loading a name that is already loaded replaces the adapter in place (same vLLM adapter id): requests sent afterwards
get the new weights, requests in flight continue on them. The prefix cache is keyed by (name, path), so a new path
never hits KV computed by an earlier adapter; loading a path this name had before resets the prefix cache (its blocks
may hold KV of later adapters, computed for requests that were in flight across a replacement).

A directory is checked (`adapter_checks.check_adapter_dir`) before the engine is asked to load it; this module holds
the state the admin routes change (`admin`: `/load_lora_adapter`, `/unload_lora_adapter`, `GET /weights`).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from loguru import logger

from prime_rl.inference.adapter_checks import check_adapter_dir
from prime_rl.inference.weights import TensorSpec, WeightDirError, clip

ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
"""Names an adapter may be loaded under (the orchestrator's `adapter.name` has the same rule)."""


class AdapterError(Exception):
    """An adapter request refused; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class Adapters:
    """The adapters this server serves, by name; shares vLLM's name table (`OpenAIServingModels.lora_requests`), which
    the OpenAI and generate routes look the requested `model` up in.

    Unloading removes the name only: the engine keeps its copy in its LRU cache (vLLM's own unload does the same), so
    requests still in flight finish on it instead of re-reading a directory that may be gone."""

    def __init__(
        self, engine_client: Any, models: Any, roots: list[Path], base: dict[str, TensorSpec], request_cls: Any = None
    ):
        self.engine, self.models, self.roots, self.base = engine_client, models, roots, base
        if request_cls is None:
            from vllm.lora.request import LoRARequest as request_cls
        self.request_cls = request_cls
        """vLLM's `LoRARequest` (tests of the state machine pass a light stand-in: importing vLLM takes seconds)."""
        self.config = engine_client.vllm_config.lora_config
        """vLLM's LoRA config; None when the server was started without LoRA."""
        self.loaded: dict[str, str] = {}
        """Name -> version label of the adapters loaded through `load` (reported by `GET /weights`)."""
        self.paths: dict[str, set[str]] = {}
        """Every path each name was loaded from in this server's life (a repeat resets the prefix cache)."""
        self.modules: set[str] | None = None
        """Layer names vLLM applies LoRA to in the served model (asked from a worker once); None: unknown."""
        self.lock = asyncio.Lock()

    async def init(self) -> None:
        if self.config is None:
            return
        try:
            found = (await self.engine.collective_rpc("prime_lora_modules"))[0]
            self.modules = set(found) if found else None
        except Exception as e:  # the check is then left to vLLM's loader (a 500 instead of a 422)
            logger.warning(f"could not ask a worker which layers take LoRA: {e}")

    def versions(self) -> dict[str, str]:
        return dict(sorted(self.loaded.items()))

    def _require_enabled(self) -> None:
        if self.config is None:
            raise AdapterError(409, "LoRA adapters are not enabled on this server: start it with [lora] (`--lora`)")

    async def load(self, name: str, lora_path: str, version: str | None) -> tuple[str, float]:
        """Serve the adapter at `lora_path` under `name` (replacing the one loaded under it); returns its version label
        and the seconds the load took."""
        self._require_enabled()
        if self.models.is_base_model(name):
            raise AdapterError(422, f"lora_name {clip(name)!r} is the served base model's name")
        try:
            path = await asyncio.to_thread(
                check_adapter_dir, lora_path, self.roots, self.base, self.config.max_lora_rank, self.modules
            )
        except WeightDirError as e:
            raise AdapterError(e.status, e.message) from None
        version = version or path.name
        async with self.lock:
            current = self.models.lora_requests.get(name)
            capacity = self.config.max_cpu_loras or self.config.max_loras
            if current is None and len(self.models.lora_requests) >= capacity:
                raise AdapterError(
                    409,
                    f"this server holds {len(self.models.lora_requests)} adapters, as many as its cache "
                    f"(vLLM max_cpu_loras, default max_loras) keeps; unload one or raise the limit",
                )
            start = time.perf_counter()
            request = await self._add(name, str(path), current)
            if str(path) in self.paths.get(name, ()):
                # KV cached under this (name, path) may have been computed by a later adapter of the name.
                await self.engine.reset_prefix_cache(reset_running_requests=True)
            self.paths.setdefault(name, set()).add(str(path))
            self.models.lora_requests[name] = request
            self.loaded[name] = version
            seconds = time.perf_counter() - start
        logger.info(f"serving adapter {name} {version} from {path} (load took {seconds:.3f}s)")
        return version, seconds

    async def _add(self, name: str, path: str, current: Any) -> Any:
        """Load into the engine (replacing `current`, keeping its id); returns the request to store. On failure vLLM
        keeps the adapter it had (it loads the new one before dropping the old)."""
        lora_id = current.lora_int_id if current is not None else self.models.lora_id_counter.inc(1)
        try:
            await self.engine.add_lora(self.request_cls(name, lora_id, path, load_inplace=True))
        except Exception as e:
            still = f"still serving {self.loaded[name]}" if name in self.loaded else "nothing loaded"
            raise AdapterError(
                500, f"loading adapter {name} from {path} failed in vLLM ({clip(e, 500)}); {still}"
            ) from e
        # Stored without load_inplace: a request carrying it would make the engine read the directory again.
        return self.request_cls(name, lora_id, path)

    async def unload(self, name: str) -> None:
        self._require_enabled()
        async with self.lock:
            if name not in self.models.lora_requests:
                raise AdapterError(404, f"no adapter named {clip(name)!r} is loaded")
            del self.models.lora_requests[name]
            self.loaded.pop(name, None)
        logger.info(f"unloaded adapter {name}")
