"""`prime-chat`: the in-process chat harness prime-rl uses for tasksets that bring no harness of their own.

verifiers' built-in harnesses run as `uv` scripts in a subprocess per rollout (a process spawn, plus PyPI on
first use). For chat tasks that is pure overhead: this harness makes the model call from the worker's own
event loop with one shared HTTP client, which keeps the per-rollout CPU cost near verifiers' floor.

It is a plain verifiers harness (selected with `harness.id = "prime-chat"`), so it also works outside prime-rl.
"""

import asyncio

import aiohttp
import verifiers.v1 as vf
from verifiers.v1.runtimes import ProgramResult

_clients: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}


def shared_client() -> aiohttp.ClientSession:
    """One connection pool per event loop: building a client costs milliseconds (TLS context, pools).

    aiohttp rather than httpx: every rollout holds one connection to the interception server for its whole model
    call, and httpcore's pool walks all its connections (and probes each idle socket) on every request and every
    response, so with hundreds of rollouts in flight an httpx call cost ~20 ms of CPU, about a third of a rollout
    worker's time (measured at 256 in flight); aiohttp's pool takes ~0.5 ms."""
    loop = asyncio.get_running_loop()
    client = _clients.get(loop)
    if client is None or client.closed:
        connector = aiohttp.TCPConnector(limit=0)  # no cap: one connection per rollout in flight
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0)
        client = _clients[loop] = aiohttp.ClientSession(connector=connector, timeout=timeout)
    return client


async def close_shared_client() -> None:
    """Close the running loop's pool (call before the loop ends, or aiohttp warns about an unclosed session)."""
    client = _clients.pop(asyncio.get_running_loop(), None)
    if client is not None:
        await client.close()


def as_wire(message) -> dict:
    """A typed verifiers message or a plain dict, as OpenAI chat JSON."""
    if isinstance(message, dict):
        return message
    return message.model_dump(mode="json", exclude_none=True)


def chat_messages(system: str | None, prompt) -> list[dict]:
    messages = [{"role": "system", "content": system}] if system else []
    if isinstance(prompt, str):
        return messages + [{"role": "user", "content": prompt}]
    return messages + [as_wire(m) for m in prompt or []]


class ChatHarness(vf.Harness[vf.HarnessConfig]):
    """One chat-completion call on the task's prompt, made in-process."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, *args, **kwargs) -> ProgramResult:
        system, prompt = self.resolve_prompt(data)
        body = {"model": ctx.model, "messages": chat_messages(system, prompt)}
        url, headers = endpoint.rstrip("/") + "/chat/completions", {"Authorization": f"Bearer {secret}"}
        async with shared_client().post(url, json=body, headers=headers) as response:
            content = await response.read()  # read in full, so the connection goes back to the pool
        # The trace already holds the turn (or the provider error); a non-2xx only needs to end the program.
        if 200 <= response.status < 300:
            return ProgramResult(0, "", "")
        return ProgramResult(1, "", content.decode(errors="replace"))


__all__ = ["ChatHarness"]
