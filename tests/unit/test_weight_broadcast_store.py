"""The authenticated weight-broadcast store, attacked: a process without the run secret, a squatter on the port, a
silent peer, tampered frames, a connection flood, oversize writes. And the store semantics gloo/NCCL rely on."""

import gc
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from conftest import TEST_KEY

from prime_rl.weight_broadcast.client import StoreClient
from prime_rl.weight_broadcast.store import HANDSHAKE_SECONDS, MAX_HANDSHAKES, MAX_KEYS, StoreServer, Table
from prime_rl.weight_broadcast.transfer import GroupStore, keep_store_alive
from prime_rl.weight_broadcast.wire import (
    MAX_VALUE_BYTES,
    StoreAuthError,
    StoreError,
    StoreFull,
    StoreTimeout,
    StoreUnavailable,
)

ATTACKER = Path(__file__).with_name("store_attacker.py")


@pytest.fixture
def store():
    server = StoreServer("127.0.0.1", 0, TEST_KEY)
    yield server
    server.close()


def client(server: StoreServer, key: bytes = TEST_KEY, timeout: float = 5) -> StoreClient:
    return StoreClient("127.0.0.1", server.port, key, timeout)


def test_table_semantics_are_c10d_s():
    t = Table()
    t.set("a", b"1")
    assert t.get("a", 0) == b"1" and t.check(["a"]) and not t.check(["a", "b"])
    assert t.add("n", 3) == 3 and t.add("n", -1) == 2
    assert t.compare_set("c", b"", b"x") == b"x"  # unset and expected empty: set
    assert t.compare_set("c", b"y", b"z") == b"x"  # held value differs: unchanged
    assert t.compare_set("c", b"x", b"z") == b"z"
    assert t.compare_set("d", b"y", b"z") == b"y" and not t.check(["d"])
    assert t.take("a") == b"1" and t.take("a") is None
    t.set("g/1/0", b"x")
    t.set("g/1/1", b"y")
    t.set("g/10/0", b"z")
    assert t.delete_prefix("g/1/") == 2 and t.check(["g/10/0"])
    threading.Timer(0.2, t.set, args=("late", b"v")).start()
    start = time.monotonic()
    assert t.get("late", 5) == b"v" and time.monotonic() - start < 2  # woken by the write, not by polling
    with pytest.raises(StoreTimeout):
        t.get("never", 0.1)


def test_writes_over_the_bounds_are_refused_and_the_store_stays_usable(store):
    c = client(store)
    with pytest.raises(StoreFull, match="at most"):
        c.set("big", b"x" * (MAX_VALUE_BYTES + 1))
    with pytest.raises(StoreFull, match="keys are"):
        c.set("k" * 600, b"x")
    for i in range(MAX_KEYS - store.table.num_keys()):
        store.table.set(f"fill/{i}", b"")
    with pytest.raises(StoreFull, match="limit"):
        c.set("one-too-many", b"x")
    c.set("fill/0", b"overwriting a key is fine")
    assert c.get("fill/0", 0) == b"overwriting a key is fine"


def test_the_store_listens_on_its_address_only(store):
    """torch's TCPStore listened on every interface whatever host it was given."""
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.2", store.port), timeout=2).close()  # loopback, but not 127.0.0.1
    client(store).close()


def test_a_name_that_resolves_to_loopback_is_refused(monkeypatch):
    """Bound to its configured address, a store on a name that resolves to 127.0.1.1 (Debian's /etc/hosts entry
    for the machine's own name) would be unreachable from every other host: refused, naming both."""
    real = socket.getaddrinfo
    monkeypatch.setattr(
        socket, "getaddrinfo", lambda host, *a, **k: real("127.0.1.1" if host == "node0" else host, *a, **k)
    )
    with pytest.raises(OSError, match="'node0' resolves to 127.0.1.1"):
        StoreServer("node0", 0, TEST_KEY)
    StoreServer("localhost", 0, TEST_KEY).close()  # asked for


