"""The orchestrator's side of the in-memory weight broadcast: it picks who receives and asks the trainer to send.

Through trainer rank 0's authenticated store (protocol: `prime_rl.weight_broadcast.protocol`): read the policy step
the trainer holds (`published`), write a request naming the group, wait for the trainer's ack (the step it is about
to send), then tell every receiving server to join and receive, and collect the trainer's own report. A group is kept
while its members stay the same; any change of members, or any failure, starts a new group at the next transfer.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Awaitable, Callable

from loguru import logger

from prime_rl.config import WeightBroadcastConfig
from prime_rl.utils.secret import store_key
from prime_rl.weight_broadcast.client import StoreClient
from prime_rl.weight_broadcast.protocol import (
    ORCHESTRATOR_DONE,
    PUBLISHED,
    REQUEST,
    Request,
    ack_key,
    json_object,
    read_session,
    served_key,
)
from prime_rl.weight_broadcast.wire import StoreAuthError, StoreError

WARN_EVERY = 60.0


class TrainerGone(RuntimeError):
    """The trainer's store stopped answering: the trainer process is gone."""


class BroadcastClient:
    def __init__(self, config: WeightBroadcastConfig, ack_timeout: float):
        config.require_port()
        self.config = config
        self.key = store_key("the in-memory weight broadcast (weight_broadcast.type gloo/nccl)")
        self.ack_timeout = ack_timeout
        """Seconds to wait for the trainer to start a transfer (it answers between training steps)."""
        self.id = uuid.uuid4().hex
        """This orchestrator's id: its requests are `<id>-<n>`, so no answer meant for an earlier one is read as ours."""
        self.store: StoreClient | None = None
        self.session: str | None = None
        self.group: str | None = None
        """The current transfer group's id (kept while its members stay the same)."""
        self.members: tuple[str, ...] | None = None
        self.requests = 0
        self.last_served: dict | None = None
        """The trainer's report of the last transfer ({"step", "error"})."""
        self.next_connect = 0.0
        self.connect_lock = threading.Lock()

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.config.port}"

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except StoreAuthError:
            raise
        except StoreError as e:
            raise TrainerGone(f"the trainer's weight-broadcast store at {self.address} stopped answering ({e})") from e

    def _connected(self) -> bool:
        """Connect once the trainer is up (looked for once a second). A store that answers without our run secret
        is an error: waiting would never help. Called in threads (`asyncio.to_thread`): one connects at a time."""
        with self.connect_lock:
            return self._connect()

    def _connect(self) -> bool:
        if self.store is None and time.monotonic() >= self.next_connect:
            self.next_connect = time.monotonic() + 1.0
            try:
                # A short connect (callers run this in a thread), once a second until the trainer is up.
                store = StoreClient(self.config.host, self.config.port, self.key, self.config.timeout, 1.0)
            except StoreAuthError:
                raise
            except StoreError:
                return False  # not up yet, or going down: looked for again later
            try:
                self.session = read_session(store, 1.0)["id"]
                # What an earlier orchestrator left: a request the trainer has not taken, its "done".
                store.delete(REQUEST)
                store.delete(ORCHESTRATOR_DONE)
            except (StoreError, ValueError):
                store.close()
                return False
            self.store = store
            logger.info(f"connected to the trainer's weight-broadcast store at {self.address}")
        return self.store is not None

    def published(self) -> int:
        """The policy step the trainer holds and sends when asked; 0 while it is not up yet."""
        if not self._connected() or not self._call(self.store.check, [PUBLISHED]):
            return 0
        return int(self._call(self.store.get, PUBLISHED, 0.0))

    async def transfer(
        self, targets: list[tuple[str, int]], post: Callable[[str, dict], Awaitable[dict]]
    ) -> tuple[int, list[dict | BaseException]]:
        """Send the trainer's current policy to `targets` ((url, workers) each) through `post(url, body)`, which
        makes one server receive (returning its reply or raising). Returns the step sent and each server's outcome."""
        members = tuple(url for url, _ in targets)
        if members != self.members:
            self.group, self.members = uuid.uuid4().hex, members
        world_size = 1 + sum(workers for _, workers in targets)
        self.requests += 1
        request = Request(f"{self.id}-{self.requests}", self.group, world_size)
        await asyncio.to_thread(self._call, self.store.set, REQUEST, request.encode())
        ack = await self._take(ack_key(request.id), self.ack_timeout, "the trainer to start sending (between steps)")
        step = ack["step"]
        rank, bodies = 1, []
        for _, workers in targets:
            spec = {"session": self.session, "group": self.group, "rank": rank, "world_size": world_size}
            bodies.append({"broadcast": spec, "version": f"step_{step}"})
            rank += workers
        start = time.perf_counter()
        results = await asyncio.gather(
            *(post(url, b) for url, b in zip(members, bodies, strict=True)), return_exceptions=True
        )
        served = self.last_served = await self._take(
            served_key(request.id), self.config.timeout, "the trainer to finish sending"
        )
        if served["error"] is not None or any(isinstance(r, BaseException) for r in results):
            self.members = None  # someone may have left the group broken: the next transfer builds a new one
            logger.warning(f"weight broadcast of policy step {step}: trainer reports {served['error']!r}")
        logger.debug(f"policy step {step} broadcast to {len(members)} server(s) in {time.perf_counter() - start:.3f}s")
        return step, list(results)

    async def _take(self, key: str, timeout: float, what: str) -> dict:
        """The trainer's answer under `key`, deleted once read; polled, so other calls on the connection go on."""
        start = time.monotonic()
        next_warning = start + WARN_EVERY
        while (raw := await asyncio.to_thread(self._call, self.store.take, key)) is None:
            now = time.monotonic()
            if now - start > timeout:
                await asyncio.to_thread(self._call, self.store.delete, REQUEST)  # not taken: must not be served later
                raise TimeoutError(f"waited {now - start:.0f} s for {what} ({key} in the store at {self.address})")
            if now > next_warning:
                logger.warning(f"waiting {now - start:.0f} s for {what}")
                next_warning += WARN_EVERY
            await asyncio.sleep(0.005 if now - start < 1 else 0.05)
        return json_object(raw, key)

    def finish(self) -> None:
        """Tell the trainer nothing more will be asked for (it stops waiting for its policies to be taken). Only an
        orchestrator that completed its run says so: after a crash the trainer keeps waiting for a new one."""
        try:
            if self._connected():
                self.store.set(ORCHESTRATOR_DONE, self.id)
        except (StoreError, TrainerGone) as e:  # the trainer may be gone already
            logger.debug(f"could not tell the trainer we are done: {e}")

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None
