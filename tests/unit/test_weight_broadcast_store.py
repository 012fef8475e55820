"""The authenticated weight-broadcast store, attacked: a process without the run secret, a squatter on the port, a
silent or trickling peer, tampered frames, connection floods and trickles (issue 52), running out of file
descriptors, oversize writes. And the store semantics gloo/NCCL rely on."""

import gc
import json
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from conftest import TEST_KEY
from loguru import logger
from store_attacker import trickle

import prime_rl.weight_broadcast.store as store_module
from prime_rl.utils.net import free_port
from prime_rl.weight_broadcast.client import StoreClient
from prime_rl.weight_broadcast.store import (
    FAILING_SOURCE_FAILURES,
    FAILING_SOURCE_HANDSHAKES,
    HANDSHAKE_SECONDS,
    MAX_HANDSHAKES,
    MAX_HANDSHAKES_PER_SOURCE,
    MAX_KEYS,
    REPORT_SECONDS,
    StoreServer,
    Table,
)
from prime_rl.weight_broadcast.transfer import GroupStore, keep_store_alive
from prime_rl.weight_broadcast.wire import (
    BUSY,
    MAC_BYTES,
    MAGIC,
    MAX_VALUE_BYTES,
    NONCE_BYTES,
    StoreAuthError,
    StoreError,
    StoreFull,
    StoreTimeout,
    StoreUnavailable,
    recv_exact,
    sign,
)

ATTACKER = Path(__file__).with_name("store_attacker.py")
OUT_OF_FILES = Path(__file__).with_name("store_out_of_files.py")


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


def read_to_close(sock: socket.socket, seconds: float) -> bytes:
    """Everything the store sends on `sock` until it closes it (TimeoutError: not within `seconds`)."""
    sock.settimeout(seconds)
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


def test_a_connection_flood_is_bounded_and_the_store_recovers(store):
    """Connections that never authenticate are held at most MAX_HANDSHAKES at once, each until one deadline,
    HANDSHAKE_SECONDS after it connected (not per byte: issue 52). When all are taken a newcomer pushes out the
    oldest, so a client holding the secret is served even then; those pushed out are told to retry (BUSY)."""
    started = time.monotonic()
    socks = [socket.create_connection(("127.0.0.1", store.port), timeout=10) for _ in range(MAX_HANDSHAKES + 8)]
    for s in socks[:8]:  # the oldest, pushed out at once by the last 8: a greeting, then BUSY, then the close
        farewell = read_to_close(s, 3)
        assert farewell[: len(MAGIC)] == MAGIC and farewell.endswith(BUSY)
    assert time.monotonic() - started < HANDSHAKE_SECONDS - 1
    c = client(store)  # while every handshake slot is taken (it pushes out one more)
    assert c.check(["anything"]) is False
    for s in socks[8:]:
        farewell = read_to_close(s, HANDSHAKE_SECONDS + 5)
        assert farewell[: len(MAGIC)] == MAGIC and farewell.endswith(BUSY)
    assert time.monotonic() - started < HANDSHAKE_SECONDS + 3  # one deadline each, not 57x it
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


# -- issue 52: attacks on the store's capacity, deadlines, and a store that outlives them -------------------------


def served_within(server: StoreServer, seconds: float, **kwargs) -> float:
    """Connect a fresh client, make one call and close it; how long it took (it must succeed)."""
    start = time.monotonic()
    c = StoreClient("127.0.0.1", server.port, TEST_KEY, **{"timeout": 5, **kwargs})
    assert c.check(["anything"]) is False
    c.close()
    took = time.monotonic() - start
    assert took < seconds
    return took


def test_a_slow_trickle_holds_no_handshake_past_its_deadline_nor_keeps_a_client_out(store):
    """Issue 52: one byte every 4 s held a handshake slot ~5 minutes, and 32 such connections refused every client.
    Now 64 trickling connections (twice the old cap) are each closed HANDSHAKE_SECONDS after they connected, and a
    client holding the secret connects and is served meanwhile (a handshake takes milliseconds; 3 s allows a busy
    machine)."""
    result = {}
    attack = threading.Thread(
        target=lambda: result.update(trickle("127.0.0.1", store.port, 64, HANDSHAKE_SECONDS + 3, every=1.0))
    )
    attack.start()
    time.sleep(1.5)  # every trickler connected and has sent a byte or two
    for _ in range(3):
        served_within(store, 3)
    attack.join()
    assert result["closed_by_store"] >= 64, result  # the first 64, at their deadline
    assert result["longest"] < HANDSHAKE_SECONDS + 1.5, result
    assert result["oldest_open"] < HANDSHAKE_SECONDS + 1.5, result


