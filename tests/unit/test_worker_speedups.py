"""The rollout worker's CPU savers change nothing observable: prime-chat's HTTP call, pydantic's factory check and the
server clients' aiohttp pool."""

import asyncio
import functools
from types import SimpleNamespace

import httpx
import pytest
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


def test_a_task_hashes_each_data_object_once_and_a_replaced_data_anew(monkeypatch):
    from verifiers.v1 import task as vtask

    from prime_rl.orchestrator import patches

    class Row(vtask.TaskData):
        text: str

    monkeypatch.setattr(vtask.Task, "hash", vtask.Task.__dict__["hash"])  # the unpatched property, back after the test
    task = vtask.Task(Row(prompt="reverse abc", text="abc"))
    before, other_before = task.hash, task.with_data(text="abd").hash
    assert before != other_before
    real, hashed = vtask.task_key, []
    monkeypatch.setattr(vtask, "task_key", lambda data: hashed.append(data) or real(data))
    patches.cache_task_hashes()
    patches.cache_task_hashes()  # idempotent
    assert [task.hash, task.key, task.hash] == [before] * 3 and len(hashed) == 1
    other = task.with_data(text="abd")  # a copy of the task, its kept hash included, holding new data
    assert [other.hash, other.hash] == [other_before] * 2 and len(hashed) == 2
    assert task.hash == before and len(hashed) == 2


def test_hooks_are_invoked_as_before_with_each_functions_signature_parsed_once(monkeypatch):
    import inspect

    from verifiers.v1.utils import decorators

    from prime_rl.orchestrator import patches

    class Scorer:
        def __init__(self, bonus: float) -> None:
            self.bonus = bonus

        def score(self, answer: str, reward: float = 0.0) -> float:
            return reward + self.bonus + len(answer)

    def free(answer: str, *rest, **extra) -> str:
        return answer.upper()

    monkeypatch.setattr(decorators, "inspect", inspect)  # undone after the test
    parsed = []
    real = inspect.signature
    monkeypatch.setattr(inspect, "signature", lambda fn, **kw: parsed.append(fn) or real(fn, **kw))
    patches.cache_hook_signatures()
    patches.cache_hook_signatures()  # idempotent
    available = {"answer": "abc", "reward": 1.0, "unused": None}
    assert decorators.invoke(Scorer(0.5).score, available) == 4.5
    assert decorators.invoke(Scorer(2.0).score, available) == 6.0  # another instance: its own `self`
    assert decorators.invoke(free, available) == "ABC"
    assert decorators.invoke(free, available) == "ABC"
    assert len(parsed) == 2  # Scorer.score once, free once
    assert decorators.inspect.signature(Scorer(1.0).score) == real(Scorer(1.0).score)  # self dropped, as inspect does
    assert decorators.inspect.isfunction is inspect.isfunction  # the rest is inspect's


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


def generate_reply(completion: list[int]) -> dict:
    """A `/inference/v1/generate` reply of vLLM's shape for one choice."""
    logprobs = [{"token_id": t, "logprob": -0.5, "token": f"token_id:{t}"} for t in completion]
    choice = {"token_ids": completion, "finish_reason": "stop", "logprobs": {"content": logprobs}}
    return {
        "request_id": "r1",
        "usage": {"prompt_tokens": 3, "completion_tokens": len(completion)},
        "choices": [choice],
    }


async def call_generate(port: int, **kwargs) -> dict:
    """`renderers.client.generate` (as patched at the time) with verifiers' OpenAI client against a local server."""
    import renderers.client as rc
    from verifiers.v1.clients import base
    from verifiers.v1.configs.client import BaseClientConfig

    renderer = SimpleNamespace(
        get_stop_token_ids=lambda: [9],
        parse_response=lambda ids, prompt_ids, tools: SimpleNamespace(
            content=str(ids), reasoning_content=None, tool_calls=[], reasoning_complete=True
        ),
    )
    client = base.build_async_openai(BaseClientConfig(base_url=f"http://127.0.0.1:{port}/v1", api_key_var="K"))
    try:
        call = {"prompt_ids": [1, 2, 3], "sampling_params": {"temperature": 1.0, "max_tokens": 4}, **kwargs}
        return await rc.generate(
            client=client, renderer=renderer, messages=[{"role": "user", "content": "hi"}], model="m",
            max_prompt_len=100, **call
        )  # fmt: skip
    finally:
        await client.close()


