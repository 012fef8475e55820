"""The orchestrator's admin view of its inference servers: health, weight swaps, load, recovery.

Generation traffic runs in the rollout workers; this module only sends admin calls, over one small dedicated
connection pool per server, so a weight update never queues behind thousands of generate requests.
All servers always serve the same policy: a swap goes to every server and completes on all before the
orchestrator's `version` moves. A policy comes from `broadcasts/step_n/` (the base model for step 0), or, with an
in-memory broadcast, straight from the trainer to every server at once (`broadcast.py`); a server that restarted
then rejoins at a transfer of the trainer's current policy to all servers, unless its policy is on disk.

Adapter mode (`[adapter]`): the policy is a LoRA adapter of the served base model, and several runs may share the
servers, each with its own adapter name. Step n >= 1 is `/load_lora_adapter` of `broadcasts/step_n/` under that name
(replacing the previous step's adapter in place); step 0 is the base model, and our adapter is unloaded. The base
weights are never touched: no `/update_weights` or `/reload_weights`, which would change every run's policy.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path

import httpx
from loguru import logger

from prime_rl.orchestrator.broadcast import BroadcastClient
from prime_rl.orchestrator.concurrency import ServerLoad, parse_load
from prime_rl.utils import net
from prime_rl.utils.health import HEALTHY, WEIGHTS_UNKNOWN, serves_base_weights, wait_healthy
from prime_rl.utils.secret import client_token

LOAD_ATTEMPTS = 3
"""Times recovery tries to load the current policy on a server that answers before giving up on it."""


class ServerError(RuntimeError):
    """An admin call failed in a way retrying will not fix (bad weights, wrong key, unreachable for too long)."""


class InferenceServers:
    def __init__(
        self,
        base_urls: list[str],
        api_key_var: str,
        timeout: float,
        output_dir: Path,
        broadcast: BroadcastClient | None = None,
        adapter: str | None = None,
    ):
        self.urls = list(base_urls)
        self.broadcast = broadcast
        """Set for an in-memory weight broadcast; None: every policy is read from `broadcasts/`."""
        if adapter is not None and broadcast is not None:
            raise ValueError("adapters are loaded from broadcasts/ only, not by an in-memory broadcast")
        self.adapter = adapter
        """Adapter mode: the name our policies (steps >= 1) are loaded under; None: policies are full weights."""
        self.workers: dict[str, int] = {}
        """Workers per server (members of a broadcast group), asked once per server life."""
        key = client_token(api_key_var)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        limits = httpx.Limits(max_connections=2, max_keepalive_connections=2, keepalive_expiry=net.KEEPALIVE_EXPIRY)
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
        """Every server answers `/health` with 200 (warnings every 30 s while waiting; fails after `timeout`). `rl`
        starts the orchestrator while vLLM is still starting, so this is where a run's first wait is."""
        logger.info(f"waiting for inference server(s) {self.urls} to be healthy (at most {timeout:.0f}s)")
        try:
            await asyncio.gather(
                *(wait_healthy([self.root(url)], timeout, client=self.admin[url]) for url in self.urls)
            )
        except TimeoutError as e:
            raise ServerError(f"inference server(s) not healthy after {timeout:.0f}s: {self.urls}") from e

    async def loads(self) -> list[ServerLoad]:
        """Each healthy server's queue and KV-cache usage (its `/metrics`); a server that does not answer in 5 s is
        left out (its health is the recovery's business)."""

        async def one(url: str) -> ServerLoad | None:
            try:
                response = await self.admin[url].get("/metrics", timeout=5.0)
                return parse_load(response.text) if response.status_code == 200 else None
            except httpx.HTTPError:
                return None

        return [load for load in await asyncio.gather(*(one(u) for u in self.healthy())) if load is not None]

    async def _post(self, url: str, route: str, body: dict, what: str) -> dict:
        """An admin POST. A 4xx (bad weights, wrong key) raises `ServerError`: retrying cannot help. A dropped
        connection or a 5xx (the server died or failed mid-load) raises `httpx.HTTPError`: recoverable."""
        response = await self.admin[url].post(route, json=body)
        self._check(url, response, what)
        return response.json()

    @staticmethod
    def _check(url: str, response: httpx.Response, what: str) -> None:
        """Raise for a reply other than 200, as `_post` says."""
        if response.status_code >= 500:
            raise httpx.HTTPStatusError(
                f"{url}: {what} failed ({response.status_code}): {response.text[:500]}",
                request=response.request,
                response=response,
            )
        if response.status_code != 200:
            raise ServerError(f"{url}: {what} failed ({response.status_code}): {response.text[:500]}")

    async def _load_on(self, url: str, step: int) -> float:
        """Load `pi_step` on one server from disk (step 0: its base model)."""
        if self.adapter is not None:
            return await self._load_adapter_on(url, step)
        if step == 0:
            if await self._serves_base(url):
                return 0.0  # a server that just started (or was reset on attach): reading the model again is waste
            reply = await self._post(url, "/reload_weights", {}, "loading policy step 0")
        else:
            body = {"weight_dir": str(self.weight_dir(step).resolve()), "version": f"step_{step}"}
            reply = await self._post(url, "/update_weights", body, f"loading policy step {step}")
        return float(reply.get("seconds", 0.0))

    async def _serves_base(self, url: str) -> bool:
        """Whether the server serves its base weights now (`GET /weights`: version `base`, weights known)."""
        try:
            state = (await self.admin[url].get("/weights")).json()
        except (httpx.HTTPError, ValueError):
            return False
        return serves_base_weights(state)

    async def _load_adapter_on(self, url: str, step: int) -> float:
        """Adapter mode: serve `pi_step` under our adapter name (step 0: requests use the base model, and our adapter,
        perhaps left by an earlier run, is unloaded; not loaded is fine)."""
        if step == 0:
            body = {"lora_name": self.adapter}
            response = await self.admin[url].post("/unload_lora_adapter", json=body)
            if response.status_code == 404:
                return 0.0
            self._check(url, response, f"unloading adapter {self.adapter}")
            return 0.0
        body = {"lora_name": self.adapter, "lora_path": str(self.weight_dir(step).resolve()), "version": f"step_{step}"}
        reply = await self._post(url, "/load_lora_adapter", body, f"loading adapter {self.adapter} step {step}")
        return float(reply.get("seconds", 0.0))

    def model_name(self, step: int, base: str) -> str:
        """What requests name as `model` to be served `pi_step`: our adapter from step 1 on, else the base model."""
        return self.adapter if self.adapter is not None and step > 0 else base

    async def _from_trainer(self, step: int) -> bool:
        """Whether `pi_step` (or newer) comes by broadcast: the trainer holds it and it is not only on disk."""
        return step > 0 and self.broadcast is not None and await asyncio.to_thread(self.broadcast.published) >= step

    async def _broadcast_to(self, urls: list[str]) -> list[tuple[str, BaseException | None]]:
        """One transfer of the trainer's current policy to `urls`; sets `version` to its step. Each server's outcome
        (None: it serves the new policy)."""
        targets, outcomes = [], []
        for url in urls:
            try:
                if url not in self.workers:
                    response = await self.admin[url].get("/weights")
                    response.raise_for_status()
                    self.workers[url] = int(response.json()["workers"])
                targets.append((url, self.workers[url]))
            except httpx.HTTPError as e:
                outcomes.append((url, e))
        if not targets:
            return outcomes

        async def post(url: str, body: dict) -> dict:
            return await self._post(url, "/update_weights", body, "receiving the weight broadcast")

        step, results = await self.broadcast.transfer(targets, post)
        self.version = step
        for (url, _), result in zip(targets, results, strict=True):
            outcomes.append((url, result if isinstance(result, BaseException) else None))
        return outcomes

    async def load_policy(self, step: int, from_disk: bool = False) -> float:
        """Every healthy server serves `pi_step` (0 = base weights), or, by broadcast, the trainer's newer policy
        (`version` says which) when this returns; the wall time it took. `from_disk`: read `broadcasts/step_n/` without
        asking the trainer (its last policy, which it writes and never announces, and may have exited since).

        A server that fails during the swap (connection lost, 5xx) is taken out of rotation like one that fails
        during generation, and recovery moves it to the new policy before it gets groups again: no group is ever
        sent to a server on another version. Bad weights (4xx) end the run."""
        async with self.lock:
            start = time.perf_counter()
            urls = self.healthy()
            if not from_disk and await self._from_trainer(step):
                outcomes = await self._broadcast_to(urls)
            else:
                outcomes = await self._load_all(urls, step)
                self.version = step  # recovering servers are moved to it before they serve again
            self._settle(outcomes)
            seconds = time.perf_counter() - start
        logger.debug(f"servers now serve policy step {self.version} ({seconds:.3f}s)")
        return seconds

    async def _load_all(self, urls: list[str], step: int) -> list[tuple[str, BaseException | None]]:
        """`pi_step` from disk on every one of `urls` at once; each server's outcome (None: it serves it)."""
        results = await asyncio.gather(*(self._load_on(url, step) for url in urls), return_exceptions=True)
        return [(url, r if isinstance(r, BaseException) else None) for url, r in zip(urls, results, strict=True)]

    def mark_failed(self, url: str, reason: str) -> None:
        """A server failed generation requests (restarted, crashed): take it out of rotation until it is healthy
        again and serves the current policy."""
        if url in self.recovering:
            return
        logger.warning(f"inference server {url} failing ({reason}); pausing it until healthy")
        self.recovering[url] = asyncio.create_task(self._recover(url))

    async def _recover(self, url: str, timeout: float = 1800.0) -> None:
        """Wait until the server answers (healthy, or up with its weights in an unknown state after a failed swap),
        then give it the current policy; repeat while that fails on a transient error."""
        deadline = time.monotonic() + timeout
        self.workers.pop(url, None)  # a restarted server may have another layout
        try:
            for attempt in itertools.count(1):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ServerError(f"not serving again after {timeout:.0f}s")
                accept = (HEALTHY, WEIGHTS_UNKNOWN)
                await wait_healthy([self.root(url)], remaining, accept=accept, client=self.admin[url])
                try:
                    async with self.lock:  # a swap in progress finishes first, so we load the version it set
                        await self._catch_up(url)
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

    async def _catch_up(self, url: str) -> None:
        """Give a returning server the policy the others serve: from disk when it is there, else by a broadcast of the
        trainer's current policy, or the newest one on disk, to every healthy server and this one (so all serve the
        same, maybe newer, policy)."""
        on_disk = self.version == 0 or (self.weight_dir(self.version) / "STABLE").exists()
        if on_disk or (self.broadcast is None and self.weight_dir(self.version).exists()):
            await self._load_on(url, self.version)
        elif self.broadcast is not None:
            self._settle(await self._broadcast_to([*self.healthy(), url]), recovering=url)
        else:
            # The trainer pruned the policy the others serve (it keeps only what inference may still need): every
            # server moves to the newest policy, which the async level allows (newer is never too old).
            newest = await self.latest_published()
            logger.warning(f"policy step {self.version} is gone from disk; moving every server to step {newest}")
            outcomes = await self._load_all([*self.healthy(), url], newest)
            self.version = newest
            self._settle(outcomes, recovering=url)

    def _settle(self, outcomes: list[tuple[str, BaseException | None]], recovering: str | None = None) -> None:
        """Act on each server's outcome of a swap (None: it serves `version`). A transient failure (`httpx.HTTPError`:
        connection lost, 5xx) takes that server out of rotation; anything else (a `ServerError`: bad weights, wrong
        key) raises, and so does any failure of `recovering`, the server being caught up (its recovery retries)."""
        for url, result in outcomes:
            if result is None:
                continue
            if url == recovering or not isinstance(result, httpx.HTTPError):
                raise result
            self.mark_failed(url, f"weight swap to policy step {self.version} failed: {result!r}")

    async def latest_published(self) -> int:
        """Newest policy step the trainer published: on disk (`broadcasts/step_n/STABLE`), or held by the trainer for
        a broadcast (0 if none). The store's calls (and connecting to it) run in a thread: however the trainer's
        store answers, the event loop goes on."""
        steps = [
            int(p.parent.name.removeprefix("step_")) for p in (self.output_dir / "broadcasts").glob("step_*/STABLE")
        ]
        in_memory = await asyncio.to_thread(self.broadcast.published) if self.broadcast is not None else 0
        return max(steps + [in_memory], default=0)

    def trainer_error(self) -> str | None:
        """Why a LoRA trainer ended or refused this run (`configs/trainer_error.txt`: its adapter diverged, its config
        is invalid), when it wrote so since this orchestrator wrote its config; an older file is an earlier launch's."""
        configs = self.output_dir / "configs"
        try:
            if (configs / "trainer_error.txt").stat().st_mtime < (configs / "orchestrator.toml").stat().st_mtime:
                return None
            return (configs / "trainer_error.txt").read_text(errors="replace").strip()[:2000]
        except OSError:
            return None

    def where(self, step: int) -> str:
        """Where `pi_step` will appear, for messages."""
        path = self.weight_dir(step) / "STABLE"
        if self.broadcast is None:
            return str(path)
        reached = (
            ""
            if self.broadcast.store is not None
            else ", which does not answer yet: is weight_broadcast.host trainer rank 0's address?"
        )
        return f"{path} or the trainer's weight-broadcast store at {self.broadcast.address}{reached}"

    async def close(self, finished: bool = False) -> None:
        """`finished`: the run completed, so the trainer may stop waiting for its policies to be taken (after a crash
        it goes on waiting, for a restarted orchestrator)."""
        for task in self.recovering.values():
            task.cancel()
        if self.broadcast is not None:
            if finished:
                await asyncio.to_thread(self.broadcast.finish)
            self.broadcast.close()
        await asyncio.gather(*(client.aclose() for client in self.admin.values()))
