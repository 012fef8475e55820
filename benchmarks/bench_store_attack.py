"""A legitimate client's latency against the weight-broadcast store while someone without the run secret attacks its
capacity (issue 52): connect + authenticate + one call + close, N times in a row, with no attack, under a slow
trickle, and under reconnect floods (tests/unit/store_attacker.py, each attack its own process, as an attacker is).

The store runs in a process of its own, as trainer rank 0 hosts it; the client runs here. Prints a table: how many
tries succeeded, and the median, p95 and max seconds of those that did.

    python benchmarks/bench_store_attack.py [--tries 50] [--spacing 0.2] [--timeout 5]

(To measure another version of the store, run it with that version first on PYTHONPATH.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from prime_rl.weight_broadcast.client import StoreClient
from prime_rl.weight_broadcast.wire import StoreError

ATTACKER = Path(__file__).resolve().parents[1] / "tests" / "unit" / "store_attacker.py"
KEY = bytes(range(32))
SCENARIOS = {
    "no attack": None,
    "trickle: 64 connections, 1 byte / 2 s": ["trickle", "--connections", "64", "--every", "2"],
    "flood: 64 threads, each sitting until closed": ["flood", "--threads", "64", "--sit"],
    "flood: 64 threads, connect + close": ["flood", "--threads", "64", "--keep", "0"],
    "flood: 64 threads x 32 held (2048 at once)": ["flood", "--threads", "64", "--keep", "32"],
}


def serve() -> None:
    """The store, in this process until stdin closes."""
    from prime_rl.weight_broadcast.store import StoreServer

    server = StoreServer("127.0.0.1", 0, KEY)
    print(server.port, flush=True)
    sys.stdin.read()
    server.close()


def one_client(port: int, timeout: float) -> float | None:
    start = time.monotonic()
    try:
        c = StoreClient("127.0.0.1", port, KEY, timeout)
        c.check(["anything"])
        c.close()
    except StoreError:
        return None
    return time.monotonic() - start


def measure(port: int, attack: list[str] | None, tries: int, spacing: float, timeout: float) -> dict:
    attacker = None
    if attack is not None:
        command = [sys.executable, str(ATTACKER), attack[0], "127.0.0.1", str(port), "--seconds", "600", *attack[1:]]
        attacker = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        assert attacker.stdout.readline().strip() == "started"
        time.sleep(2.0)  # the attack at full strength
    try:
        took = []
        for _ in range(tries):  # spread over several handshake deadlines: the attack renews itself meanwhile
            took.append(one_client(port, timeout))
            time.sleep(spacing)
        still_attacking = attacker is None or attacker.poll() is None
    finally:
        if attacker is not None:
            attacker.terminate()
    summary = json.loads(attacker.communicate(timeout=60)[0].splitlines()[-1]) if attacker is not None else {}
    ok = sorted(t for t in took if t is not None)
    return {
        "ok": len(ok),
        "median": statistics.median(ok) if ok else float("nan"),
        "p95": ok[min(len(ok) - 1, int(0.95 * len(ok)))] if ok else float("nan"),
        "max": ok[-1] if ok else float("nan"),
        "attack connections": summary.get("opened", summary.get("connections", 0)),
        "valid": still_attacking,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tries", type=int, default=50)
    parser.add_argument("--spacing", type=float, default=0.2, help="seconds between tries")
    parser.add_argument("--timeout", type=float, default=5.0, help="the client's timeout (and connect deadline)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve()
        return
    store = subprocess.Popen(
        [sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(store.stdout.readline())
        print(
            f"{args.tries} tries each of connect + authenticate + check + close, {args.spacing:g} s apart, "
            f"timeout {args.timeout:g} s"
        )
        print(f"{'scenario':46} {'ok':>7} {'median s':>9} {'p95 s':>8} {'max s':>8} {'attack conns':>13}")
        for name, attack in SCENARIOS.items():
            r = measure(port, attack, args.tries, args.spacing, args.timeout)
            note = "" if r["valid"] else "  (the attack ended early)"
            print(
                f"{name:46} {r['ok']:>3}/{args.tries:<3} {r['median']:9.4f} {r['p95']:8.4f} {r['max']:8.4f} "
                f"{r['attack connections']:>13}{note}",
                flush=True,
            )
    finally:
        store.communicate("", timeout=30)


if __name__ == "__main__":
    main()
