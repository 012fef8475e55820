"""The orchestrator's admin view of its inference servers: health, weight swaps, load, recovery.

Generation traffic runs in the rollout workers; this module only sends admin calls, over one small dedicated
connection pool per server, so a weight update never queues behind thousands of generate requests.
All servers always serve the same policy: a swap goes to every server and completes on all before the
orchestrator's `version` moves.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from pathlib import Path

import httpx
from loguru import logger

from prime_rl.utils.health import HEALTHY, WEIGHTS_UNKNOWN, wait_healthy

LOAD_ATTEMPTS = 3
"""Times recovery tries to load the current policy on a server that answers before giving up on it."""


class ServerError(RuntimeError):
    """An admin call failed in a way retrying will not fix (bad weights, wrong key, unreachable for too long)."""


class InferenceServers:
    def __init__(self, base_urls: list[str], api_key_var: str, timeout: float, output_dir: Path):
        self.urls = list(base_urls)
        key = os.environ.get(api_key_var)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        limits = httpx.Limits(max_connections=2, max_keepalive_connections=2)
        self.admin = {
            url: httpx.AsyncClient(base_url=self.root(url), headers=headers, timeout=timeout, limits=limits)
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

    @staticmethod
    def root(url: str) -> str:
        """The server's root URL (admin routes and /health live beside the OpenAI API's /v1)."""
        return url.removesuffix("/v1")

    def weight_dir(self, step: int) -> Path:
        return self.output_dir / "broadcasts" / f"step_{step}"

    def healthy(self) -> list[str]:
        return [url for url in self.urls if url not in self.recovering]

    def least_loaded(self) -> str | None:
        healthy = self.healthy()
        return min(healthy, key=lambda url: self.load[url]) if healthy else None

    async def wait_healthy(self, timeout: float = 1800.0) -> None:
        """Every server answers `/health` with 200 (warnings every 30 s while waiting; fails after `timeout`)."""
        try:
            await asyncio.gather(
                *(wait_healthy([self.root(url)], timeout, client=self.admin[url]) for url in self.urls)
            )
        except TimeoutError as e:
            raise ServerError(f"inference server(s) not healthy after {timeout:.0f}s: {self.urls}") from e

    async def _load_on(self, url: str, step: int) -> float:
        """Load `pi_step` on one server. A 4xx (bad weights, wrong key) raises `ServerError`: retrying cannot help.
        A dropped connection or a 5xx (the server died or failed mid-load) raises `httpx.HTTPError`: recoverable."""
        if step == 0:
            response = await self.admin[url].post("/reload_weights", json={})
        else:
            body = {"weight_dir": str(self.weight_dir(step).resolve()), "version": f"step_{step}"}
            response = await self.admin[url].post("/update_weights", json=body)
        if response.status_code >= 500:
            raise httpx.HTTPStatusError(
                f"{url}: loading policy step {step} failed ({response.status_code}): {response.text[:500]}",
                request=response.request,
                response=response,
            )
        if response.status_code != 200:
            raise ServerError(
                f"{url}: loading policy step {step} failed ({response.status_code}): {response.text[:500]}"
            )
        return float(response.json().get("seconds", 0.0))

    async def load_policy(self, step: int) -> float:
        """Every healthy server serves `pi_step` (0 = base weights) when this returns; the wall time it took.

        A server that fails during the swap (connection lost, 5xx) is taken out of rotation like one that fails
        during generation, and recovery moves it to the new policy before it gets groups again: no group is ever
        sent to a server on another version. Bad weights (4xx) end the run."""
        async with self.lock:
            start = time.perf_counter()
            urls = self.healthy()
            results = await asyncio.gather(*(self._load_on(url, step) for url in urls), return_exceptions=True)
            self.version = step  # recovering servers are moved to it before they serve again
            for url, result in zip(urls, results, strict=True):
                if isinstance(result, ServerError):
                    raise result
                if isinstance(result, httpx.HTTPError):
                    self.mark_failed(url, f"weight swap to policy step {step} failed: {result!r}")
                elif isinstance(result, BaseException):
                    raise result
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

    async def _recover(self, url: str, timeout: float = 1800.0) -> None:
        """Wait until the server answers (healthy, or up with its weights in an unknown state after a failed swap),
        then load the current policy; repeat while loading fails on a transient error."""
        deadline = time.monotonic() + timeout
        try:
            for attempt in itertools.count(1):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ServerError(f"not serving again after {timeout:.0f}s")
                accept = (HEALTHY, WEIGHTS_UNKNOWN)
                await wait_healthy([self.root(url)], remaining, accept=accept, client=self.admin[url])
                try:
                    async with self.lock:  # a swap in progress finishes first, so we load the version it set
                        await self._load_on(url, self.version)
                    break
                except httpx.HTTPError as e:
                    if attempt >= LOAD_ATTEMPTS:  # answering, yet failing to load the same weights: not transient
                        raise ServerError(f"loading policy step {self.version} failed {attempt} times: {e}") from e
                    logger.warning(f"inference server {url}: loading policy step {self.version} failed ({e}); retrying")
                    await asyncio.sleep(1.0)
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
