"""Test helper for calculator: a scripted OpenAI-compatible chat server."""

from __future__ import annotations

import time
from collections.abc import Callable

from aiohttp import web


class ScriptedChatServer:
    """`POST /v1/chat/completions` answered by `script(request_body) -> assistant message dict`; `GET /v1/models`.
    Every request body is kept in `requests`. Use as `async with ScriptedChatServer(script) as server:`."""

    def __init__(self, script: Callable[[dict], dict]) -> None:
        self.script = script
        self.requests: list[dict] = []
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def _chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        message = {"role": "assistant", **self.script(body)}
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        return web.json_response(
            {
                "id": f"chatcmpl-{len(self.requests)}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model", ""),
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": 512}]})

    async def __aenter__(self) -> ScriptedChatServer:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc) -> None:
        assert self._runner is not None
        await self._runner.cleanup()
