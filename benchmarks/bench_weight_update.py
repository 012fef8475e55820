"""Server start time and `/update_weights` latency on a real `inference` server.

    uv run python benchmarks/bench_weight_update.py --size tiny
    uv run python benchmarks/bench_weight_update.py --size 100m --swaps 5

Builds a local model of the chosen size (no hub), starts the server, then alternates the served
weights between two directories and reports the server-side swap time and the client round trip.
"""

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from prime_rl.inference.process import InferenceServer
from prime_rl.inference.weights import safetensors_shapes
from prime_rl.models.tiny import TinyModelConfig, build_tiny_model, perturb_weights

SIZES = {
    "tiny": dict(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=256),
    "100m": dict(hidden_size=768, num_layers=16, num_heads=12, num_kv_heads=4, intermediate_size=2048),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--swaps", type=int, default=10)
    parser.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True, help="--model.enforce-eager")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = build_tiny_model(TinyModelConfig(output=root / "base", **SIZES[args.size]))
        other = perturb_weights(base, root / "other")
        n_params = sum(math.prod(shape) for shape in safetensors_shapes(base).values())
        extra = ["--model.max-model-len", "512", "--allowed-weight-roots", str(root)]
        if args.eager:
            extra.append("--model.enforce-eager")
        server = InferenceServer(base, root / "out", extra=extra)
        try:
            server.wait_healthy(timeout=900)
            server_side, round_trip = [], []
            for i in range(args.swaps):
                target = other if i % 2 == 0 else base
                start = time.perf_counter()
                r = httpx.post(f"{server.url}/update_weights", json={"weight_dir": str(target)}, timeout=600)
                round_trip.append(time.perf_counter() - start)
                r.raise_for_status()
                server_side.append(r.json()["seconds"])
        finally:
            server.stop()

    print(f"model: {args.size} ({n_params / 1e6:.1f}M parameters), enforce_eager={args.eager}")
    print(f"server start to healthy: {server.startup_seconds:.1f} s")
    print(f"{'swaps':>6} {'server median s':>16} {'server max s':>13} {'round trip median s':>20}")
    print(
        f"{len(server_side):>6} {statistics.median(server_side):>16.4f} {max(server_side):>13.4f} "
        f"{statistics.median(round_trip):>20.4f}"
    )


if __name__ == "__main__":
    main()
