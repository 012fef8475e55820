"""Waiting for inference servers to be healthy: the one polling loop every launcher, test and the orchestrator use.

`GET /health` answers 200 when the server serves and 503 when it does not, and says no more: it is public. Why it
does not serve is behind the server's token: `GET /weights` names the reason when a failed weight swap could not
restore the previous weights (`unknown`). Such a server is up but must be given weights again before it may serve
(the orchestrator's recovery does that, so it waits for either state; its client holds the token).
"""

from __future__ import annotations

import asyncio
import time

import httpx
from loguru import logger

HEALTHY, WEIGHTS_UNKNOWN, DOWN = "healthy", "weights_unknown", "down"
FAST_POLL, FAST_POLL_SECONDS = 0.1, 60.0
"""Poll every `FAST_POLL` s for the first `FAST_POLL_SECONDS` of a wait, then every second."""


def health_state(response: httpx.Response | None, weights: httpx.Response | None = None) -> str:
    """What one `/health` answer (None: no answer) says about the server; `weights`: its `GET /weights` answer after
    a 503, which only a client holding the token gets."""
    if response is None:
        return DOWN
    if response.status_code == 200:
        return HEALTHY
    if response.status_code == 503 and weights is not None and weights.status_code == 200:
        try:
            if weights.json().get("unknown"):
                return WEIGHTS_UNKNOWN
        except (ValueError, AttributeError):
            pass
    return DOWN


def serves_base_weights(weights: object) -> bool:
    """Whether a server's `GET /weights` answer says it serves its base weights, known (as a fresh server does):
    version `base`, the label `/reload_weights` gives them (`inference/swapper.py`)."""
    return isinstance(weights, dict) and weights.get("version") == "base" and not weights.get("unknown")


async def probe(client: httpx.AsyncClient, url: str) -> str:
    try:
        health = await client.get(f"{url}/health", timeout=5)
        weights = await client.get(f"{url}/weights", timeout=5) if health.status_code == 503 else None
        return health_state(health, weights)
    except httpx.HTTPError:
        return DOWN


async def wait_healthy(
    urls: list[str],
    timeout: float,
    process=None,
    accept: tuple[str, ...] = (HEALTHY,),
    client: httpx.AsyncClient | None = None,
    warn_every: float = 30.0,
) -> dict[str, str]:
    """Poll `{url}/health` (url without `/v1`) until every server is in one of the `accept` states; returns them.

    Warns every `warn_every` seconds naming the servers still waited for; raises `TimeoutError` after `timeout`,
    or `RuntimeError` at once if `process` (the server's `Process`, when we started it) exits."""
    own = client is None
    client = client or httpx.AsyncClient(trust_env=False)
    start = warned = time.monotonic()
    states = dict.fromkeys(urls, DOWN)
    try:
        while True:
            pending = [u for u in urls if states[u] not in accept]
            for url in pending:
                states[url] = await probe(client, url)
            pending = [u for u in urls if states[u] not in accept]
            if not pending:
                return states
            if process is not None and process.poll() is not None:
                raise RuntimeError(
                    f"{process.name} exited with code {process.poll()} before becoming healthy:\n{process.tail()}"
                )
            now = time.monotonic()
            if now - start > timeout:
                tail = f":\n{process.tail()}" if process is not None else ""
                raise TimeoutError(f"inference server(s) {pending} not healthy after {timeout:.0f}s{tail}")
            if now - warned > warn_every:
                logger.warning(f"waiting for inference server(s) {pending} to become healthy ({now - start:.0f}s)")
                warned = now
            # A server starting takes seconds: each poll interval it waits in vain delays the first step.
            interval = FAST_POLL if now - start < FAST_POLL_SECONDS else 1.0
            await asyncio.sleep(min(interval, max(0.05, timeout - (now - start))))
    finally:
        if own:
            await client.aclose()
