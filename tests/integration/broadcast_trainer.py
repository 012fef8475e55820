"""A stand-in trainer for the vLLM weight-broadcast tests: the real trainer's sending side (`WeightSender` serving from
the trainer's own wait loop, on a one-rank world) over a plain transformers model instead of FSDP training.

    python broadcast_trainer.py --port P 1=/dir/a 2=/dir/b [--die-in-step 2 --die-after-groups 1]

Publishes each `step=dir` in turn (the directory's weights as policy `step`), waiting each time until the
orchestrator has taken it, then keeps serving until the orchestrator says it is done. `--die-in-step S
--die-after-groups G` exits (as a crashed trainer) after sending G layer buffers of step S."""

import argparse
import os
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import prime_rl.trainer.broadcast as sending
from prime_rl.config import WeightBroadcastConfig
from prime_rl.trainer.broadcast import WeightSender
from prime_rl.trainer.distributed import init_distributed
from prime_rl.trainer.train import wait_until
from prime_rl.weight_broadcast import ORCHESTRATOR_DONE


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=60)
    parser.add_argument("--die-in-step", type=int)
    parser.add_argument("--die-after-groups", type=int, default=1)
    parser.add_argument("steps", nargs="+", help="step=model_dir")
    args = parser.parse_args()
    steps = [(int(s), Path(d)) for s, d in (a.split("=", 1) for a in args.steps)]

    world = init_distributed()
    config = WeightBroadcastConfig(type="gloo", port=args.port, timeout=args.timeout)
    sender = WeightSender(config, world)
    model = AutoModelForCausalLM.from_pretrained(steps[0][1], dtype=torch.float32)
    run = SimpleNamespace(model=model, export_dtype=torch.bfloat16)

    real_send, sent_in_fatal_step = sending.send_tensors, []

    def send_tensors(group, tensors, dtype, device):
        if sender.step == args.die_in_step:
            if len(sent_in_fatal_step) >= args.die_after_groups:
                os._exit(7)  # mid-transfer, as a trainer killed by the OOM killer
            sent_in_fatal_step.append(len(tensors))
        real_send(group, tensors, dtype, device)

    sending.send_tensors = send_tensors

    for step, model_dir in steps:
        state = {}
        for file in sorted(model_dir.glob("*.safetensors")):
            state.update(load_file(file))
        model.load_state_dict(state, strict=False)  # a tied lm_head is not stored
        sender.publish(step)
        print(f"published step {step}", flush=True)
        wait_until(world, lambda step=step: sender.taken_or_unwanted(step), f"step {step} taken", 300, sender, run)
    done = lambda: sender.store.check([ORCHESTRATOR_DONE])  # noqa: E731
    wait_until(world, done, "the orchestrator to finish", 300, sender, run)
    sender.close()  # the patched send_tensors above keeps `sender` alive until interpreter exit otherwise


if __name__ == "__main__":
    main()
