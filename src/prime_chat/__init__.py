"""`prime-chat`: the in-process chat harness prime-rl uses for tasksets that bring no harness of their own.

verifiers' built-in harnesses run as `uv` scripts in a subprocess per rollout (a process spawn, plus PyPI on
first use). For chat tasks that is pure overhead: this harness makes the model call from the worker's own
event loop with one shared HTTP client, which keeps the per-rollout CPU cost near verifiers' floor.

It is a plain verifiers harness (selected with `harness.id = "prime-chat"`), so it also works outside prime-rl.
"""

import asyncio

import httpx
import verifiers.v1 as vf
from verifiers.v1.runtimes import ProgramResult

_clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}


def shared_client() -> httpx.AsyncClient:
    """One connection pool per event loop: building a client costs milliseconds (TLS context, pools)."""
    loop = asyncio.get_running_loop()
    client = _clients.get(loop)
    if client is None or client.is_closed:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        client = _clients[loop] = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits)
    return client


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
        response = await shared_client().post(
            endpoint.rstrip("/") + "/chat/completions", json=body, headers={"Authorization": f"Bearer {secret}"}
        )
        # The trace already holds the turn (or the provider error); a non-2xx only needs to end the program.
        return ProgramResult(0 if response.is_success else 1, "", response.text if not response.is_success else "")


__all__ = ["ChatHarness"]