def test_generate_posts_on_aiohttp_the_request_the_sdk_would_send(monkeypatch):
    """With `post_generate_on_aiohttp`, a model call reaches the server with the SDK's URL, body, auth and session
    header, and `generate` returns the same result, without going through the SDK's `post`."""
    import openai
    import renderers.client as rc

    from prime_rl.orchestrator import patches

    monkeypatch.setattr(rc, "generate", rc.generate)  # undone after the test
    monkeypatch.setenv("K", "secret")
    seen = []

    async def handler(request: web.Request) -> web.Response:
        headers = {k: request.headers.get(k) for k in ("Authorization", "X-Session-ID", "Content-Type")}
        seen.append({"path": request.path, "headers": headers, "body": await request.json()})
        return web.json_response(generate_reply([5, 6, 9]))

    async def main():
        runner, port = await serve("/inference/v1/generate", handler)
        try:
            through_sdk = await call_generate(port, extra_headers={"X-Session-ID": "trace-1"})
            patches.post_generate_on_aiohttp()
            patches.post_generate_on_aiohttp()  # idempotent
            monkeypatch.setattr(openai.AsyncOpenAI, "post", None)  # the patched path must not need it
            direct = await call_generate(port, extra_headers={"X-Session-ID": "trace-1"})
            assert len(patches._model_call_posters) == 1
            await patches.close_pooled_clients()
            assert not patches._model_call_posters
            return through_sdk, direct
        finally:
            await runner.cleanup()

    through_sdk, direct = asyncio.run(main())
    assert direct == through_sdk
    assert direct["completion_ids"] == [5, 6, 9] and direct["completion_logprobs"] == [-0.5] * 3
    assert seen[0] == seen[1]
    assert seen[1] == {
        "path": "/inference/v1/generate",
        "headers": {"Authorization": "Bearer secret", "X-Session-ID": "trace-1", "Content-Type": "application/json"},
        "body": {
            "model": "m",
            "token_ids": [1, 2, 3],
            "sampling_params": {"temperature": 1.0, "max_tokens": 4, "stop_token_ids": [9], "logprobs": 1,
                                "skip_special_tokens": False},
        },
    }  # fmt: skip


def test_direct_generate_posts_fail_with_the_sdks_errors(monkeypatch):
    """A 4xx or 5xx reply, a refused connection and a read timeout raise the exception the SDK raises for each (the
    same class, status and message), which is what verifiers maps to the status its harness sees."""
    import httpx
    from verifiers.v1.clients import base
    from verifiers.v1.configs.client import BaseClientConfig

    from prime_rl.orchestrator import patches
    from prime_rl.utils.net import free_port

    monkeypatch.setenv("K", "secret")

    async def handler(request: web.Request) -> web.Response:
        body = await request.json()
        if body["what"] == "slow":
            await asyncio.sleep(1)  # past the client's 0.3 s read timeout
        status = {"bad": 400, "gone": 404, "broken": 500, "slow": 200}[body["what"]]
        return web.json_response({"error": {"message": f"{body['what']} request", "type": "x"}}, status=status)

    async def outcome(post) -> tuple:
        try:
            reply = await post()
        except Exception as e:  # the SDK's exception, compared below
            return type(e), getattr(e, "status_code", None), str(e)
        return "ok", reply.status_code

    async def main():
        runner, port = await serve("/x", handler)
        dead = free_port()  # nobody listens there
        results = []
        try:
            for url, what in [(port, "bad"), (port, "gone"), (port, "broken"), (dead, "bad"), (port, "slow")]:
                config = BaseClientConfig(base_url=f"http://127.0.0.1:{url}/v1", api_key_var="K")
                config.timeout.read = 0.3
                client = base.build_async_openai(config)
                direct = patches.DirectGeneratePost(client)
                pair = []
                for poster in (client, direct):
                    post = functools.partial(poster.post, f"http://127.0.0.1:{url}/x", cast_to=httpx.Response)
                    pair.append(await outcome(functools.partial(post, body={"what": what})))
                results.append(pair)
                await client.close()
            await patches.close_pooled_clients()
        finally:
            await runner.cleanup()
        return results

    import openai

    results = asyncio.run(main())
    for through_sdk, direct in results:
        assert direct == through_sdk
    classes = [sdk[0] for sdk, _ in results]
    assert classes == [
        openai.BadRequestError,
        openai.NotFoundError,
        openai.InternalServerError,
        openai.APIConnectionError,
        openai.APITimeoutError,
    ]
    assert results[0][0][1:] == (400, "Error code: 400 - {'error': {'message': 'bad request', 'type': 'x'}}")