def test_a_process_without_the_secret_can_read_write_and_join_nothing(store):
    store.table.set("session", json.dumps({"id": "ab" * 16, "backend": "gloo"}))
    store.table.set("published", "1")
    before = dict(store.table.data)
    out = subprocess.run(
        [sys.executable, str(ATTACKER), "127.0.0.1", str(store.port)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout)
    assert len(results) == 11 and all(r.startswith("refused") for r in results.values()), results
    assert store.table.data == before  # nothing read back, nothing written
    assert client(store).get("published", 0) == b"1"  # and whoever holds the secret is served as before


def test_a_client_trusts_no_server_without_the_secret(store):
    """A process squatting the port (or a store of another run) cannot pass for the trainer's store."""
    impostor = StoreServer("127.0.0.1", 0, bytes(32))
    try:
        with pytest.raises(StoreAuthError, match="refused our run secret"):
            client(impostor)
    finally:
        impostor.close()
    listener = socket.create_server(("127.0.0.1", 0))  # something else entirely: not our protocol

    def greet_wrongly():
        conn, _ = listener.accept()
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n" + b" " * 40)
        time.sleep(2)
        conn.close()

    threading.Thread(target=greet_wrongly, daemon=True).start()
    with pytest.raises(StoreAuthError, match="not a prime-rl weight-broadcast store"):
        StoreClient("127.0.0.1", listener.getsockname()[1], TEST_KEY, 5)
    listener.close()


def test_a_silent_peer_fails_the_client_within_its_timeout_not_minutes():
    """A peer that accepts and never answers held a TCPStore client 35-70 s with a timeout of 5 s."""
    listener = socket.create_server(("127.0.0.1", 0))
    held = []
    threading.Thread(target=lambda: held.append(listener.accept()), daemon=True).start()
    start = time.monotonic()
    with pytest.raises(StoreTimeout, match="did not authenticate within 2 s"):
        StoreClient("127.0.0.1", listener.getsockname()[1], TEST_KEY, 60, connect_timeout=2)
    assert time.monotonic() - start < 4
    listener.close()


def test_a_store_that_goes_silent_midway_fails_each_call_within_its_timeout(store):
    c = client(store, timeout=1)
    with pytest.raises(StoreTimeout, match="'nothing' was not set within 0.5 s"):
        c.get("nothing", 0.5)  # a wait the store answers itself
    c = client(store, timeout=1)
    store.close()  # the trainer dies
    start = time.monotonic()
    with pytest.raises(StoreUnavailable):
        c.check(["x"])
    assert time.monotonic() - start < 2
    with pytest.raises(StoreUnavailable, match="closed"):
        c.check(["x"])  # a broken connection is never used again


def test_a_tampered_frame_drops_the_connection_and_nothing_else(store):
    c = client(store)
    c.set("a", b"1")
    c.channel.key = b"\0" * 32  # what an injected frame looks like to the server: a wrong MAC
    with pytest.raises(StoreError):
        c.set("a", b"2")
    assert client(store).get("a", 0) == b"1"


def test_a_connection_flood_is_bounded_and_the_store_recovers(store):
    """Connections that never authenticate hold a slot for at most HANDSHAKE_SECONDS, and at most MAX_HANDSHAKES of
    them at once: the rest are closed at once. A flood can delay a join, not hold the store."""
    socks = [socket.create_connection(("127.0.0.1", store.port), timeout=10) for _ in range(MAX_HANDSHAKES + 8)]
    time.sleep(0.5)
    closed_at_once = 0
    for s in socks[MAX_HANDSHAKES:]:
        s.settimeout(2)
        closed_at_once += s.recv(64) == b""
    assert closed_at_once == 8
    start = time.monotonic()
    for s in socks[:MAX_HANDSHAKES]:
        s.settimeout(HANDSHAKE_SECONDS + 5)
        while s.recv(64):  # the greeting, then the close
            pass
    assert time.monotonic() - start < HANDSHAKE_SECONDS + 3
    for s in socks:
        s.close()
    assert client(store).check(["anything"]) is False  # served again


def test_a_transfer_group_keeps_its_python_store_alive_for_c10d():
    """NCCL reaches a group's store from C++ at the first collective, after `join_group` returned. A Python store whose
    Python object is gone fails such a call (the first CUDA run's 'fn INTERNAL ASSERT FAILED ... Not implemented');
    `keep_store_alive` holds it for exactly as long as the group lives. A PrefixStore stands in for the C++ caller."""

    class Group:  # any object that can be weakly referenced, as c10d's process groups can
        pass

    store = GroupStore(Table(), "group/x/", 5)
    from_cpp = dist.PrefixStore("p/", store)
    group = Group()
    keep_store_alive(group, store)
    del store
    gc.collect()
    from_cpp.set("k", b"v")  # the store is still there while the group lives
    assert from_cpp.get("k") == b"v"
    del group
    gc.collect()
    with pytest.raises(RuntimeError, match="Not implemented"):  # the hazard itself, once nothing holds the store
        from_cpp.set("k2", b"v")
