"""An authenticated key-value store: trainer rank 0's rendezvous for weight transfers and the orchestrator's line to
the trainer (its keys, who writes and who deletes each: docs/architecture.md, "The transfer protocol").

torch's `TCPStore` cannot be this: it authenticates nobody, lists its keys to any client (`list_keys`) and listens
on every interface whatever address it is given. This store
- is hosted by trainer rank 0 (`StoreServer` over a `Table`) on `weight_broadcast.host` only;
- opens every connection with a mutual challenge over the run secret (`PRIME_RL_SECRET`): a peer without it can read,
  write and wait for nothing, and a client trusts no server without it (e.g. a process squatting the port);
- authenticates every later frame with a per-connection key and a counter: nothing can be injected, replayed or
  reordered into a connection;
- bounds what a peer can make it hold (key and value sizes, keys, connections, one deadline to authenticate), and
  keeps its capacity for whoever holds the secret: a peer without it can delay a join by milliseconds, not hold the
  store (`StoreServer`); every client call honours one deadline, whatever the peer sends.
Frames are not encrypted: step numbers and group members' addresses are not secret. The weights themselves travel
over gloo/NCCL, which authenticate nothing (what must stay on a private network: docs/architecture.md, "Security").

This module is the server side (`Table`, `StoreServer`); the framing both sides speak is in `wire`, the client side
(`StoreClient`, and `GroupStore` for gloo/NCCL) in `client`.
"""

from __future__ import annotations

import errno
import hmac
import os
import selectors
import socket
import struct
import threading
import time
from collections import Counter, OrderedDict

from loguru import logger

from prime_rl.utils.net import is_loopback
from prime_rl.weight_broadcast.wire import (
    BUSY,
    IDLE,
    MAC_BYTES,
    MAGIC,
    MAX_KEY_BYTES,
    MAX_VALUE_BYTES,
    MAX_WAIT_SECONDS,
    NONCE_BYTES,
    Channel,
    Malformed,
    StoreAuthError,
    StoreError,
    StoreFull,
    StoreTimeout,
    keep_alive,
    sign,
    time_left,
)

MAX_KEYS = 4096
MAX_CONNECTIONS = 1024
"""Authenticated connections, a thread each: the orchestrator, and two per inference worker (its server's check and
its group) for hundreds of workers. Only a peer holding the secret can take one."""
MAX_HANDSHAKES = 1024
"""Connections still authenticating: a socket and a few hundred bytes each, all served by one thread. When all are
taken a newcomer pushes out the oldest: a client holding the secret answers within milliseconds, so the connection
that has waited longest is the one without it."""
HANDSHAKE_SECONDS = 5.0
"""One deadline for the whole handshake, however slowly the peer sends (a timeout per `recv` let one byte every 4 s
hold a handshake for minutes)."""
MAX_HANDSHAKES_PER_SOURCE = 64
"""Pending handshakes from one address other than loopback: a flood from one host pushes out its own, not others'."""
FAILING_SOURCE_FAILURES = 64
FAILING_SOURCE_HANDSHAKES = 8
"""A source with FAILING_SOURCE_FAILURES failed handshakes within FAILURE_WINDOW keeps only this many pending."""
FAILURE_WINDOW = 10.0
MAX_SOURCES = 4096
"""Source addresses whose failures are remembered (quiet ones are forgotten first)."""
IDLE_SECONDS = 120.0
"""An authenticated connection with no request in flight for this long is closed (a `get` waiting for its key is in
flight); `StoreClient` reconnects by itself at its next call."""
FRAME_SECONDS = 30.0
"""An authenticated peer's request, once begun, arrives within this, and it takes the reply within this."""
LINGER_SECONDS = 1.0
REPORT_SECONDS = 5.0
"""Handshake failures are logged at once, then at most this often (counted per peer address in between)."""
REPORT_SOURCES = 5
LISTEN_BACKLOG = 4096
"""Connections the kernel queues for `accept` (capped by net.core.somaxconn): a full queue drops a client's SYN,
which costs it a 1 s retransmission."""
ACCEPT_BATCH = 64
ACCEPT_BACKOFF = (0.05, 1.0)
"""After a failed accept (e.g. out of file descriptors): seconds before accepting again, doubling to the second."""


