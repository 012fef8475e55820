"""A GRPO step's samples against the CPU server: one request per sample, one request per prompt for n samples, and
the rollout workers' path (`patches.DirectGeneratePost`, whose identical calls in flight together merge, see
`orchestrator/coalesce.py`).

    uv run python benchmarks/bench_merged_samples.py            # the demo's shape: 8 prompts of 108 tokens x 8, 16 tokens
    uv run python benchmarks/bench_merged_samples.py --model outputs/reverse-text/sft/weights/step_450

One `inference` server starts on `--model` (default: a fresh random-init model of the demo's shape) with the demo's
engine settings (fp32, 32-token KV blocks, eager). Each round sends `--groups` prompts x `--samples` samples of
`--max-tokens` tokens (random prompt ids, new every round, so nothing is cached from an earlier round, as after a
weight swap; temperature 1, `ignore_eos`, logprobs as the orchestrator asks), all at once on one kept-alive aiohttp
pool, in three ways in turn:
- `per sample`: groups x samples requests, as verifiers makes one model call per rollout;
- `per prompt, n`: one request per prompt with `n` = samples;
- `workers' path`: groups x samples concurrent `DirectGeneratePost.post` calls, one per sample, as a rollout worker
  makes them (they merge into the requests of the second way).
Reported per way, median over `--rounds` rounds after `--warmup`: wall seconds a round, seconds to the first reply,
CPU seconds of the server's process tree a round, and of this process (the client) a round.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench_orchestrator import cpu_by_pid, cpu_delta, tree
from bench_prompt_blocks import add_step_shape, model_and_vocab, step_shape

from prime_rl.inference.process import InferenceServer

API_KEY = "bench-key"
KEY_VAR = "PRIME_BENCH_API_KEY"


def bodies(args, rng: random.Random, vocab: int, per_prompt_n: bool) -> list[dict]:
    sampling = {"temperature": 1.0, "max_tokens": args.max_tokens, "ignore_eos": True, "logprobs": 1}
    out = []
    for _ in range(args.groups):
        body = {"model": str(args.model), "token_ids": [rng.randrange(vocab) for _ in range(args.prompt_tokens)]}
        if per_prompt_n:
            out.append({**body, "sampling_params": {**sampling, "n": args.samples}})
        else:
            out += [{**body, "sampling_params": dict(sampling)} for _ in range(args.samples)]
    return out


async def rounds(server: InferenceServer, args, vocab: int) -> dict[str, dict[str, float]]:
    import aiohttp
    from verifiers.v1.clients import base
    from verifiers.v1.configs.client import BaseClientConfig

    from prime_rl.orchestrator import patches

    url = f"{server.url}/inference/v1/generate"
    os.environ[KEY_VAR] = API_KEY
    client = base.build_async_openai(BaseClientConfig(base_url=f"{server.url}/v1", api_key_var=KEY_VAR))
    direct = patches.DirectGeneratePost(client)
    session = aiohttp.ClientSession(headers=server.headers, connector=aiohttp.TCPConnector(limit=0))

    async def post_raw(body: dict, t0: float) -> float:
        async with session.post(url, json=body) as reply:
            await reply.read()
            if reply.status != 200:
                raise SystemExit(f"bench: {reply.status} {(await reply.text())[:300]}")
        return time.perf_counter() - t0

    async def post_direct(body: dict, t0: float) -> float:
        import httpx

        await direct.post(url, cast_to=httpx.Response, body=body)
        return time.perf_counter() - t0

    ways = {"per sample": (False, post_raw), "per prompt, n": (True, post_raw), "workers' path": (False, post_direct)}
    rows = {name: [] for name in ways}
    rng = random.Random(0)
    try:
        for i in range(args.warmup + args.rounds):
            for name, (per_prompt_n, post) in ways.items():
                requests = bodies(args, rng, vocab, per_prompt_n)
                server_cpu, client_cpu = cpu_by_pid(tree(server.proc.pid)), time.process_time()
                t0 = time.perf_counter()
                firsts = await asyncio.gather(*[post(body, t0) for body in requests])
                wall = time.perf_counter() - t0
                row = {"wall": wall, "first": min(firsts), "client": time.process_time() - client_cpu}
                row["server"] = cpu_delta(server_cpu, cpu_by_pid(tree(server.proc.pid)))
                if i >= args.warmup:
                    rows[name].append(row)
    finally:
        await session.close()
        await patches.close_pooled_clients()
        await client.close()
    return {name: {k: statistics.median(r[k] for r in got) for k in got[0]} for name, got in rows.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_shape(p)
    p.add_argument("--warmup", type=int, default=3, help="rounds of each way left out")
    p.add_argument("--rounds", type=int, default=15, help="measured rounds of each way")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-merged-") as tmp:
        out = Path(tmp)
        vocab = model_and_vocab(args, out)
        extra = ["--model.dtype", "float32", "--model.max-model-len", str(args.prompt_tokens + args.max_tokens + 64)]
        extra += ["--model.enforce-eager", "--max-num-seqs", str(args.groups * args.samples), "--block-size", "32"]
        server = InferenceServer(args.model, out / "server", extra=extra, api_key=API_KEY)
        try:
            server.wait_healthy()
            result = asyncio.run(rounds(server, args, vocab))
        finally:
            server.stop()
    print(f"{args.model}; {step_shape(args)}; median of {args.rounds} rounds of each way after {args.warmup}")
    print("| way | requests | s/round | first reply s | server CPU s/round | client CPU s/round |")
    print("|---|---|---|---|---|---|")
    for name, r in result.items():
        requests = args.groups if name == "per prompt, n" else args.groups * args.samples
        print(f"| {name} | {requests} | {r['wall']:.3f} | {r['first']:.3f} | {r['server']:.3f} | {r['client']:.3f} |")


if __name__ == "__main__":
    main()
