"""The orchestrator's admin view of its inference servers: health, weight swaps, load, recovery.

Generation traffic runs in the rollout workers; this module only sends admin calls, over one small dedicated
connection pool per server, so a weight update never queues behind thousands of generate requests.
All servers always serve the same policy: a swap goes to every server and completes on all before the
orchestrator's `version` moves.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import httpx
from loguru import logger


class ServerError(RuntimeError):
    """An admin call failed in a way retrying will not fix (bad weights, wrong key, unreachable for too long)."""


class InferenceServers:
    def __init__(self, base_urls: list[str], api_key_var: str, timeout: float, output_dir: Path):
        self.urls = list(base_urls)
        key = os.environ.get(api_key_var)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        limits = httpx.Limits(max_connections=2, max_keepalive_connections=2)
        self.admin = {
            url: httpx.AsyncClient(base_url=url.removesuffix("/v1"), headers=headers, timeout=timeout, limits=limits)
            for url in self.urls
        }
        self.output_dir = Path(output_dir)
        self.version = 0
        """Policy step every healthy server serves (0 = base weights)."""
        self.load = dict.fromkeys(self.urls, 0)
        """Groups in flight per server."""
        self.recovering: dict[str, asyncio.Task] = {}
        self.fatal: BaseException | None = None
        """Set when a server could not be recovered; the orchestrator stops with it."""
        self.lock = asyncio.Lock()

    def weight_dir(self, step: int) -> Path:
        return self.output_dir / "broadcasts" / f"step_{step}"

    def healthy(self) -> list[str]:
        return [url for url in self.urls if url not in self.recovering]

    def least_loaded(self) -> str | None:
        healthy = self.healthy()
        return min(healthy, key=lambda url: self.load[url]) if healthy else None

    async def wait_healthy(self, urls: list[str] | None = None, timeout: float = 1800.0) -> None:
        """Poll `/health` until every server answers 200; warn every 30 s, fail after `timeout`."""
        start = last_warning = time.monotonic()
        pending = list(urls or self.urls)
        while pending:
            for url in list(pending):
                try:
                    if (await self.admin[url].get("/health", timeout=5)).status_code == 200:
                        pending.remove(url)
                except httpx.HTTPError:
                    pass
            if not pending:
                return
            now = time.monotonic()
            if now - start > timeout:
                raise ServerError(f"inference server(s) {pending} not healthy after {timeout:.0f}s")
            if now - last_warning > 30:
                logger.warning(f"waiting for inference server(s) {pending} to become healthy ({now - start:.0f}s)")
                last_warning = now
            await asyncio.sleep(1.0)

    async def _load_on(self, url: str, step: int) -> float:
        if step == 0:
            response = await self.admin[url].post("/reload_weights", json={})
        else:
            body = {"weight_dir": str(self.weight_dir(step).resolve()), "version": f"step_{step}"}
            response = await self.admin[url].post("/update_weights", json=body)
        if response.status_code != 200:
            raise ServerError(
                f"{url}: loading policy step {step} failed ({response.status_code}): {response.text[:500]}"
            )
        return float(response.json().get("seconds", 0.0))

    async def load_policy(self, step: int) -> float:
        """Every healthy server serves `pi_step` (0 = base weights) when this returns; the wall time it took."""
        async with self.lock:
            start = time.perf_counter()
            urls = self.healthy()
            await asyncio.gather(*(self._load_on(url, step) for url in urls))
            self.version = step
            seconds = time.perf_counter() - start
        logger.debug(f"servers now serve policy step {step} ({seconds:.3f}s)")
        return seconds

    def mark_failed(self, url: str, reason: str) -> None:
        """A server failed generation requests (restarted, crashed): take it out of rotation until it is healthy
        again and serves the current policy."""
        if url in self.recovering:
            return
        logger.warning(f"inference server {url} failing ({reason}); pausing it until healthy")
        self.recovering[url] = asyncio.create_task(self._recover(url))

    async def _recover(self, url: str) -> None:
        try:
            await self.wait_healthy([url])
            async with self.lock:  # a swap in progress finishes first, so we load the version it set
                await self._load_on(url, self.version)
            logger.info(f"inference server {url} back, serving policy step {self.version}")
        except Exception as e:
            self.fatal = ServerError(f"inference server {url} did not recover: {e}")
        finally:
            self.recovering.pop(url, None)

    def latest_stable(self) -> int:
        """Highest step with a published `broadcasts/step_n/STABLE` (0 if none)."""
        steps = [
            int(p.parent.name.removeprefix("step_")) for p in (self.output_dir / "broadcasts").glob("step_*/STABLE")
        ]
        return max(steps, default=0)

    async def close(self) -> None:
        for task in self.recovering.values():
            task.cancel()
        await asyncio.gather(*(client.aclose() for client in self.admin.values()))
