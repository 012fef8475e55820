"""A stand-in inference worker for the weight-broadcast protocol tests (the real one lives inside vLLM).

Reads one JSON spec per line on stdin (the body the orchestrator sends a server, plus test-only fields), joins or
reuses the group as a vLLM worker does, receives the transfer and answers one JSON line: {"step": n} after saving
the tensors to `spec["out"]`, {"refused": ...} or {"error": ...}. Test-only fields: `refuse` (say no to the header),
`die_after` (exit after receiving that many tensors, as a crashed worker)."""

import json
import os
import sys

import torch

from prime_rl.weight_broadcast import agree, connect_store, join_group, receive_header, receive_tensors

CPU = torch.device("cpu")


def main() -> None:
    groups: dict = {}
    for line in sys.stdin:
        spec = json.loads(line)
        key = (spec["session"], spec["generation"])
        try:
            if key not in groups:
                groups.clear()
                store = connect_store(spec["host"], spec["port"], spec["timeout"])
                group = join_group(
                    store,
                    spec["session"],
                    spec["generation"],
                    spec["rank"],
                    spec["world_size"],
                    "gloo",
                    spec["timeout"],
                )
                groups[key] = (store, group)
            group = groups[key][1]
            header = receive_header(group, CPU)
            if not agree(group, not spec.get("refuse"), CPU):
                print(json.dumps({"refused": True}), flush=True)
                continue
            received = {}
            for name, tensor in receive_tensors(group, header, CPU):
                received[name] = tensor.clone()
                if spec.get("die_after") is not None and len(received) >= spec["die_after"]:
                    os._exit(3)
            torch.save(received, spec["out"])
            print(json.dumps({"step": header.step}), flush=True)
        except Exception as e:
            groups.clear()
            print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)


if __name__ == "__main__":
    main()
