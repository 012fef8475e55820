"""The MCP tool servers of one prime-chat rollout: connect, list their tools in OpenAI function format, call them.

A rollout gets `mcp_urls` (`{server name: streamable-HTTP URL}`) from verifiers: task-scoped servers started for
this rollout and worker-shared ones that every rollout of the worker reaches (their URL carries this rollout's
state route). We open one MCP client per server for the rollout, over one HTTP pool per event loop, and name each
tool `<server>_<tool>` (bare when the server's name is empty), exactly as verifiers' own `null`/`bash` harnesses
do, so an environment sees the same tool names whichever of them runs it.

Nothing the model does can crash the rollout: a call to an unknown tool, arguments that are not a JSON object, a
tool that reports an error (`isError`), raises, or runs past `timeout` all come back as an `Error: ...` text, which
the harness sends to the model as the tool's result. Only a server that cannot be reached or listed is an error of
the rollout (the environment is broken, not the model).
"""

from __future__ import annotations

import asyncio
import json
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

_pools: dict[asyncio.AbstractEventLoop, Any] = {}

ERROR_PREFIX = "Error: "


def shared_mcp_http():
    """One httpx2 pool per event loop for every MCP client of every rollout (a new client per rollout would build a
    TLS context each time, ~20 ms of CPU). The MCP SDK leaves a pool it was handed open."""
    import httpx2

    loop = asyncio.get_running_loop()
    pool = _pools.get(loop)
    if pool is None or pool.is_closed:
        # Read timeouts are ours (`timeout` per call, under asyncio.timeout); connect is bounded here.
        pool = _pools[loop] = httpx2.AsyncClient(
            follow_redirects=True,
            trust_env=False,
            timeout=httpx2.Timeout(None, connect=10.0),
            limits=httpx2.Limits(max_connections=None, max_keepalive_connections=256),
        )
    return pool


async def close_shared_mcp_http() -> None:
    pool = _pools.pop(asyncio.get_running_loop(), None)
    if pool is not None:
        await pool.aclose()


def tool_result_text(result) -> str:
    """An MCP `CallToolResult` as the text of a tool message (an error result prefixed `Error: `)."""
    parts = []
    for block in result.content or []:
        text = getattr(block, "text", None)
        parts.append(text if isinstance(text, str) else f"[{getattr(block, 'type', 'content')} block]")
    text = "\n".join(parts)
    if result.structured_content is not None and not text:
        text = json.dumps(result.structured_content)
    if result.is_error and not text.lower().startswith("error"):
        text = ERROR_PREFIX + (text or "the tool reported an error")
    return text


@dataclass
class McpTools:
    """The tools of one rollout's MCP servers. Build with `McpTools.connect(...)`."""

    timeout: float
    specs: list[dict] = field(default_factory=list)
    """The tools in OpenAI function format, for the chat request's `tools`."""
    _routes: dict[str, tuple[Any, str]] = field(default_factory=dict)
    """Advertised name -> (that server's MCP client, the tool's own name)."""

    @classmethod
    @asynccontextmanager
    async def connect(cls, mcp_urls: dict[str, str], timeout: float, disabled: list[str] | None = None):
        """Open a client per server and list its tools (each server bounded by `timeout`); closed on exit.
        `disabled`: advertised names to leave out (the harness config's `disabled_tools`)."""
        from mcp import Client
        from mcp.client.streamable_http import streamable_http_client

        tools = cls(timeout=timeout)
        skip = set(disabled or ())
        async with AsyncExitStack() as stack:
            for server, url in mcp_urls.items():
                try:
                    async with asyncio.timeout(timeout):
                        transport = streamable_http_client(url, http_client=shared_mcp_http())
                        client = await stack.enter_async_context(Client(transport))
                        listed = await client.list_tools()
                except TimeoutError:
                    raise RuntimeError(
                        f"MCP server {server!r} ({url}) did not list its tools in {timeout:g} s"
                    ) from None
                except Exception as e:
                    raise RuntimeError(f"MCP server {server!r} ({url}) unreachable: {type(e).__name__}: {e}") from e
                for tool in listed.tools:
                    name = f"{server}_{tool.name}" if server else tool.name
                    if name in tools._routes:
                        raise RuntimeError(f"two MCP tools are both named {name!r}; give one server a TOOL_PREFIX")
                    if name in skip:
                        continue
                    tools._routes[name] = (client, tool.name)
                    function = {"name": name, "description": tool.description or "", "parameters": tool.input_schema}
                    tools.specs.append({"type": "function", "function": function})
            yield tools

    @property
    def names(self) -> list[str]:
        return list(self._routes)

    async def call(self, name: str, arguments: str | dict | None) -> str:
        """Run one tool call as the model wrote it; the tool's result text, or `Error: ...` (never raises, except
        for cancellation of the rollout itself)."""
        route = self._routes.get(name)
        if route is None:
            available = ", ".join(self._routes) or "none"
            return f"{ERROR_PREFIX}unknown tool {name!r}; the tools are: {available}"
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                return f"{ERROR_PREFIX}the arguments are not valid JSON ({e}); send a JSON object"
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            return f"{ERROR_PREFIX}the arguments must be a JSON object, got {type(arguments).__name__}"
        client, tool = route
        try:
            async with asyncio.timeout(self.timeout):
                result = await client.call_tool(tool, arguments)
        except TimeoutError:
            return f"{ERROR_PREFIX}tool {name!r} timed out after {self.timeout:g} s"
        except Exception as e:  # a transport or protocol failure of this call: the model sees it, the rollout goes on
            return f"{ERROR_PREFIX}tool {name!r} failed: {type(e).__name__}: {e}"
        return tool_result_text(result)
