"""`prime-chat`: the in-process chat harness prime-rl uses for tasksets that bring no harness of their own.

verifiers' built-in harnesses run as `uv` scripts in a subprocess per rollout (a process spawn, plus PyPI on
first use). For chat tasks that is pure overhead: this harness makes the model call from the worker's own
event loop with one shared HTTP client, which keeps the per-rollout CPU cost near verifiers' floor.

It is a plain verifiers harness (selected with `harness.id = "prime-chat"`), so it also works outside prime-rl.

Tools: when the run serves MCP tool servers (`mcp_urls`: a task's `toolsets`, a taskset's shared ones) the harness
offers their tools in the request's `tools` and loops: each reply's tool calls run against their server and come
back as `tool` messages, until a reply calls no tool (or verifiers refuses the next turn: `max_turns`, a token cap,
a `@vf.stop`). Tool errors, malformed calls and timeouts (`harness.tool_timeout` per call) are tool results the
model reads, never a failed rollout. The harness never renders tokens: the interception server records each turn
as the sampler saw it, and the assistant message goes back exactly as it came, so the next turn extends the same
branch. A task without tools takes the single-call path, with no MCP client.
"""

import asyncio
import functools
import json

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
    """Close the running loop's pools, chat and MCP (call before the loop ends, or aiohttp warns about an unclosed
    session)."""
    from prime_chat.mcp_tools import close_shared_mcp_http

    client = _clients.pop(asyncio.get_running_loop(), None)
    if client is not None:
        await client.close()
    await close_shared_mcp_http()


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


async def post_chat(endpoint: str, secret: str, body: dict) -> tuple[int, bytes]:
    """POST one chat request to the interception endpoint: (HTTP status, body)."""
    url, headers = endpoint.rstrip("/") + "/chat/completions", {"Authorization": f"Bearer {secret}"}
    async with shared_client().post(url, json=body, headers=headers) as response:
        return response.status, await response.read()  # read in full, so the connection goes back to the pool


def assistant_echo(message: dict) -> dict:
    """A reply as the next request's assistant message: every field as the response had it (None fields dropped),
    so verifiers matches it to the turn it recorded and the next turn extends the same token branch."""
    return {key: value for key, value in message.items() if value is not None}


async def tool_loop(post, model: str, messages: list[dict], tools) -> ProgramResult:
    """Call the model with `tools`, run each reply's tool calls, send their results back; until a reply calls no
    tool or verifiers refuses a turn (a non-2xx answer: the trace holds the stop condition or the error)."""
    while True:
        status, content = await post({"model": model, "messages": messages, "tools": tools.specs})
        if not 200 <= status < 300:
            return ProgramResult(1, "", content.decode(errors="replace"))
        message = json.loads(content)["choices"][0]["message"]
        messages.append(assistant_echo(message))
        calls = message.get("tool_calls") or []
        if not calls:
            return ProgramResult(0, "", "")
        for call in calls:
            function = call.get("function") or {}
            result = await tools.call(function.get("name") or "", function.get("arguments"))
            messages.append({"role": "tool", "tool_call_id": call.get("id") or "", "content": result})


class ChatHarness(vf.Harness[vf.HarnessConfig]):
    """A chat loop made in-process: one call for a task without tools, a tool loop over the run's MCP servers."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, *args, **kwargs) -> ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages = chat_messages(system, prompt)
        if mcp_urls:
            from prime_chat.mcp_tools import McpTools

            config = self.config
            async with McpTools.connect(mcp_urls, config.tool_timeout, config.disabled_tools) as tools:
                return await tool_loop(functools.partial(post_chat, endpoint, secret), ctx.model, messages, tools)
        status, content = await post_chat(endpoint, secret, {"model": ctx.model, "messages": messages})
        # The trace already holds the turn (or the provider error); a non-2xx only needs to end the program.
        if 200 <= status < 300:
            return ProgramResult(0, "", "")
        return ProgramResult(1, "", content.decode(errors="replace"))


__all__ = ["ChatHarness"]
