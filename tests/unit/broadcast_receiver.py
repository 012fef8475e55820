"""A stand-in inference worker for the weight-broadcast protocol tests (the real one lives inside vLLM).

Reads one JSON line per transfer on stdin: the body the orchestrator sends a server (`broadcast`), the server's own
settings (`settings`: host, port, timeout, key) and test-only fields; joins or reuses the group as a vLLM worker does
(through the trainer's store, with the store key its settings carry, as the server hands it to its workers), receives the transfer and answers one JSON
line: {"step": n} after saving the tensors to `out`, {"refused": ...} or {"error": ...}. Test-only fields: `refuse`
(say no to the header), `die_after` (exit after receiving that many tensors, as a crashed worker)."""

import json
import os
import sys

import torch

from prime_rl.weight_broadcast.client import StoreClient
from prime_rl.weight_broadcast.protocol import read_session
from prime_rl.weight_broadcast.transfer import agree, join_group, receive_header, receive_tensors

CPU = torch.device("cpu")
HEADER_LIMIT = 1 << 20


def main() -> None:
    groups: dict = {}
    for line in sys.stdin:
        line = json.loads(line)
        spec, settings = line["broadcast"], line["settings"]
        key = (spec["session"], spec["group"])
        try:
            if key not in groups:
                groups.clear()
                store = StoreClient(
                    settings["host"], settings["port"], bytes.fromhex(settings["key"]), settings["timeout"]
                )
                assert read_session(store, 5)["id"] == spec["session"], "stale session"
                group = join_group(store, spec["group"], spec["rank"], spec["world_size"], "gloo", settings["timeout"])
                groups[key] = (store, group)
            group = groups[key][1]
            header = receive_header(group, CPU, HEADER_LIMIT, settings["timeout"])
            if not agree(group, not line.get("refuse"), CPU, settings["timeout"]):
                print(json.dumps({"refused": True}), flush=True)
                continue
            received = {}
            for name, tensor in receive_tensors(group, header, CPU, settings["timeout"]):
                received[name] = tensor.clone()
                if line.get("die_after") is not None and len(received) >= line["die_after"]:
                    os._exit(3)
            torch.save(received, line["out"])
            print(json.dumps({"step": header.step}), flush=True)
        except Exception as e:
            groups.clear()
            print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)


if __name__ == "__main__":
    main()
