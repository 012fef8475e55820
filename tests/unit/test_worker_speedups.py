"""The rollout worker's CPU savers change nothing observable: prime-chat's HTTP call, pydantic's factory check and the
server clients' aiohttp pool."""

import asyncio
import functools
from types import SimpleNamespace

import httpx
from aiohttp import web
from pydantic._internal import _fields

import prime_chat
from prime_rl.orchestrator.patches import cache_default_factory_signatures


async def serve(path: str, handler) -> tuple[web.AppRunner, int]:
    """A local aiohttp server answering POST `path` with `handler`: its runner (to clean up) and port."""
    app = web.Application()
    app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


def run_launch(status: int, reply: str) -> tuple[object, list[dict]]:
    """ChatHarness.launch against a local stand-in for the interception server; (result, requests seen)."""
    seen = []

    async def handler(request: web.Request) -> web.Response:
        seen.append({"path": request.path, "auth": request.headers["Authorization"], "body": await request.json()})
        return web.Response(status=status, text=reply)

    async def main():
        runner, port = await serve("/v1/chat/completions", handler)
        harness = SimpleNamespace(resolve_prompt=lambda data: ("be brief", "hello"))
        try:
            results = []
            for _ in range(2):  # the second call reuses the pooled connection
                results.append(
                    await prime_chat.ChatHarness.launch(
                        harness, SimpleNamespace(model="m"), None, None, f"http://127.0.0.1:{port}/v1/", "key", [], {}
                    )
                )
            assert results[0] == results[1]
            return results[0]
        finally:
            await prime_chat.close_shared_client()
            await runner.cleanup()

    return asyncio.run(main()), seen


def test_chat_harness_posts_the_prompt_and_reports_success():
    result, seen = run_launch(200, '{"choices": []}')
    assert (result.exit_code, result.stdout, result.stderr) == (0, "", "")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    assert seen[0] == {
        "path": "/v1/chat/completions",
        "auth": "Bearer key",
        "body": {"model": "m", "messages": messages},
    }


def test_chat_harness_ends_the_program_with_the_error_body_on_failure():
    result, _ = run_launch(502, "provider failed")
    assert (result.exit_code, result.stdout, result.stderr) == (1, "", "provider failed")


class Unhashable:
    __hash__ = None

    def __call__(self, data):
        return data


def test_cached_default_factory_check_gives_pydantics_answers():
    original = _fields.takes_validated_data_argument
    factories = [list, dict, lambda: 0, lambda data: data, functools.partial(dict, a=1), Unhashable()]
    expected = [original(f) for f in factories]
    assert expected == [False, False, False, True, False, True]
    cache_default_factory_signatures()
    cache_default_factory_signatures()  # idempotent
    patched = _fields.takes_validated_data_argument
    assert getattr(patched, "_prime_rl", False)
    assert [patched(f) for f in factories] == expected
    assert [patched(f) for f in factories] == expected  # from the cache


def test_a_pydantic_without_the_private_helper_runs_without_the_cache(monkeypatch, caplog):
    """The speed-up patches a private pydantic function; a pydantic that renamed it must not break the workers."""
    monkeypatch.delattr(_fields, "takes_validated_data_argument")
    cache_default_factory_signatures()  # no AttributeError
    assert not hasattr(_fields, "takes_validated_data_argument")
    assert "run without its cache" in caplog.text


def test_verifiers_openai_clients_pool_on_aiohttp_and_still_talk_http(monkeypatch):
    """After the patch, verifiers' OpenAI client (the train client's) sends through aiohttp's pool: a request
    reaches a local server with the SDK's path, headers and body, and the reply comes back parsed; closing frees it."""
    import httpx_aiohttp
    from verifiers.v1.clients import base
    from verifiers.v1.configs.client import BaseClientConfig

    from prime_rl.orchestrator import patches

    monkeypatch.setattr(base, "build_async_httpx", base.build_async_httpx)  # undone after the test
    patches.pool_http_clients_on_aiohttp()
    patched = base.build_async_httpx
    patches.pool_http_clients_on_aiohttp()  # idempotent
    assert base.build_async_httpx is patched
    seen = []

    async def handler(request: web.Request) -> web.Response:
        seen.append({"auth": request.headers["Authorization"], "body": await request.json()})
        return web.json_response(
            {"object": "list", "data": [{"id": "m", "object": "model", "created": 0, "owned_by": "x"}]}
        )

    async def main():
        runner, port = await serve("/v1/models", handler)
        try:
            client = base.build_async_openai(BaseClientConfig(base_url=f"http://127.0.0.1:{port}/v1", api_key_var="K"))
            assert isinstance(client._client, httpx_aiohttp.HttpxAiohttpClient)
            reply = await client.post("/models", body={"x": [1, 2]}, cast_to=httpx.Response)
            assert reply.json()["data"][0]["id"] == "m"
            assert len(patches._pooled_clients) == 1
            await patches.close_pooled_clients()
            assert len(patches._pooled_clients) == 0 and client._client.is_closed
        finally:
            await runner.cleanup()

    monkeypatch.setenv("K", "secret")
    asyncio.run(main())
    assert seen == [{"auth": "Bearer secret", "body": {"x": [1, 2]}}]


def test_pooled_connections_are_dropped_before_the_server_would_drop_them(monkeypatch, tmp_path):
    """Through the sampling client (the patched verifiers one) and an admin client (`InferenceServers`), a connection
    idle for less than `KEEPALIVE_EXPIRY` is reused, one idle longer is not: the client closes it before vLLM's
    uvicorn (keep-alive `VLLM_HTTP_TIMEOUT_KEEP_ALIVE`) could close it under a request."""
    import vllm.envs
    from verifiers.v1.clients import base
    from verifiers.v1.configs.client import BaseClientConfig

    from prime_rl.orchestrator import patches
    from prime_rl.orchestrator.servers import InferenceServers
    from prime_rl.utils import net

    assert net.KEEPALIVE_EXPIRY < vllm.envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE
    monkeypatch.setattr(base, "build_async_httpx", base.build_async_httpx)  # undone after the test
    monkeypatch.setattr(net, "KEEPALIVE_EXPIRY", 0.3)  # read when the clients' pool limits are built
    patches.pool_http_clients_on_aiohttp()
    ports = []

    async def handler(request: web.Request) -> web.Response:
        ports.append(request.transport.get_extra_info("peername")[1])  # the client's end: one per connection
        return web.json_response({})

    async def main():
        runner, port = await serve("/v1/x", handler)
        url = f"http://127.0.0.1:{port}/v1"
        try:
            client = base.build_async_openai(BaseClientConfig(base_url=url, api_key_var="K"))
            admin = InferenceServers([url], "K", 5, tmp_path).admin[url]
            for post in (lambda: client.post("/x", body={}, cast_to=httpx.Response), lambda: admin.post("/v1/x")):
                for pause in (0.0, 0.1, 0.8):
                    await asyncio.sleep(pause)
                    await post()
            await patches.close_pooled_clients()
            await admin.aclose()
        finally:
            await runner.cleanup()

    monkeypatch.setenv("K", "secret")
    asyncio.run(main())
    sampling, admin = ports[:3], ports[3:]
    assert sampling[0] == sampling[1] != sampling[2] and admin[0] == admin[1] != admin[2], ports