def start_attack(*args: str) -> subprocess.Popen:
    attacker = subprocess.Popen(
        [sys.executable, str(ATTACKER), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert attacker.stdout.readline().strip() == "started", attacker.communicate()
    return attacker


def test_a_reconnect_flood_keeps_no_legitimate_client_out(store):
    """Issue 52: 64 threads reconnecting in a loop, no trickle at all, refused every client. Here 32 threads sit on
    each connection until the store closes it (the review's attack) and 32 more connect as fast as they can keeping
    32 connections each (2048 at once: the handshake table overflows and pushes out its oldest all the time). 20
    fresh clients in a row are each served within their 5 s connect deadline, while both attacks still run."""
    port = str(store.port)
    attackers = [
        start_attack("flood", "127.0.0.1", port, "--threads", "32", "--seconds", "120", "--sit"),
        start_attack("flood", "127.0.0.1", port, "--threads", "32", "--seconds", "120", "--keep", "32"),
    ]
    try:
        time.sleep(1.0)
        took = [served_within(store, 5) for _ in range(20)]
        assert all(a.poll() is None for a in attackers), "the attack ended before the clients did"
    finally:
        for a in attackers:
            a.terminate()  # it stops, and still says what it did
    summaries = [json.loads(a.communicate(timeout=60)[0].splitlines()[-1]) for a in attackers]
    assert summaries[1]["connections"] > 2 * MAX_HANDSHAKES, summaries  # a real flood
    print(f"20 clients under a flood: median {sorted(took)[10]:.3f} s, max {max(took):.3f} s; {summaries}")


def test_an_attack_is_logged_with_its_address_within_seconds_and_the_log_is_rate_limited(store):
    """Issue 52: refused and timed-out handshakes were never logged. Failed handshakes are counted per peer address:
    the first is logged at once, then a count at most every REPORT_SECONDS, each kind by name."""
    messages: list[str] = []
    sink = logger.add(messages.append, level="WARNING", format="{message}")
    try:
        start = time.monotonic()
        sitting = [socket.create_connection(("127.0.0.1", store.port), timeout=10) for _ in range(40)]
        for _ in range(5):
            with socket.create_connection(("127.0.0.1", store.port), timeout=10) as s:
                recv_exact(s, len(MAGIC) + NONCE_BYTES)
                s.sendall(bytes(NONCE_BYTES + MAC_BYTES))  # a wrong answer
                assert read_to_close(s, 5) == b""  # closed without a word: a wrong key is never told to retry
        for _ in range(300):
            socket.create_connection(("127.0.0.1", store.port), timeout=10).close()
        while not any("127.0.0.1" in m and "did not authenticate" in m for m in messages):
            assert time.monotonic() - start < 2, messages  # an operator sees it within seconds
            time.sleep(0.05)
        reported = {"timed out": 0, "wrong key": 0, "hung up": 0}
        while reported["timed out"] < 40:
            assert time.monotonic() - start < HANDSHAKE_SECONDS + REPORT_SECONDS + 3, messages
            time.sleep(0.1)
            for kind in reported:
                reported[kind] = sum(int(n) for m in messages for n in re.findall(rf"(\d+) {kind}", m))
        elapsed = time.monotonic() - start
    finally:
        logger.remove(sink)
    assert reported == {"timed out": 40, "wrong key": 5, "hung up": 300}, messages
    assert all("firewall this port" in m for m in messages)
    assert len(messages) <= 2 + elapsed / REPORT_SECONDS, messages  # 345 failures, a handful of lines
    for s in sitting:
        s.close()


def test_the_store_outlives_running_out_of_file_descriptors():
    """Issue 52: one failed `accept` (EMFILE) ended the store for the rest of the run, its socket still listening.
    Here the store's process runs out of descriptors for real: clients fail meanwhile, the failure is logged, and
    once descriptors are free again a client is served (within its 5 s deadline: the accept loop backs off 1 s at
    most)."""
    store = subprocess.Popen(
        [sys.executable, str(OUT_OF_FILES), TEST_KEY.hex()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(store.stdout.readline())
        store.stdin.write("fill\n")
        store.stdin.flush()
        assert store.stdout.readline().strip() == "full"
        failed = 0
        for _ in range(3):  # accepts fail: nothing answers (a thread blocked in `accept` holds one descriptor)
            try:
                StoreClient("127.0.0.1", port, TEST_KEY, 5, connect_timeout=1).close()
            except (StoreTimeout, StoreUnavailable):
                failed += 1
        assert failed >= 2
        store.stdin.write("free\n")
        store.stdin.flush()
        assert store.stdout.readline().strip() == "freed"
        start = time.monotonic()
        c = StoreClient("127.0.0.1", port, TEST_KEY, 5)
        c.set("after", b"EMFILE")
        assert c.get("after", 0) == b"EMFILE" and time.monotonic() - start < 5
        c.close()
    finally:
        _, stderr = store.communicate("", timeout=30)
    assert "accepting a connection failed" in stderr and "Too many open files" in stderr, stderr


def trickling_peer(listener: socket.socket, data: bytes, every: float, handshake_key: bytes | None = None) -> None:
    """Accept one connection and send `data` one byte every `every` seconds; with `handshake_key`, first pass the
    store's handshake with it (a store that authenticates, then trickles its replies)."""
    conn, _ = listener.accept()
    with conn:
        try:
            if handshake_key is not None:
                nonce = os.urandom(NONCE_BYTES)
                conn.sendall(MAGIC + nonce)
                answer = recv_exact(conn, NONCE_BYTES + MAC_BYTES)
                conn.sendall(sign(handshake_key, b"server", nonce, answer[:NONCE_BYTES]))
                recv_exact(conn, 4)  # a request began
            for byte in data:
                conn.sendall(bytes([byte]))
                time.sleep(every)
        except OSError:
            pass  # the client gave up: what the test expects


def test_a_trickling_peer_fails_the_client_within_its_deadline_not_minutes():
    """Issue 52: the client's timeouts were per `recv`, so a squatter on the store's port trickling bytes held
    `StoreClient(timeout=1)` for 71 s. The handshake has one deadline, and so has each call, however the peer sends."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    squatter = MAGIC + os.urandom(NONCE_BYTES) + os.urandom(MAC_BYTES)  # a greeting, then a proof: 80 bytes
    threading.Thread(target=trickling_peer, args=(listener, squatter, 0.2), daemon=True).start()
    start = time.monotonic()
    with pytest.raises(StoreTimeout, match="did not authenticate within 1 s"):
        StoreClient("127.0.0.1", port, TEST_KEY, timeout=1)
    assert time.monotonic() - start < 2.5  # 1 s and some slack; the trickle would have lasted 16 s

    reply = struct.pack(">I", 40) + bytes(40 + MAC_BYTES)  # a frame, one byte every 0.2 s: 15 s
    threading.Thread(target=trickling_peer, args=(listener, reply, 0.2, TEST_KEY), daemon=True).start()
    c = StoreClient("127.0.0.1", port, TEST_KEY, timeout=1)
    start = time.monotonic()
    with pytest.raises(StoreTimeout, match="did not answer within 1 s"):
        c.check(["x"])
    assert time.monotonic() - start < 2.5
    listener.close()


def test_three_hundred_clients_at_once_are_all_served(store):
    """Issue 52: of 300 clients connecting at once, 44 were refused (256 connections at most, 32 handshakes). All 300
    are served now, and hold their connections at the same time."""
    n = 300
    start, done, release = threading.Barrier(n), threading.Barrier(n + 1), threading.Event()
    errors: list[BaseException] = []

    def one() -> None:
        c = None
        try:
            start.wait()
            c = StoreClient("127.0.0.1", store.port, TEST_KEY, timeout=30)
            c.add("joined", 1)
        except BaseException as e:
            errors.append(e)
        finally:
            done.wait()  # every connection is open at once here
            release.wait(60)
            if c is not None:
                c.close()

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    done.wait()
    held = len(store.connections)
    release.set()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert store.table.get("joined", 0) == str(n).encode() and held == n


def test_an_idle_connection_is_closed_and_its_client_reconnects_by_itself():
    """Authenticated connections kept capacity forever (issue 52). One without a request for `idle_seconds` is
    closed (a `get` waiting for its key is a request), with TCP keepalive on meanwhile; its client reconnects at its
    next call, within that call's deadline, and a request is never served twice."""
    server = StoreServer("127.0.0.1", 0, TEST_KEY, idle_seconds=0.5)
    try:
        c = client(server)
        c.set("a", b"1")
        (conn,) = server.connections
        keepalive = socket.SOL_SOCKET, socket.SO_KEEPALIVE
        assert conn.getsockopt(*keepalive) and c.sock.getsockopt(*keepalive)
        deadline = time.monotonic() + 3
        while server.connections:
            assert time.monotonic() < deadline, "the idle connection was not closed"
            time.sleep(0.05)
        assert c.add("n", 1) == 1 and c.reconnects == 1  # not idempotent: reconnected before it was sent
        threading.Timer(1.5, server.table.set, args=("late", b"v")).start()
        assert c.get("late", 5) == b"v" and c.reconnects == 1  # waiting 1.5 s is not idle
        # A request that crosses the store's idle farewell is never served: sent again on a new connection.
        time.sleep(1.0)
        c._readable = lambda: False  # as if it were sent the instant before the farewell came
        assert c.add("n", 1) == 2 and c.reconnects == 2
        assert server.table.get("n", 0) == b"2"
        c.close()
    finally:
        server.close()


def test_a_client_retries_a_store_not_yet_up_or_busy_but_never_a_wrong_key():
    port = free_port()
    late: list[StoreServer] = []
    threading.Timer(1.0, lambda: late.append(StoreServer("127.0.0.1", port, TEST_KEY))).start()
    start = time.monotonic()
    c = StoreClient("127.0.0.1", port, TEST_KEY, timeout=5)  # refused for a second: tried again with backoff
    assert 0.9 < time.monotonic() - start < 5 and c.check(["x"]) is False
    c.close()
    try:
        start = time.monotonic()
        with pytest.raises(StoreAuthError, match="refused our run secret"):
            StoreClient("127.0.0.1", port, bytes(32), timeout=5)
        assert time.monotonic() - start < 1  # at once, not after 5 s of retrying
    finally:
        late[0].close()
    start = time.monotonic()
    with pytest.raises(StoreUnavailable, match="refused"):  # for a caller that polls by itself
        StoreClient("127.0.0.1", port, TEST_KEY, timeout=5, retry_refused=False)
    assert time.monotonic() - start < 1


def test_a_full_store_turns_clients_away_to_retry_and_says_so(store, monkeypatch):
    """With MAX_CONNECTIONS authenticated connections open, one more is told BUSY instead of the proof (it holds the
    secret: the log says it was turned away, not that someone is attacking), and retries until one closes."""
    monkeypatch.setattr(store_module, "MAX_CONNECTIONS", 2)
    messages: list[str] = []
    sink = logger.add(messages.append, level="WARNING", format="{message}")
    try:
        first, second = client(store), client(store)
        threading.Timer(1.0, first.close).start()
        start = time.monotonic()
        third = client(store)
        assert 0.9 < time.monotonic() - start < 5 and third.check(["x"]) is False
    finally:
        logger.remove(sink)
    assert any("turned away" in m and "127.0.0.1" in m for m in messages), messages
    second.close()
    third.close()


def eventually(condition, seconds: float = 3.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "not within the bound"
        time.sleep(0.02)


def test_one_remote_address_cannot_take_every_handshake(store):
    """A second layer for addresses other than loopback (where every local process shares one address, so the
    global capacity and its eviction order are what protect): one source holds MAX_HANDSHAKES_PER_SOURCE pending
    handshakes, pushing out its own oldest; a source that keeps failing only FAILING_SOURCE_HANDSHAKES. A client
    holding the secret is still served from that very address."""
    store.exempt = lambda address: False  # treat 127.0.0.1 as a remote host
    store.exempt_sources.clear()
    socks = [socket.create_connection(("127.0.0.1", store.port), timeout=10) for _ in range(MAX_HANDSHAKES_PER_SOURCE)]
    extra = [socket.create_connection(("127.0.0.1", store.port), timeout=10) for _ in range(16)]
    for s in socks[:16]:
        assert read_to_close(s, 3).endswith(BUSY)  # its own oldest, pushed out at once
    eventually(lambda: len(store.pending) == MAX_HANDSHAKES_PER_SOURCE)
    for s in socks + extra:
        s.close()
    for _ in range(FAILING_SOURCE_FAILURES):
        with socket.create_connection(("127.0.0.1", store.port), timeout=10) as s:
            recv_exact(s, len(MAGIC) + NONCE_BYTES)
            s.sendall(bytes(NONCE_BYTES + MAC_BYTES))
            read_to_close(s, 5)
    socks = [socket.create_connection(("127.0.0.1", store.port), timeout=10) for _ in range(32)]
    eventually(lambda: len(store.pending) == FAILING_SOURCE_HANDSHAKES)
    served_within(store, 3)
    for s in socks:
        s.close()
