"""The rollout worker's CPU savers change nothing observable: prime-chat's HTTP call and pydantic's factory check."""

import asyncio
import functools
from types import SimpleNamespace

from aiohttp import web
from pydantic._internal import _fields

import prime_chat
from prime_rl.orchestrator.patches import cache_default_factory_signatures


def run_launch(status: int, reply: str) -> tuple[object, list[dict]]:
    """ChatHarness.launch against a local stand-in for the interception server; (result, requests seen)."""
    seen = []

    async def handler(request: web.Request) -> web.Response:
        seen.append({"path": request.path, "auth": request.headers["Authorization"], "body": await request.json()})
        return web.Response(status=status, text=reply)

    async def main():
        app = web.Application()
        app.router.add_post("/v1/chat/completions", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
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
