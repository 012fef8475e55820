"""The orchestrator's side of the in-memory weight broadcast: it picks who receives and asks the trainer to send.

Through trainer rank 0's store (protocol in `prime_rl.weight_broadcast`): read the policy step the trainer holds
(`published`), write a request naming the group, wait for the trainer's ack (the step it is about to send), then
tell every receiving server to join and receive, and collect the trainer's own report. A group is kept while its
members stay the same; any change of members, or any failure, starts a new generation at the next transfer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from loguru import logger
from torch.distributed import DistError

from prime_rl.config import WeightBroadcastConfig
from prime_rl.weight_broadcast import (
    ORCHESTRATOR_DONE,
    PUBLISHED,
    SESSION,
    ack_key,
    connect_store,
    get_json,
    reachable,
    request_key,
    served_key,
    set_json,
)

WARN_EVERY = 60.0


class TrainerGone(RuntimeError):
    """The trainer's store stopped answering: the trainer process is gone."""


class BroadcastClient:
    def __init__(self, config: WeightBroadcastConfig, ack_timeout: float):
        config.require_port()
        self.config = config
        self.ack_timeout = ack_timeout
        """Seconds to wait for the trainer to start a transfer (it answers between training steps)."""
        self.store = None
        self.session: str | None = None
        self.generation = 0
        self.members: tuple[str, ...] | None = None
        self.requests = 0
        self.next_connect = 0.0

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.config.port}"

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except DistError as e:
            raise TrainerGone(f"the trainer's weight-broadcast store at {self.address} stopped answering ({e})") from e

    def _connected(self) -> bool:
        if self.store is None and time.monotonic() >= self.next_connect:
            self.next_connect = time.monotonic() + 1.0  # a trainer still starting is looked for once a second
            if not reachable(self.config.host, self.config.port, timeout=0.5):
                return False
            try:
                store = connect_store(self.config.host, self.config.port, self.config.timeout)
            except (ConnectionError, DistError):
                return False  # going down or not yet up: looked for again later
            if store.check([SESSION]):
                self.session, self.store = store.get(SESSION).decode(), store
                logger.info(f"connected to the trainer's weight-broadcast store at {self.address}")
        return self.store is not None

    def published(self) -> int:
        """The policy step the trainer holds and sends when asked; 0 while it is not up yet."""
        if not self._connected() or not self._call(self.store.check, [PUBLISHED]):
            return 0
        return int(self._call(self.store.get, PUBLISHED))

    async def transfer(
        self, targets: list[tuple[str, int]], post: Callable[[str, dict], Awaitable[dict]]
    ) -> tuple[int, list[dict | BaseException]]:
        """Send the trainer's current policy to `targets` ((url, workers) each) through `post(url, body)`, which
        makes one server receive (returning its reply or raising). Returns the step sent and each server's outcome."""
        members = tuple(url for url, _ in targets)
        if members != self.members:
            self.generation += 1
            self.members = members
        world_size = 1 + sum(workers for _, workers in targets)
        self.requests += 1
        i = self.requests
        request = {"generation": self.generation, "world_size": world_size}
        await asyncio.to_thread(self._call, set_json, self.store, request_key(i), request)
        ack = await self._wait(ack_key(i), self.ack_timeout, "the trainer to start sending (it does between steps)")
        step = ack["step"]
        rank, bodies = 1, []
        for _, workers in targets:
            spec = {
                "host": self.config.host, "port": self.config.port, "session": self.session,
                "generation": self.generation, "rank": rank, "world_size": world_size, "backend": self.config.type,
                "timeout": self.config.timeout,
            }  # fmt: skip
            bodies.append({"broadcast": spec, "version": f"step_{step}"})
            rank += workers
        start = time.perf_counter()
        results = await asyncio.gather(
            *(post(url, b) for url, b in zip(members, bodies, strict=True)), return_exceptions=True
        )
        served = await self._wait(served_key(i), self.config.timeout, "the trainer to finish sending")
        if served["error"] is not None or any(isinstance(r, BaseException) for r in results):
            self.members = None  # someone may have left the group broken: the next transfer builds a new one
            logger.warning(f"weight broadcast of policy step {step}: trainer reports {served['error']!r}")
        logger.debug(f"policy step {step} broadcast to {len(members)} server(s) in {time.perf_counter() - start:.3f}s")
        return step, list(results)

    async def _wait(self, key: str, timeout: float, what: str) -> dict:
        start = time.monotonic()
        next_warning = start + WARN_EVERY
        while not await asyncio.to_thread(self._call, self.store.check, [key]):
            now = time.monotonic()
            if now - start > timeout:
                raise TimeoutError(f"waited {now - start:.0f} s for {what} ({key} in {self.address})")
            if now > next_warning:
                logger.warning(f"waiting {now - start:.0f} s for {what}")
                next_warning += WARN_EVERY
            await asyncio.sleep(0.005 if now - start < 1 else 0.05)
        return await asyncio.to_thread(self._call, get_json, self.store, key)

    def finish(self) -> None:
        """Tell the trainer nothing more will be asked for (it stops waiting for its policies to be taken)."""
        try:
            if self._connected():
                self.store.set(ORCHESTRATOR_DONE, "1")
        except Exception as e:  # the trainer may be gone already
            logger.debug(f"could not tell the trainer we are done: {e}")
