"""A process on the same machine that knows the trainer's store address but not the run secret.

`store_attacker.py HOST PORT` tries what an attacker (or a careless client) would: read the session and the published
step, announce a step, ask for a transfer, tell the trainer to stop waiting, and join a transfer group. Prints one
JSON object: each attempt -> "refused: ..." or "SUCCEEDED: ...". Against the TCPStore this project used before,
every attempt succeeded.

Two attacks on the store's capacity instead (issue 52), each printing a JSON summary when done:
- `store_attacker.py flood HOST PORT --threads 64 --seconds S [--keep K | --sit]`: threads connecting as fast as they
  can, each keeping its last K connections open (0: closing each at once), or sitting on each until the store closes
  it;
- `store_attacker.py trickle HOST PORT --connections 64 --seconds S [--every 2]`: connections that each send one
  byte every few seconds and never a whole answer; one the store closes is opened again.
Each prints "started" first. Both are also importable (`flood`, `trickle`). Used by test_weight_broadcast_store.py and
benchmarks/bench_store_attack.py; against the store before issue 52, either stopped every legitimate client."""

import argparse
import collections
import json
import selectors
import signal
import socket
import sys
import threading
import time
from datetime import timedelta

STOP = threading.Event()
"""Set by SIGTERM in the standalone attacks: they stop early and still print their summary."""


def attempt(results: dict, name: str, fn) -> None:
    try:
        results[name] = f"SUCCEEDED: {fn()!r}"[:200]
    except Exception as e:
        results[name] = f"refused: {type(e).__name__}: {e}"[:300]


def flood(host: str, port: int, threads: int = 64, seconds: float = 10.0, keep: int = 0, sit: bool = False) -> dict:
    """`threads` threads connecting as fast as they can for `seconds`, each keeping its newest `keep` connections
    open; or (`sit`) each sitting on its connection until the store closes it, then connecting again at once (the
    review's attack: no trickle at all). Returns how many connections were made and how many attempts failed."""
    stop = time.monotonic() + seconds
    counts, lock = collections.Counter(), threading.Lock()

    def run() -> None:
        held: collections.deque = collections.deque()
        made = failed = 0
        while time.monotonic() < stop and not STOP.is_set():
            try:
                sock = socket.create_connection((host, port), timeout=2)
            except OSError:
                failed += 1
                continue
            made += 1
            if sit:
                _wait_for_close(sock, stop)
                continue
            held.append(sock)
            while len(held) > keep:
                held.popleft().close()
        for sock in held:
            sock.close()
        with lock:
            counts.update(connections=made, failed=failed)

    workers = [threading.Thread(target=run, daemon=True) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return {"attack": "flood", "threads": threads, "keep": keep, "sit": sit, "seconds": seconds, **counts}


def _wait_for_close(sock: socket.socket, stop: float) -> None:
    try:
        while (left := stop - time.monotonic()) > 0 and not STOP.is_set():
            sock.settimeout(min(left, 0.5))
            try:
                if not sock.recv(4096):
                    break
            except TimeoutError:
                continue
    except OSError:
        pass
    sock.close()


def trickle(host: str, port: int, connections: int = 64, seconds: float = 10.0, every: float = 2.0) -> dict:
    """`connections` connections that each send one byte every `every` seconds for `seconds`; each one the store
    closes is opened again. Returns how long the store let them live: `longest` of those it closed, `oldest_open` of
    those still open at the end (the store before issue 52 kept each for minutes, one byte at a time)."""
    selector = selectors.DefaultSelector()
    opened: dict[socket.socket, float] = {}
    lifetimes: list[float] = []
    refused = 0

    def open_one() -> None:
        nonlocal refused
        try:
            sock = socket.create_connection((host, port), timeout=2)
        except OSError:
            refused += 1
            return
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
        opened[sock] = time.monotonic()

    for _ in range(connections):
        open_one()
    end = time.monotonic() + seconds
    next_byte = time.monotonic() + every
    while (now := time.monotonic()) < end and not STOP.is_set():
        for key, _ in selector.select(max(0.0, min(end, next_byte, now + 0.5) - now)):
            sock = key.fileobj
            try:
                if sock.recv(4096):
                    continue  # the greeting, or the store's farewell before it closes
            except BlockingIOError:
                continue
            except OSError:
                pass
            lifetimes.append(time.monotonic() - opened.pop(sock))
            selector.unregister(sock)
            sock.close()
            open_one()
        if time.monotonic() >= next_byte:
            for sock in opened:
                try:
                    sock.send(b"\0")
                except OSError:
                    pass
            next_byte += every
    now = time.monotonic()
    oldest_open = max((now - t for t in opened.values()), default=0.0)
    for sock in opened:
        sock.close()
    return {
        "attack": "trickle",
        "connections": connections,
        "seconds": seconds,
        "every": every,
        "opened": len(lifetimes) + len(opened),
        "closed_by_store": len(lifetimes),
        "longest": max(lifetimes, default=0.0),
        "still_open": len(opened),
        "oldest_open": oldest_open,
        "refused": refused,
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("flood", "trickle"):
        parser = argparse.ArgumentParser(prog="store_attacker.py")
        parser.add_argument("attack", choices=["flood", "trickle"])
        parser.add_argument("host")
        parser.add_argument("port", type=int)
        parser.add_argument("--seconds", type=float, default=10.0)
        parser.add_argument("--threads", type=int, default=64, help="flood: connecting threads")
        parser.add_argument("--keep", type=int, default=0, help="flood: connections each thread keeps open")
        parser.add_argument("--sit", action="store_true", help="flood: sit on each connection until it is closed")
        parser.add_argument("--connections", type=int, default=64, help="trickle: connections")
        parser.add_argument("--every", type=float, default=2.0, help="trickle: seconds between bytes")
        args = parser.parse_args()
        signal.signal(signal.SIGTERM, lambda *_: STOP.set())
        print("started", flush=True)  # then the summary, on one line, when done
        if args.attack == "flood":
            result = flood(args.host, args.port, args.threads, args.seconds, args.keep, args.sit)
        else:
            result = trickle(args.host, args.port, args.connections, args.seconds, args.every)
        print(json.dumps(result), flush=True)
        return
    from torch.distributed import TCPStore

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