def test_an_sdk_without_the_attributes_the_direct_post_reads_keeps_its_own_path(monkeypatch, caplog):
    """`DirectGeneratePost` reads private OpenAI client attributes; an SDK that renamed one must still serve model
    calls (through its own `post`), with a warning that says why."""
    import openai
    import renderers.client as rc

    from prime_rl.orchestrator import patches

    monkeypatch.setattr(rc, "generate", rc.generate)  # undone after the test
    monkeypatch.setenv("K", "secret")
    monkeypatch.delattr(openai._base_client.BaseClient, "_make_status_error_from_response")
    patches.post_generate_on_aiohttp()

    async def handler(request: web.Request) -> web.Response:
        return web.json_response(generate_reply([7, 9]))

    async def main():
        runner, port = await serve("/inference/v1/generate", handler)
        try:
            return await call_generate(port)
        finally:
            await patches.close_pooled_clients()
            await runner.cleanup()

    assert asyncio.run(main())["completion_ids"] == [7, 9]
    assert "model calls go through the SDK" in caplog.text and "_make_status_error_from_response" in caplog.text
    assert not patches._model_call_posters


def test_a_merged_reply_splits_into_the_replies_of_single_requests():
    """Choice i alone (index 0), usage counting its own completion over the shared prompt, an id of its own."""
    from prime_rl.orchestrator.coalesce import split_reply

    merged = {
        "request_id": "r",
        "usage": {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11},
        "choices": [{"index": 1, "token_ids": [7, 8, 9, 9]}, {"index": 0, "token_ids": [4, 2]}],
    }
    assert split_reply(merged, 2) == [
        {"request_id": "r-0", "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
         "choices": [{"index": 0, "token_ids": [4, 2]}]},
        {"request_id": "r-1", "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9},
         "choices": [{"index": 0, "token_ids": [7, 8, 9, 9]}]},
    ]  # fmt: skip
    with pytest.raises(ValueError, match="asked for 3 samples, the reply has 2"):
        split_reply(merged, 3)


def test_only_calls_the_server_could_not_tell_apart_merge():
    """Same URL, body, timeout and headers but the trace's session id merge; a seed, an n of its own, greedy or
    unstated temperature, or streaming never do (n greedy requests, or n with one seed, sample the same tokens, one
    request for n would not, and vLLM refuses n > 1 when greedy)."""
    from prime_rl.orchestrator.coalesce import for_n, merge_key

    body = {"model": "m", "token_ids": [1, 2], "sampling_params": {"temperature": 1.0}}
    auth = {"Authorization": "Bearer k"}

    def key(url, body, headers, timeout=5):
        return merge_key(url, body, headers, timeout, ignored_header="X-Session-ID")

    merged = key("u", body, {**auth, "x-session-id": "a"})
    assert merged == key("u", dict(reversed(body.items())), {**auth, "X-Session-ID": "b"})
    assert merged != key("u", body, {**auth, "X-Other": "b"})
    assert merged != key("u", body, {"Authorization": "Bearer other"})
    assert merged != key("v", body, auth) and merged != key("u", body, auth, 6)
    assert merged != key("u", {**body, "token_ids": [1, 3]}, auth)
    for alone in ({"temperature": 1.0, "seed": 3}, {"temperature": 1.0, "n": 2}, {"temperature": 0}, {}):
        assert key("u", {**body, "sampling_params": alone}, auth) is None
    assert key("u", {**body, "stream": True}, auth) is None
    assert key("u", {"what": "no sampling"}, auth) is None
    assert for_n(body, 1) is body
    assert for_n(body, 4)["sampling_params"] == {"temperature": 1.0, "n": 4} and "n" not in body["sampling_params"]


