"""The CPU engine's KV block size against sampling time, on requests shaped like an RL step's: groups of samples
of one prompt, all sent at once.

    uv run python benchmarks/bench_prompt_blocks.py            # the demo's shape: 8 prompts of 108 tokens x 8, 16 tokens
    uv run python benchmarks/bench_prompt_blocks.py --model outputs/smollm2-135m-instruct --dtype float32 \
        --groups 2 --prompt-tokens 35 --max-tokens 64

vLLM's prefix cache shares whole KV blocks only. For each `--block-sizes` entry one `inference` server starts on
`--model` (default: a fresh random-init model of the demo's shape, `configs/reverse_text/model.toml`), then runs
`--rounds` rounds after one warm-up: each sends `--groups` prompts x `--samples` samples of `--max-tokens` tokens
(random token ids, new every round, so nothing is cached from an earlier round, as after a weight swap), temperature
1, `ignore_eos`. Reported per round (median): wall seconds, CPU seconds of the server's process tree, prompt tokens
the engine computed and the ones it took from its prefix cache (vLLM's `/metrics`).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import tempfile
import time
import tomllib
from pathlib import Path

import httpx
from bench_orchestrator import cpu_by_pid, cpu_delta, tree

from prime_rl.inference.process import InferenceServer
from prime_rl.models.tiny import TinyModelConfig, build_tiny_model

API_KEY = "bench-key"
DEMO_MODEL = Path(__file__).resolve().parent.parent / "configs" / "reverse_text" / "model.toml"


def counters(server: InferenceServer) -> dict[str, float]:
    """vLLM's prompt-token counters: computed (`prompt_tokens` less cache hits) and taken from the prefix cache."""
    text = httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=30).text

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^vllm:{name}_total\{{[^}}]*\}} ([\d.e+]+)$", text, re.M))

    return {"prompt": total("prompt_tokens"), "hits": total("prefix_cache_hits")}


async def one_round(server: InferenceServer, args, rng: random.Random, vocab: int) -> None:
    params = {"temperature": 1.0, "max_tokens": args.max_tokens, "ignore_eos": True, "logprobs": 1}
    async with httpx.AsyncClient(timeout=600, headers=server.headers) as client:
        url = f"{server.url}/inference/v1/generate"
        requests = []
        for _ in range(args.groups):
            body = {"model": str(args.model), "token_ids": [rng.randrange(vocab) for _ in range(args.prompt_tokens)],
                    "sampling_params": params}  # fmt: skip
            requests += [client.post(url, json=body) for _ in range(args.samples)]
        replies = await asyncio.gather(*requests)
    bad = [r for r in replies if r.status_code != 200]
    if bad:
        raise SystemExit(f"bench: {len(bad)} requests failed: {bad[0].text[:300]}")


def bench(block: int, args, out: Path, vocab: int) -> dict[str, float]:
    extra = ["--model.dtype", args.dtype, "--model.max-model-len", str(args.prompt_tokens + args.max_tokens + 64)]
    extra += ["--model.enforce-eager", "--max-num-seqs", str(args.groups * args.samples), "--block-size", str(block)]
    server = InferenceServer(args.model, out / f"block-{block}", extra=extra, api_key=API_KEY)
    try:
        server.wait_healthy()
        rng = random.Random(0)
        rows = []
        for i in range(args.rounds + 1):
            c0, t0, n0 = cpu_by_pid(tree(server.proc.pid)), time.perf_counter(), counters(server)
            asyncio.run(one_round(server, args, rng, vocab))
            wall, n1 = time.perf_counter() - t0, counters(server)
            cpu = cpu_delta(c0, cpu_by_pid(tree(server.proc.pid)))
            if i:  # the first round warms up
                hits = n1["hits"] - n0["hits"]
                rows.append({"wall": wall, "cpu": cpu, "computed": n1["prompt"] - n0["prompt"] - hits, "hits": hits})
        return {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    finally:
        server.stop()


def add_step_shape(p: argparse.ArgumentParser) -> None:
    """The model and a GRPO step's shape: groups of samples of one prompt (default: the demo's)."""
    p.add_argument("--model", type=Path, help="a HF model dir (default: a random-init model of the demo's shape)")
    p.add_argument("--groups", type=int, default=8, help="prompts per round")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt-tokens", type=int, default=108)
    p.add_argument("--max-tokens", type=int, default=16)


def model_and_vocab(args, out: Path) -> int:
    """Builds the demo-shaped model into `out` where `--model` names none (sets `args.model`); its vocab size."""
    if args.model is None:
        demo = tomllib.loads(DEMO_MODEL.read_text())
        args.model = build_tiny_model(TinyModelConfig(**{**demo, "output": out / "model"}))
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(args.model).vocab_size


def step_shape(args) -> str:
    return f"{args.groups} prompts of {args.prompt_tokens} tokens x {args.samples} samples of {args.max_tokens}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_shape(p)
    p.add_argument("--dtype", default="float32", help="the served dtype (the demo's and bench's samplers: float32)")
    p.add_argument("--block-sizes", type=int, nargs="+", default=[128, 32], help="KV block sizes, in tokens")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds, after one warm-up")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-blocks-") as tmp:
        out = Path(tmp)
        vocab = model_and_vocab(args, out)
        shape = step_shape(args)
        print(f"{args.model}, {args.dtype}; {shape}; median of {args.rounds} rounds after 1")
        print("| KV block | s/round | server CPU s/round | prompt tokens computed | from the prefix cache |")
        print("|---|---|---|---|---|")
        for block in args.block_sizes:
            r = bench(block, args, out, vocab)
            print(f"| {block} | {r['wall']:.3f} | {r['cpu']:.3f} | {r['computed']:.0f} | {r['hits']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