def _check_key(key: str) -> None:
    if not key or len(key.encode()) > MAX_KEY_BYTES:
        raise StoreFull(f"keys are 1 to {MAX_KEY_BYTES} bytes")


class Table:
    """The store's contents. The server's connection threads share it with trainer rank 0, which uses it directly."""

    def __init__(self):
        self.data: dict[str, bytes] = {}
        self.changed = threading.Condition()

    def set(self, key: str, value: bytes | str) -> None:
        value = value.encode() if isinstance(value, str) else bytes(value)
        _check_key(key)
        if len(value) > MAX_VALUE_BYTES:
            raise StoreFull(f"values are at most {MAX_VALUE_BYTES} bytes")
        with self.changed:
            if key not in self.data and len(self.data) >= MAX_KEYS:
                raise StoreFull(f"the store holds {MAX_KEYS} keys, its limit")
            self.data[key] = value
            self.changed.notify_all()

    def get(self, key: str, timeout: float) -> bytes:
        """The key's value, waiting up to `timeout` seconds for it to be set."""
        with self.changed:
            if not self.changed.wait_for(lambda: key in self.data, min(timeout, MAX_WAIT_SECONDS)):
                raise StoreTimeout(f"{key!r} was not set within {timeout:g} s")
            return self.data[key]

    def take(self, key: str) -> bytes | None:
        """The key's value, deleted in the same step (None when it is not set)."""
        with self.changed:
            return self.data.pop(key, None)

    def check(self, keys: list[str]) -> bool:
        with self.changed:
            return all(k in self.data for k in keys)

    def delete(self, key: str) -> bool:
        return self.take(key) is not None

    def delete_prefix(self, prefix: str) -> int:
        with self.changed:
            doomed = [k for k in self.data if k.startswith(prefix)]
            for k in doomed:
                del self.data[k]
            return len(doomed)

    def add(self, key: str, amount: int) -> int:
        with self.changed:  # reentrant: `set` takes it again
            try:
                value = int(self.data.get(key, b"0")) + amount
            except ValueError:
                raise StoreFull(f"{key!r} does not hold an integer") from None
            self.set(key, str(value))
            return value

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """c10d's rule: set `desired` when the key holds `expected`, or is unset and `expected` is empty; returns the
        value the key holds afterwards."""
        with self.changed:
            current = self.data.get(key)
            if (current is None and expected == b"") or current == expected:
                self.set(key, desired)
                return bytes(desired)
            return current if current is not None else bytes(expected)

    def num_keys(self) -> int:
        with self.changed:
            return len(self.data)


class _Pending:
    """A connection still authenticating: served by the store's one loop thread, without a thread of its own."""

    __slots__ = ("sock", "source", "nonce", "answer", "deadline")

    def __init__(self, sock: socket.socket, source: str, nonce: bytes, deadline: float):
        self.sock, self.source, self.nonce, self.deadline = sock, source, nonce, deadline
        self.answer = b""


class _Audit:
    """Handshakes that did not authenticate, counted per peer address and logged at once, then at most every
    REPORT_SECONDS: an operator sees an attack within seconds, and a flood cannot flood the log."""

    def __init__(self):
        self.counts: dict[str, Counter] = {}
        self.since = 0.0
        self.next_report = 0.0

    def count(self, source: str, reason: str) -> None:
        if not self.counts:
            self.since = time.monotonic()
        self.counts.setdefault(source, Counter())[reason] += 1

    def due(self, now: float) -> bool:
        return bool(self.counts) and now >= self.next_report

    def report(self, now: float) -> None:
        if not self.due(now):
            return
        counts, self.counts = self.counts, {}
        self.next_report = now + REPORT_SECONDS
        seconds = max(now - self.since, 0.1)
        ranked = sorted(counts.items(), key=lambda item: -item[1].total())
        for source, c in ranked[:REPORT_SOURCES]:
            if c["refused"]:
                logger.warning(
                    f"weight-broadcast store: turned away {c['refused']} authenticated connection(s) from {source} in the "
                    f"last {seconds:.1f} s: it holds {MAX_CONNECTIONS} connections, its limit (they retry)"
                )
            failed = c.total() - c["refused"]
            if not failed:
                continue
            # A lone probe that connects and hangs up (a port scan, a health check) is no attack.
            log = logger.warning if failed > c["hung up"] or c["hung up"] >= 10 else logger.debug
            log(
                f"weight-broadcast store: {failed} connection(s) from {source} did not authenticate in the last "
                f"{seconds:.1f} s "
                f"({c['timed out']} timed out, {c['wrong key']} wrong key, {c['hung up']} hung up, {c['evicted']} "
                f"pushed out by newer ones): someone without the run secret is connecting; if training stalls, "
                "firewall this port (docs/architecture.md, Security)"
            )
        if len(ranked) > REPORT_SOURCES:
            rest = sum(c.total() for _, c in ranked[REPORT_SOURCES:])
            logger.warning(
                f"weight-broadcast store: and {rest} connection(s) from {len(ranked) - REPORT_SOURCES} other "
                "address(es) did not authenticate"
            )


