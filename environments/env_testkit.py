"""The bundled environments' shared test kit (put on the path by `environments/conftest.py`).

- `ScriptedChatServer`: an OpenAI-compatible chat server on 127.0.0.1 whose replies come from a script.
- `OneCallChatHarness`: a chat harness making one completion per segment, in this process. It is a verifiers
  harness plugin with id `env_testkit` (this module's name; `__all__` exports it).
- `run_episodes`: load an environment from its config dict and run episodes against a scripted server.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import httpx
import verifiers.v1 as vf
from aiohttp import web

Script = Callable[[dict], dict]
"""A request body -> the assistant message to answer with (without `role`), e.g. `{"content": "42"}`."""


class ScriptedChatServer:
    """`POST /v1/chat/completions` answered by `script(request_body) -> assistant message dict`; `GET /v1/models`.
    Every request body is kept in `requests`. Use as `async with ScriptedChatServer(script) as server:`."""

    def __init__(self, script: Script) -> None:
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


class OneCallChatHarness(vf.Harness[vf.HarnessConfig]):
    """One chat completion through the interception endpoint, in this process (harness id `env_testkit`).
    Resumable: a later segment of an interaction relaunches it on the conversation so far."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data):
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [m.model_dump(exclude_none=True) for m in prompt or []]
        async with httpx.AsyncClient(trust_env=False, timeout=60) as client:
            response = await client.post(
                f"{endpoint}/chat/completions",
                json={"model": ctx.model, "messages": messages},
                headers={"Authorization": f"Bearer {secret}"},
            )
        response.raise_for_status()
        return vf.ProgramResult(0, "", "")


async def run_episodes(
    config: dict,
    script: Script,
    tasks: Iterable[vf.Task] | Callable[[vf.Env], Iterable[vf.Task]],
    *,
    api_key_var: str,
    max_tokens: int = 16,
) -> tuple[list[vf.Episode], list[dict]]:
    """Load the env of `config` (`vf.resolve_env_config` data) and run one episode per task, in order, against a
    `ScriptedChatServer(script)` through verifiers' eval client (model `m`, `max_tokens`). `tasks` may be a
    function of the loaded env (e.g. `lambda env: list(env.taskset.take(3))`). The API key is read from the
    environment variable `api_key_var`, which the caller sets. Returns the episodes and the server's requests."""
    env = vf.load_environment(vf.resolve_env_config(config))
    async with ScriptedChatServer(script) as server, env.serving():
        ctx = vf.ModelContext(
            model="m",
            client=vf.EvalClientConfig(base_url=server.base_url, api_key_var=api_key_var),
            sampling=vf.SamplingConfig(max_tokens=max_tokens),
        )
        task_list = tasks(env) if callable(tasks) else tasks
        episodes = [await env.run_episode(task, ctx) for task in task_list]
    return episodes, server.requests


async def run_prime_chat_episodes(
    taskset: dict, script: Script, tasks, *, api_key_var: str
) -> tuple[list[vf.Episode], list[dict]]:
    """`run_episodes` for a taskset (`{"id": ..., **args}`) played by prime-rl's in-process `prime-chat` harness (what
    prime-rl gives a taskset without a harness; it runs tool calls against the taskset's MCP servers). prime-chat's
    HTTP pools live on the running loop, so they are closed here before it ends."""
    from prime_chat import close_shared_client

    agent = {"runtime": {"type": "subprocess"}, "harness": {"id": "prime-chat"}}
    try:
        return await run_episodes({"taskset": taskset, "agent": agent}, script, tasks, api_key_var=api_key_var)
    finally:
        await close_shared_client()


__all__ = ["OneCallChatHarness"]
