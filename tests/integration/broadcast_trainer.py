"""A stand-in trainer for the vLLM weight-broadcast tests: the real trainer's sending side (`WeightSender` serving from
the trainer's own wait loop, on a one-rank world) over a plain transformers model instead of FSDP training.

    python broadcast_trainer.py --port P 1=/dir/a 2=/dir/b [--die-in-step 2 --die-after-groups 1]

Publishes each `step=dir` in turn (the directory's weights as policy `step`), waiting each time until the
orchestrator has taken it, then keeps serving until the orchestrator says it is done. `--bad-headers a,b` sends the
named broken headers (`BAD`) in the first transfers instead of the real one; `--header-delay S` stalls S seconds
after joining, before the first header. `--die-in-step S
--die-after-groups G` exits (as a crashed trainer) after sending G layer buffers of step S."""

import argparse
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import prime_rl.trainer.rl.broadcast as sending
from prime_rl.config import WeightBroadcastConfig
from prime_rl.trainer.parallel.distributed import init_distributed
from prime_rl.trainer.rl.batches import wait_until
from prime_rl.trainer.rl.broadcast import WeightSender
from prime_rl.weight_broadcast import transfer
from prime_rl.weight_broadcast.protocol import ORCHESTRATOR_DONE


def _header(**fields) -> bytes:
    return json.dumps({"step": 1, "dtype": "bfloat16", "groups": [[["x", [1]]]], **fields}).encode()


BAD = {
    "not-json": (None, b"not json {"),
    "a-list": (None, b"[1, 2]"),
    "huge-step": (None, _header(step=10**400)),  # killed vLLM's output thread once it reached the engine's label
    "string-step": (None, _header(step="abc")),
    "wrong-dtype": (None, _header(dtype="BF16")),
    "negative-size": (-1, b""),
    "huge-size": (2**62, b""),
}
"""Headers a broken trainer could send: (size announced or None for the real size, bytes)."""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=60)
    parser.add_argument("--die-in-step", type=int)
    parser.add_argument("--die-after-groups", type=int, default=1)
    parser.add_argument("--bad-headers", default="", help=f"comma-separated, one per transfer: {', '.join(BAD)}")
    parser.add_argument("--header-delay", type=float, default=0.0, help="seconds to stall before the first header")
    parser.add_argument("steps", nargs="+", help="step=model_dir")
    args = parser.parse_args()
    steps = [(int(s), Path(d)) for s, d in (a.split("=", 1) for a in args.steps)]

    world = init_distributed()
    config = WeightBroadcastConfig(type="gloo", port=args.port, timeout=args.timeout)
    sender = WeightSender(config, world)
    model = AutoModelForCausalLM.from_pretrained(steps[0][1], dtype=torch.float32)
    run = SimpleNamespace(model=model, export_dtype=torch.bfloat16)

    real_send, sent_in_fatal_step = sending.send_tensors, []

    def send_tensors(group, tensors, dtype, device, timeout):
        if sender.step == args.die_in_step:
            if len(sent_in_fatal_step) >= args.die_after_groups:
                os._exit(7)  # mid-transfer, as a trainer killed by the OOM killer
            sent_in_fatal_step.append(len(tensors))
        real_send(group, tensors, dtype, device, timeout)

    sending.send_tensors = send_tensors

    bad = [k for k in args.bad_headers.split(",") if k]
    real_send_header = sending.send_header

    delays = [args.header_delay] if args.header_delay else []

    def send_header(group, header, device, timeout):
        """The next bad header of `--bad-headers` instead of the real one (then the real one); `--header-delay`
        stalls before the first, as a trainer busy elsewhere after joining."""
        if delays:
            time.sleep(delays.pop())
        if not bad:
            return real_send_header(group, header, device, timeout)
        size, raw = BAD[bad.pop(0)]
        transfer._broadcast(group, torch.tensor([size if size is not None else len(raw)], dtype=torch.int64), timeout)
        if size is None:
            transfer._broadcast(group, torch.frombuffer(bytearray(raw), dtype=torch.uint8), timeout)

    sending.send_header = send_header

    for step, model_dir in steps:
        state = {}
        for file in sorted(model_dir.glob("*.safetensors")):
            state.update(load_file(file))
        model.load_state_dict(state, strict=False)  # a tied lm_head is not stored
        sender.publish(step)
        print(f"published step {step}", flush=True)
        wait_until(world, lambda step=step: sender.taken_or_unwanted(step), f"step {step} taken", 300, sender, run)
    done = lambda: sender.table.check([ORCHESTRATOR_DONE])  # noqa: E731
    wait_until(world, done, "the orchestrator to finish", 300, sender, run)
    sender.close()  # the patched send_tensors above keeps `sender` alive until interpreter exit otherwise


if __name__ == "__main__":
    main()
