"""Client CPU per model call: the OpenAI SDK's `post` (what verifiers' train client hands `renderers.client.generate`)
against `patches.DirectGeneratePost` (the same request on aiohttp alone).

    uv run python benchmarks/bench_generate_post.py
    uv run python benchmarks/bench_generate_post.py --calls 5000 --inflight 256

A stand-in for vLLM's `/inference/v1/generate` runs in its own process (aiohttp, a fixed reply of the demo's shape:
a 12-token completion with its logprobs), so only the client's work is in this process. Each round posts `--calls`
requests of the demo's shape (a 110-token prompt), `--inflight` at a time, through each path in turn after a warm-up;
reported per path: the median over `--rounds` rounds of this process's CPU time per call (user + system) and of the
wall time per call. On 2 cores the server takes the other one, so wall and CPU agree when the client is the bottleneck.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import time

REPLY = {
    "request_id": "bench",
    "usage": {"prompt_tokens": 110, "completion_tokens": 12},
    "choices": [
        {
            "token_ids": list(range(12)),
            "finish_reason": "stop",
            "logprobs": {"content": [{"token_id": t, "logprob": -0.1, "token": f"token_id:{t}"} for t in range(12)]},
        }
    ],
}


def serve(port: int) -> None:
    from aiohttp import web

    body = json.dumps(REPLY).encode()

    async def generate(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=body, content_type="application/json")

    app = web.Application()
    app.router.add_post("/inference/v1/generate", generate)
    web.run_app(app, host="127.0.0.1", port=port, print=None)


async def wait_listening(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"bench: the stand-in server did not listen on port {port} in {timeout:.0f}s"
                ) from None
            await asyncio.sleep(0.1)


async def bench(port: int, args) -> dict[str, list[tuple[float, float]]]:
    import httpx
    from verifiers.v1.clients import base
    from verifiers.v1.configs.client import BaseClientConfig

    from prime_rl.orchestrator import patches

    patches.pool_http_clients_on_aiohttp()  # the SDK path as the workers run it: on aiohttp's pool
    os.environ["BENCH_KEY"] = "bench"
    client = base.build_async_openai(BaseClientConfig(base_url=f"http://127.0.0.1:{port}/v1", api_key_var="BENCH_KEY"))
    paths = {"OpenAI SDK post": client, "DirectGeneratePost": patches.DirectGeneratePost(client)}
    url = f"http://127.0.0.1:{port}/inference/v1/generate"
    body = {"model": "m", "token_ids": list(range(110)), "sampling_params": {"temperature": 1.0, "max_tokens": 16}}
    slots = asyncio.Semaphore(args.inflight)

    async def one(poster) -> None:
        async with slots:
            reply = await poster.post(
                url, cast_to=httpx.Response, body=body, options={"headers": {"X-Session-ID": "t"}}
            )
            assert len(reply.content) > 100

    results: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
    try:
        await wait_listening(port)
        for poster in paths.values():  # warm-up: connections, imports, caches
            await asyncio.gather(*(one(poster) for _ in range(args.inflight)))
        for _ in range(args.rounds):
            for name, poster in paths.items():
                cpu, wall = time.process_time(), time.perf_counter()
                await asyncio.gather(*(one(poster) for _ in range(args.calls)))
                results[name].append(
                    ((time.process_time() - cpu) / args.calls, (time.perf_counter() - wall) / args.calls)
                )
    finally:
        await patches.close_pooled_clients()
        await client.close()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000, help="requests per path per round")
    p.add_argument("--inflight", type=int, default=64, help="requests in flight at once")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    from prime_rl.utils.net import free_port

    port = free_port()
    server = multiprocessing.get_context("spawn").Process(target=serve, args=(port,), daemon=True)
    server.start()
    try:
        results = asyncio.run(bench(port, args))
    finally:
        server.terminate()
        server.join(10)
    print(f"{args.calls} calls per round, {args.inflight} in flight, median of {args.rounds} rounds")
    print("| path | client CPU ms/call | wall ms/call |")
    print("|---|---|---|")
    for name, rows in results.items():
        cpu, wall = (statistics.median(r[i] for r in rows) * 1e3 for i in (0, 1))
        print(f"| {name} | {cpu:.2f} | {wall:.2f} |")


if __name__ == "__main__":
    main()
