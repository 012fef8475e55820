"""A process on the same machine that knows the trainer's store address but not the run secret, and tries what an
attacker (or a careless client) would: read the session and the published step, announce a step, ask for a transfer,
tell the trainer to stop waiting, and join a transfer group. Prints one JSON object: each attempt -> "refused: ..." or
"SUCCEEDED: ...". Used by test_weight_broadcast_store.py; against the TCPStore this project used before, every
attempt succeeded."""

import json
import socket
import sys
from datetime import timedelta

from torch.distributed import TCPStore


def attempt(results: dict, name: str, fn) -> None:
    try:
        results[name] = f"SUCCEEDED: {fn()!r}"[:200]
    except Exception as e:
        results[name] = f"refused: {type(e).__name__}: {e}"[:300]


def main() -> None:
    host, port = sys.argv[1], int(sys.argv[2])
    results: dict[str, str] = {}

    try:  # one client for every TCPStore attempt: a refused connection takes it seconds
        store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=3))
    except Exception as e:
        store, error = None, e

    def torch_store():
        if store is None:
            raise error
        return store

    attempt(results, "read session (TCPStore client)", lambda: torch_store().get("session"))
    attempt(results, "list keys (TCPStore client)", lambda: torch_store().list_keys())
    attempt(results, "announce a step (TCPStore client)", lambda: torch_store().set("published", "999"))
    attempt(results, "stop the trainer (TCPStore client)", lambda: torch_store().set("orchestrator_done", "1"))
    attempt(results, "request a transfer (TCPStore client)", lambda: torch_store().set("request/1", "{}"))

    from prime_rl.utils.secret import STORE_PURPOSE, derive
    from prime_rl.weight_broadcast.client import StoreClient
    from prime_rl.weight_broadcast.transfer import join_group

    def guessed(secret: str):  # the key a guessed secret derives
        return StoreClient(host, port, derive(secret, STORE_PURPOSE), 3)

    for secret in ("", "prime-rl", "0" * 64, "changeme" * 4):
        attempt(results, f"authenticate with {secret!r}", lambda secret=secret: guessed(secret).get("session", 0))
    attempt(results, "join a group (guessed secret)", lambda: join_group(guessed("0" * 64), "ab" * 16, 1, 2, "gloo", 3))

    def raw_bytes() -> bytes:
        with socket.create_connection((host, port), timeout=3) as s:
            hello = s.recv(64)  # what anyone gets: the greeting and a random challenge, nothing of the store
            s.sendall(b"\x00" * 64 + b"set published 999\n" * 10)
            s.settimeout(3)
            rest = s.recv(64)
            if rest:
                return hello + rest
            raise ConnectionError(f"closed after the greeting ({len(hello)} bytes: {hello[:16]!r}...)")

    attempt(results, "raw bytes", raw_bytes)
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