def n_choice_reply(body: dict) -> dict:
    """A generate reply with the `n` choices asked for: choice i samples [10 + i, 20 + i, 9] under policy step i."""
    n = body["sampling_params"].get("n", 1)
    choices = [
        {"index": i, "token_ids": [10 + i, 20 + i, 9], "finish_reason": "stop",
         "logprobs": {"content": [{"token_id": t, "logprob": -0.1 * (i + 1), "token": f"token_id:{t}"}
                                  for t in (10 + i, 20 + i, 9)]},
         "weight_versions": [{"version": f"step_{i}", "start": 0, "end": 3}]}
        for i in range(n)
    ]  # fmt: skip
    return {"request_id": "r", "usage": {"prompt_tokens": 3, "completion_tokens": 3 * n}, "choices": choices}


def test_identical_model_calls_in_flight_together_share_one_request_for_n_samples(monkeypatch):
    """Eight rollouts' calls with one prompt, two with another and one with a seed, all at once: the server gets three
    requests (n = 8, n = 2, and the seeded one as sent), and each rollout gets one choice of its own, its logprobs and
    its tokens' policy versions (captured under its own session)."""
    import renderers.client as rc

    from prime_rl.orchestrator import patches

    monkeypatch.setattr(rc, "generate", rc.generate)
    monkeypatch.setattr(rc, "parse_generate_response", rc.parse_generate_response)
    monkeypatch.setenv("K", "secret")
    seen = []

    async def handler(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append((body["token_ids"], body["sampling_params"]))
        return web.json_response({**n_choice_reply(body), "request_id": f"r{len(seen)}"})

    async def main():
        runner, port = await serve("/inference/v1/generate", handler)
        try:
            patches.install_version_capture()
            patches.post_generate_on_aiohttp()
            calls = [call_generate(port, extra_headers={"X-Session-ID": f"a{i}"}) for i in range(8)]
            calls += [call_generate(port, prompt_ids=[4], extra_headers={"X-Session-ID": f"b{i}"}) for i in range(2)]
            seeded = {"temperature": 1.0, "max_tokens": 4, "seed": 1}
            calls.append(call_generate(port, sampling_params=seeded, extra_headers={"X-Session-ID": "c"}))
            results = await asyncio.gather(*calls)
            await patches.close_pooled_clients()
            return results
        finally:
            await runner.cleanup()

    results = asyncio.run(main())
    sent = sorted((ids, sp.get("n", 1), sp.get("seed", 0)) for ids, sp in seen)
    assert sent == [([1, 2, 3], 1, 1), ([1, 2, 3], 8, 0), ([4], 2, 0)]
    a, b, c = results[:8], results[8:10], results[10]
    assert sorted(r["completion_ids"] for r in a) == [[10 + i, 20 + i, 9] for i in range(8)]
    assert sorted(r["completion_ids"] for r in b) == [[10, 20, 9], [11, 21, 9]] and c["completion_ids"] == [10, 20, 9]
    for r in results:
        i = r["completion_ids"][0] - 10
        assert r["completion_logprobs"] == pytest.approx([-0.1 * (i + 1)] * 3)
    assert len({r["request_id"] for r in a + b}) == 10
    for prefix, group in (("a", a), ("b", b)):
        for k, r in enumerate(group):
            versions = patches.take_versions(f"{prefix}{k}")
            assert versions == {tuple(r["completion_ids"]): [r["completion_ids"][0] - 10] * 3}


def test_merged_calls_fail_each_with_the_error_its_own_request_would_have_got(monkeypatch):
    """A 5xx for the merged request raises the SDK's error in every call, with the server's message; a reply with
    the wrong number of choices fails every call rather than hand out samples that are not theirs."""
    import openai
    import renderers.client as rc

    from prime_rl.orchestrator import patches

    monkeypatch.setattr(rc, "generate", rc.generate)
    monkeypatch.setenv("K", "secret")

    async def handler(request: web.Request) -> web.Response:
        body = await request.json()
        if body["token_ids"] == [1, 2, 3]:
            return web.json_response({"error": {"message": "engine died", "type": "x"}}, status=500)
        return web.json_response(generate_reply([5, 9]))  # one choice, whatever n was asked for

    async def outcome(call) -> tuple:
        try:
            await call
        except Exception as e:
            return type(e), str(e)
        return ("ok",)

    async def main():
        runner, port = await serve("/inference/v1/generate", handler)
        try:
            patches.post_generate_on_aiohttp()
            calls = [call_generate(port, extra_headers={"X-Session-ID": f"a{i}"}) for i in range(3)]
            calls += [call_generate(port, prompt_ids=[4], extra_headers={"X-Session-ID": f"b{i}"}) for i in range(2)]
            results = await asyncio.gather(*map(outcome, calls))
            await patches.close_pooled_clients()
            return results
        finally:
            await runner.cleanup()

    results = asyncio.run(main())
    failed = (openai.InternalServerError, "Error code: 500 - {'error': {'message': 'engine died', 'type': 'x'}}")
    assert results[:3] == [failed] * 3
    assert results[3:] == [(ValueError, "asked for 2 samples, the reply has 1")] * 2


def test_cancelled_calls_leave_their_merged_request_to_the_others_and_close_ends_requests_in_flight(monkeypatch):
    """Of four merged calls one is cancelled before its request goes (it asks for nothing: n = 3) and one while it is
    in flight (its sample is dropped): the other two still get samples of their own. Closing the pools while a merged
    request is in flight cancels its calls instead of leaving them waiting."""
    import renderers.client as rc

    from prime_rl.orchestrator import patches

    monkeypatch.setattr(rc, "generate", rc.generate)
    monkeypatch.setenv("K", "secret")
    asked = []

    async def handler(request: web.Request) -> web.Response:
        body = await request.json()
        asked.append(body["sampling_params"].get("n", 1))
        await asyncio.sleep(0.3 if body["token_ids"] == [1, 2, 3] else 2)  # the second, past close
        return web.json_response(n_choice_reply(body))

    async def main():
        runner, port = await serve("/inference/v1/generate", handler)
        try:
            patches.post_generate_on_aiohttp()
            calls = [asyncio.ensure_future(call_generate(port)) for _ in range(4)]
            await asyncio.sleep(0)  # each call is now waiting for its merged request, which has not gone yet
            calls[0].cancel()
            await asyncio.sleep(0.1)
            calls[2].cancel()
            done = await asyncio.gather(*calls, return_exceptions=True)
            stuck = [asyncio.ensure_future(call_generate(port, prompt_ids=[4])) for _ in range(2)]
            await asyncio.sleep(0.1)
            await asyncio.wait_for(patches.close_pooled_clients(), 5)
            ended = await asyncio.wait_for(asyncio.gather(*stuck, return_exceptions=True), 5)
            return done, ended
        finally:
            await runner.cleanup()

    done, ended = asyncio.run(main())
    assert asked == [3, 2]
    assert [type(d) for d in done[::2]] == [asyncio.CancelledError] * 2
    own = [done[1]["completion_ids"], done[3]["completion_ids"]]
    assert own[0] != own[1] and all(c in [[10 + i, 20 + i, 9] for i in range(3)] for c in own)
    assert [type(e) for e in ended] == [asyncio.CancelledError] * 2