def _raise_open_file_limit() -> None:
    """Room for the store's sockets on top of the process's own files: the soft RLIMIT_NOFILE is raised toward the
    hard limit (never lowered). Where it cannot be, a full table of files pushes out the oldest handshake instead."""
    try:
        import resource
    except ImportError:  # not POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = MAX_HANDSHAKES + MAX_CONNECTIONS + 1024
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            logger.debug(f"weight-broadcast store: raised the open-file limit from {soft} to {want}")
        except (ValueError, OSError) as e:
            logger.debug(f"weight-broadcast store: could not raise the open-file limit from {soft} ({e})")


def _close_quietly(sock: socket.socket, farewell: bytes = b"") -> None:
    """Close without a reset: send `farewell` if it fits, read what the peer already sent (a close with unread data
    sends RST, which can destroy the farewell before the peer reads it)."""
    try:
        sock.setblocking(False)
        if farewell:
            sock.send(farewell)
        for _ in range(4):
            if not sock.recv(4096):
                break
    except OSError:
        pass
    sock.close()


class StoreServer:
    """Serves a `Table` to authenticated clients on `host:port` (port 0: any free port, then in `port`).

    One thread accepts and runs every handshake (non-blocking, one absolute deadline each, `handshake_seconds`);
    each authenticated connection then has its own thread (a `get` waits in it), closed after `idle_seconds` without
    a request. The run secret's purpose-bound key signs the handshake. Capacity is kept for whoever holds the secret:
    a full set of pending handshakes pushes out its oldest, never the newcomer; failures are counted per peer address
    and logged (`_Audit`); the accept loop survives any error but its own shutdown."""

    def __init__(
        self,
        host: str,
        port: int,
        key: bytes,
        table: Table | None = None,
        *,
        handshake_seconds: float = HANDSHAKE_SECONDS,
        idle_seconds: float = IDLE_SECONDS,
    ):
        self.table = table or Table()
        self.key = key
        self.handshake_seconds, self.idle_seconds = handshake_seconds, idle_seconds
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        if is_loopback(address[0]) and not is_loopback(host):  # a loopback `host` is what was asked for
            raise OSError(
                f"{host!r} resolves to {address[0]} on this machine, a loopback address other hosts cannot reach "
                "(a distribution's /etc/hosts entry for its own name, often): give an address the others reach"
            )
        _raise_open_file_limit()
        # this address only, not every interface; a deep backlog so a burst of clients is queued, not dropped
        self.listener = socket.create_server(address, family=family, backlog=LISTEN_BACKLOG)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self.connections: set[socket.socket] = set()
        """Authenticated connections (each served by its own thread)."""
        self.pending: OrderedDict[int, _Pending] = OrderedDict()
        """Handshakes by file descriptor, oldest (so earliest deadline) first; the loop thread's alone."""
        self.pending_by_source: dict[str, OrderedDict[int, None]] = {}
        self.failures: dict[str, list] = {}
        """Per source address other than loopback: [window start, failed handshakes in the window]."""
        self.exempt = is_loopback
        """Sources with no per-source limit: on loopback every local process, the trainer's own clients included,
        shares one address, so only the global capacity and its eviction order protect them."""
        self.exempt_sources: dict[str, bool] = {}
        """`exempt`, remembered (it parses the address; the loop may see thousands of connections a second)."""
        self.audit = _Audit()
        self.closed = False
        self.last_warning = 0.0
        self.accept_errors, self.accept_backoff, self.accept_resume = 0, 0.0, None
        self.last_accept_report = -REPORT_SECONDS
        self.selector = selectors.DefaultSelector()
        self.wake_reader, self.wake_writer = socket.socketpair()
        self.wake_reader.setblocking(False)
        self.wake_writer.setblocking(False)
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.selector.register(self.wake_reader, selectors.EVENT_READ)
        self.thread = threading.Thread(target=self._loop, name="weight-broadcast-store", daemon=True)
        self.thread.start()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            connections = list(self.connections)
        try:
            self.wake_writer.send(b"x")
        except OSError:
            pass
        self.thread.join(5)
        self.listener.close()  # the loop closed it already, unless it is stuck
        for sock in connections:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    # -- the loop thread: accepting, and every handshake -----------------------------------------------------

    def _loop(self) -> None:
        errors = 0
        try:
            while not self.closed:
                try:
                    self._turn()
                    errors = 0
                except Exception as e:  # a bug, or something the system did: logged, and the store goes on
                    errors += 1
                    if errors == 1 or errors % 1000 == 0:
                        logger.opt(exception=e).error(f"weight-broadcast store: its loop failed ({errors}x); going on")
                    time.sleep(0.05)
        finally:
            for p in list(self.pending.values()):
                try:
                    self._drop(p, None)
                except Exception:
                    p.sock.close()
            self.selector.close()
            self.listener.close()
            self.wake_reader.close()
            self.wake_writer.close()

    def _turn(self) -> None:
        now = time.monotonic()
        timeout = REPORT_SECONDS
        if self.pending:
            timeout = min(timeout, next(iter(self.pending.values())).deadline - now)
        if self.accept_resume is not None:
            timeout = min(timeout, self.accept_resume - now)
        if self.audit.counts:
            timeout = min(timeout, self.audit.next_report - now)
        for selected, _ in self.selector.select(max(timeout, 0.0)):
            if selected.fileobj is self.listener:
                self._accept_some()
            elif selected.fileobj is self.wake_reader:
                try:
                    self.wake_reader.recv(64)
                except OSError:
                    pass
            elif selected.data is not None and self.pending.get(selected.fd) is selected.data:
                self._advance(selected.data)  # (not one pushed out earlier in this turn)
        now = time.monotonic()
        while self.pending and (oldest := next(iter(self.pending.values()))).deadline <= now:
            self._drop(oldest, "timed out")
        if self.accept_resume is not None and now >= self.accept_resume and not self.closed:
            self.accept_resume = None
            self.selector.register(self.listener, selectors.EVENT_READ)
        self.audit.report(now)

    def _accept_some(self) -> None:
        """Up to ACCEPT_BATCH connections a turn, so handshakes that were answered are read before ACCEPT_BATCH
        newcomers could push them out: a handshake survives at least MAX_HANDSHAKES / ACCEPT_BATCH turns."""
        for _ in range(ACCEPT_BATCH):
            try:
                sock, peer = self.listener.accept()
            except (BlockingIOError, ConnectionAbortedError):
                return  # none left; or one reset while queued
            except Exception as e:
                if not self.closed:
                    self._accept_failed(e)
                return
            self.accept_backoff = 0.0
            self._start_handshake(sock, peer[0])

    def _accept_failed(self, e: Exception) -> None:
        """Out of file descriptors (EMFILE), buffers, or anything else: logged (at once, then at most every
        REPORT_SECONDS), the listener left alone for a back-off (0.05 s doubling to 1 s), then accepted from again.
        An exception here once ended the store for the rest of the run while its socket kept listening."""
        self.accept_errors += 1
        self.accept_backoff = min(max(self.accept_backoff * 2, ACCEPT_BACKOFF[0]), ACCEPT_BACKOFF[1])
        now = time.monotonic()
        if now - self.last_accept_report >= REPORT_SECONDS:
            logger.warning(
                f"weight-broadcast store: accepting a connection failed ({type(e).__name__}: {e}; "
                f"{self.accept_errors}x since the last report); accepting again in {self.accept_backoff:g} s"
            )
            self.last_accept_report, self.accept_errors = now, 0
        if isinstance(e, OSError) and e.errno in (errno.EMFILE, errno.ENFILE) and self.pending:
            self._drop(next(iter(self.pending.values())), "evicted")  # frees a descriptor for a newcomer
        self.selector.unregister(self.listener)
        self.accept_resume = now + self.accept_backoff

    def _is_exempt(self, source: str) -> bool:
        exempt = self.exempt_sources.get(source)
        if exempt is None:
            if len(self.exempt_sources) >= MAX_SOURCES:
                self.exempt_sources.clear()
            exempt = self.exempt_sources[source] = self.exempt(source)
        return exempt

    def _start_handshake(self, sock: socket.socket, source: str) -> None:
        nonce = os.urandom(NONCE_BYTES)
        sent = 0
        try:
            sock.setblocking(False)
            # Nothing to read before our greeting: an end of stream is a peer gone already (a flood connecting and
            # hanging up), closed here at the least cost, before the greeting is sent and the socket is watched.
            gone = sock.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:
            gone = False
        except OSError:
            gone = True
        if not gone:
            try:
                sent = sock.send(MAGIC + nonce)  # a fresh connection's send buffer always holds it
            except OSError:
                pass
        if sent != len(MAGIC) + NONCE_BYTES:
            sock.close()
            self.audit.count(source, "hung up")
            return
        now = time.monotonic()
        if not self._is_exempt(source):
            cap = MAX_HANDSHAKES_PER_SOURCE
            window = self.failures.get(source)
            if window is not None and now - window[0] <= FAILURE_WINDOW and window[1] >= FAILING_SOURCE_FAILURES:
                cap = FAILING_SOURCE_HANDSHAKES
            while len(self.pending_by_source.get(source, ())) >= cap:
                self._drop(self.pending[next(iter(self.pending_by_source[source]))], "evicted")
        while len(self.pending) >= MAX_HANDSHAKES:
            self._drop(next(iter(self.pending.values())), "evicted")
        p = _Pending(sock, source, nonce, now + self.handshake_seconds)
        try:
            self.selector.register(sock, selectors.EVENT_READ, p)
        except BaseException:
            sock.close()
            raise
        fd = sock.fileno()
        self.pending[fd] = p
        self.pending_by_source.setdefault(source, OrderedDict())[fd] = None

    def _advance(self, p: _Pending) -> None:
        try:
            chunk = p.sock.recv(NONCE_BYTES + MAC_BYTES - len(p.answer))
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(p, "hung up", farewell=b"")
            return
        p.answer += chunk
        if len(p.answer) < NONCE_BYTES + MAC_BYTES:
            return  # however slowly it comes, the deadline stands
        client_nonce, tag = p.answer[:NONCE_BYTES], p.answer[NONCE_BYTES:]
        if not hmac.compare_digest(tag, sign(self.key, b"client", p.nonce, client_nonce)):
            self._drop(p, "wrong key", farewell=b"")  # a close without a word: the client does not retry
            return
        sock = p.sock
        with self.lock:  # (counted before the client can know it is in: `close` then closes it too)
            full = self.closed or len(self.connections) >= MAX_CONNECTIONS
            if not full:
                self.connections.add(sock)
        if full:
            self._drop(p, "refused")
            return
        self._forget(p)
        try:
            sock.setblocking(True)
            keep_alive(sock)
            sock.settimeout(FRAME_SECONDS)
            sock.sendall(sign(self.key, b"server", p.nonce, client_nonce))
            channel = Channel(sock, sign(self.key, b"session", p.nonce, client_nonce), b"s")
            threading.Thread(
                target=self._serve, args=(sock, channel), name="weight-broadcast-store-conn", daemon=True
            ).start()
        except (OSError, RuntimeError) as e:  # gone already; or no thread to be had
            with self.lock:
                self.connections.discard(sock)
            sock.close()
            if isinstance(e, RuntimeError):
                logger.warning(f"weight-broadcast store: could not serve a connection from {p.source} ({e})")

    def _forget(self, p: _Pending) -> None:
        fd = p.sock.fileno()
        self.selector.unregister(p.sock)
        del self.pending[fd]
        mine = self.pending_by_source[p.source]
        del mine[fd]
        if not mine:
            del self.pending_by_source[p.source]

    def _drop(self, p: _Pending, reason: str | None, farewell: bytes = BUSY) -> None:
        """End a handshake: `reason` counted against its source (None: the store is closing)."""
        self._forget(p)
        _close_quietly(p.sock, farewell)
        if reason is None:
            return
        self.audit.count(p.source, reason)
        if reason != "refused" and not self._is_exempt(p.source):
            now = time.monotonic()
            window = self.failures.get(p.source)
            if window is None or now - window[0] > FAILURE_WINDOW:
                if len(self.failures) >= MAX_SOURCES:  # forget the quiet ones: bounded, whatever the addresses
                    self.failures = {s: w for s, w in self.failures.items() if now - w[0] <= FAILURE_WINDOW}
                window = self.failures[p.source] = [now, 0]
            window[1] += 1

    # -- one thread per authenticated connection -------------------------------------------------------------

    def _serve(self, sock: socket.socket, channel: Channel) -> None:
        try:
            while True:
                sock.settimeout(self.idle_seconds)
                try:
                    if not sock.recv(1, socket.MSG_PEEK):
                        return  # the client left
                except TimeoutError:
                    self._close_idle(sock, channel)
                    return
                request = channel.receive(time.monotonic() + FRAME_SECONDS)
                channel.send(self._handle(request), time.monotonic() + FRAME_SECONDS)
        except StoreAuthError as e:
            self._warn(f"weight-broadcast store: a frame failed authentication ({e}); connection dropped")
        except (OSError, StoreError, struct.error):
            pass  # the peer left, or sent something that does not parse: drop it
        finally:
            with self.lock:
                self.connections.discard(sock)
            sock.close()

    def _close_idle(self, sock: socket.socket, channel: Channel) -> None:
        """No request for `idle_seconds` (a `get` waiting for its key is a request): say so, read and drop whatever
        crossed the farewell (it is never served, so the client may send it again), and close once the client has."""
        deadline = time.monotonic() + LINGER_SECONDS
        channel.send([IDLE], deadline)
        sock.shutdown(socket.SHUT_WR)
        while True:
            time_left(sock, deadline)
            if not sock.recv(4096):
                return

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self.last_warning > 60:
            self.last_warning = now
            logger.warning(message)

    def _handle(self, fields: list[bytes]) -> list[bytes]:
        """One request -> its reply: [b"ok", values...], [b"timeout"] or [b"error", message]."""
        if not fields:
            raise Malformed("empty request")
        op, args = fields[0], fields[1:]
        t = self.table
        try:
            if op == b"set" and len(args) == 2:
                t.set(args[0].decode(), args[1])
                return [b"ok"]
            if op == b"get" and len(args) == 2:
                return [b"ok", t.get(args[0].decode(), max(0.0, float(args[1])))]
            if op == b"take" and len(args) == 1:
                value = t.take(args[0].decode())
                return [b"ok"] if value is None else [b"ok", value]
            if op == b"check" and args:
                return [b"ok", b"1" if t.check([k.decode() for k in args]) else b"0"]
            if op == b"delete" and len(args) == 1:
                return [b"ok", b"1" if t.delete(args[0].decode()) else b"0"]
            if op == b"delete_prefix" and len(args) == 1:
                return [b"ok", str(t.delete_prefix(args[0].decode())).encode()]
            if op == b"add" and len(args) == 2:
                return [b"ok", str(t.add(args[0].decode(), int(args[1]))).encode()]
            if op == b"compare_set" and len(args) == 3:
                return [b"ok", t.compare_set(args[0].decode(), args[1], args[2])]
            if op == b"num_keys" and not args:
                return [b"ok", str(t.num_keys()).encode()]
        except StoreTimeout:
            return [b"timeout"]
        except StoreFull as e:
            return [b"error", str(e).encode()]
        except (UnicodeDecodeError, ValueError, OverflowError):
            return [b"error", b"malformed arguments"]
        return [b"error", b"unknown operation"]
