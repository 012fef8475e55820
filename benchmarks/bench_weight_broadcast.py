"""Publish + swap time per step: the in-memory broadcast vs the filesystem, on a real `inference` server.

    uv run python benchmarks/bench_weight_broadcast.py                       # 0.4M, 100M and 0.44B parameters
    uv run python benchmarks/bench_weight_broadcast.py --sizes 0.4m --steps 5

For each size: build a local model of that shape (bf16, no hub), start one vLLM server on it, and load the same model
as the trainer does (FSDP2, fp32 masters; one rank here). Then, per step, time what a training step pays between its
optimizer step and the new weights being served, with the real code of each side:

- filesystem: the trainer's `publish` (gather the full state dict, write `broadcasts/step_n/` + STABLE) and the
  orchestrator's `InferenceServers.load_policy(n)` (every server reads and reloads the directory);
- broadcast (gloo): the trainer announces step n and waits until it is taken, sending when asked (`WeightSender`
  from the trainer's wait loop, in a thread); the orchestrator's `load_policy(n)` asks and the server receives
  layer by layer.

The weights change every step (scaled by 1 + 1e-3), so each swap loads new values. The first step of each kind
is warm-up (the broadcast's includes forming the group) and left out of the mean. Prints one table.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from prime_rl.config import WeightBroadcastConfig
from prime_rl.inference.process import InferenceServer
from prime_rl.inference.weights import safetensors_shapes
from prime_rl.models.tiny import TinyModelConfig, build_tiny_model
from prime_rl.orchestrator.broadcast import BroadcastClient
from prime_rl.orchestrator.servers import InferenceServers
from prime_rl.trainer.config import TrainerConfig
from prime_rl.trainer.parallel.distributed import init_distributed
from prime_rl.trainer.rl.batches import wait_until
from prime_rl.trainer.rl.broadcast import WeightSender
from prime_rl.trainer.rl.train import publish
from prime_rl.trainer.scaffold import build_run, load_tokenizer
from prime_rl.utils.net import free_port
from prime_rl.utils.secret import SECRET_VAR, new_secret

SIZES = {
    "0.4m": dict(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=256),
    "100m": dict(hidden_size=768, num_layers=16, num_heads=12, num_kv_heads=4, intermediate_size=2048),
    # Qwen3-0.6B's layers (28 x 1024, 16 / 8 heads of 128, MLP 3072), tied; the local tokenizer's vocabulary is
    # ~2.8k (its trainer finds no more merges), so 0.44B parameters instead of 0.6B.
    "0.5b": dict(
        hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, intermediate_size=3072,
        vocab_size=151_936,
    ),
}  # fmt: skip
KEY_VAR = "PRIME_BENCH_API_KEY"


def bench_size(size: str, steps: int, root: Path) -> dict:
    base = build_tiny_model(TinyModelConfig(output=root / "base", **SIZES[size]))
    params = sum(math.prod(shape) for shape in safetensors_shapes(base).values())
    out = root / "out"
    extra = ["--model.enforce-eager", "--model.max-model-len", "512", "--allowed-weight-roots", str(root)]
    port = free_port()  # the trainer's store: the server's own config says where it is
    extra += ["--weight-broadcast.type", "gloo", "--weight-broadcast.port", str(port)]
    os.environ.setdefault(SECRET_VAR, new_secret())  # the run secret, shared with the server by the environment
    server = InferenceServer(base, root / "server", extra=extra, api_key="bench")
    os.environ[KEY_VAR] = "bench"
    try:
        server.wait_healthy(timeout=1200)
        broadcast = WeightBroadcastConfig(type="gloo", port=port, timeout=300)
        config = TrainerConfig(model={"name": str(base)}, output_dir=out, weight_broadcast=broadcast)
        world = init_distributed()
        run = build_run(config, world, "trainer", None, "benchmarking")
        tokenizer = load_tokenizer(config.model)
        sender = WeightSender(broadcast, world)
        url = [f"{server.url}/v1"]
        filesystem = InferenceServers(url, KEY_VAR, 600, out)
        in_memory = InferenceServers(url, KEY_VAR, 600, out, BroadcastClient(broadcast, ack_timeout=600))

        def new_weights() -> None:
            with torch.no_grad():
                for p in run.model.parameters():
                    p.mul_(1 + 1e-3)

        async def by_filesystem(step: int) -> float:
            start = time.perf_counter()
            await asyncio.to_thread(publish, run, tokenizer, step, None, config, world, None)
            await filesystem.load_policy(step)
            return time.perf_counter() - start

        async def by_broadcast(step: int) -> float:
            start = time.perf_counter()
            sender.publish(step)

            def serve() -> None:
                taken = lambda: sender.taken_or_unwanted(step)  # noqa: E731
                wait_until(world, taken, f"step {step} taken", 600, sender, run)

            trainer = asyncio.create_task(asyncio.to_thread(serve))
            await in_memory.load_policy(step)
            await trainer
            assert in_memory.version == step
            return time.perf_counter() - start

        async def measure() -> dict[str, list[float]]:
            times = {"filesystem": [], "broadcast": []}
            for i in range(1, steps + 1):
                for kind, swap in (("filesystem", by_filesystem), ("broadcast", by_broadcast)):
                    new_weights()
                    times[kind].append(await swap(2 * i if kind == "filesystem" else 2 * i + 1))
            await filesystem.close()
            await in_memory.close(finished=True)
            return times

        times = asyncio.run(measure())
        sender.close()
        return {"size": size, "params": params, "startup": server.startup_seconds, **times}
    finally:
        server.stop()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["0.4m", "100m", "0.5b"])
    parser.add_argument("--steps", type=int, default=4, help="steps of each kind (the first is warm-up)")
    args = parser.parse_args()
    rows = []
    for size in args.sizes:
        with tempfile.TemporaryDirectory() as tmp:
            result = bench_size(size, args.steps, Path(tmp))
        rows.append(result)
        fs, bc = (statistics.fmean(result[k][1:]) for k in ("filesystem", "broadcast"))
        print(
            f"{size}: {result['params'] / 1e6:.1f}M params, server up in {result['startup']:.0f} s; "
            f"filesystem {[round(t, 3) for t in result['filesystem']]} s, "
            f"broadcast {[round(t, 3) for t in result['broadcast']]} s",
            flush=True,
        )
    print("\n| model | params | filesystem publish + swap | broadcast publish + swap | filesystem / broadcast |")
    print("|---|---|---|---|---|")
    for r in rows:
        fs, bc = (statistics.fmean(r[k][1:]) for k in ("filesystem", "broadcast"))
        print(f"| {r['size']} | {r['params'] / 1e6:.1f}M | {fs:.3f} s | {bc:.3f} s | {fs / bc:.1f}x |")


if __name__ == "__main__":
    main()
