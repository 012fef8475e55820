"""An authenticated key-value store: trainer rank 0's rendezvous for weight transfers and the orchestrator's line to
the trainer (its keys, who writes and who deletes each: docs/architecture.md, "The transfer protocol").

torch's `TCPStore` cannot be this: it authenticates nobody, lists its keys to any client (`list_keys`) and listens
on every interface whatever address it is given. This store
- is hosted by trainer rank 0 (`StoreServer` over a `Table`) on `weight_broadcast.host` only;
- opens every connection with a mutual challenge over the run secret (`PRIME_RL_SECRET`): a peer without it can read,
  write and wait for nothing, and a client trusts no server without it (e.g. a process squatting the port);
- authenticates every later frame with a per-connection key and a counter: nothing can be injected, replayed or
  reordered into a connection;
- bounds what a peer can make it hold (key and value sizes, keys, connections, time to authenticate), and every
  client call honours its timeout.
Frames are not encrypted: step numbers and group members' addresses are not secret. The weights themselves travel
over gloo/NCCL, which authenticate nothing (what must stay on a private network: docs/architecture.md, "Security").

This module is the server side (`Table`, `StoreServer`); the framing both sides speak is in `wire`, the client side
(`StoreClient`, and `GroupStore` for gloo/NCCL) in `client`.
"""

from __future__ import annotations

import hmac
import os
import socket
import struct
import threading
import time

from loguru import logger

from prime_rl.utils.net import is_loopback
from prime_rl.weight_broadcast.wire import (
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
    recv_exact,
    sign,
)

MAX_KEYS = 4096
MAX_CONNECTIONS = 256
"""Authenticated connections: the orchestrator, and two per inference worker (its server's check and its group)."""
MAX_HANDSHAKES = 32
"""Connections still authenticating; more are closed at once, so a flood can delay a join, never hold the store."""
HANDSHAKE_SECONDS = 5.0


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


class StoreServer:
    """Serves a `Table` to authenticated clients on `host:port` (port 0: any free port, then in `port`).

    One thread accepts; each connection has its own thread (a `get` waits in it). The run secret's purpose-bound key
    signs the handshake; a failed handshake just closes the connection (and is logged at most once a minute)."""

    def __init__(self, host: str, port: int, key: bytes, table: Table | None = None):
        self.table = table or Table()
        self.key = key
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        if is_loopback(address[0]) and not is_loopback(host):  # a loopback `host` is what was asked for
            raise OSError(
                f"{host!r} resolves to {address[0]} on this machine, a loopback address other hosts cannot reach "
                "(a distribution's /etc/hosts entry for its own name, often): give an address the others reach"
            )
        self.listener = socket.create_server(address, family=family)  # this address only, not every interface
        self.port = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self.connections: set[socket.socket] = set()
        self.handshakes = 0
        self.closed = False
        self.last_warning = 0.0
        self.thread = threading.Thread(target=self._accept, name="weight-broadcast-store", daemon=True)
        self.thread.start()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            connections = list(self.connections)
        for sock in [self.listener, *connections]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        self.thread.join(5)

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self.listener.accept()
            except OSError:
                return  # closed
            with self.lock:
                refuse = self.closed or self.handshakes >= MAX_HANDSHAKES or len(self.connections) >= MAX_CONNECTIONS
                if not refuse:
                    self.handshakes += 1
                    self.connections.add(sock)
            if refuse:
                sock.close()
                continue
            threading.Thread(
                target=self._serve, args=(sock, peer), name="weight-broadcast-store-conn", daemon=True
            ).start()

    def _serve(self, sock: socket.socket, peer) -> None:
        try:
            try:
                sock.settimeout(HANDSHAKE_SECONDS)
                channel = self._handshake(sock)
            finally:
                with self.lock:
                    self.handshakes -= 1
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                channel.send(self._handle(channel.receive()))
        except StoreAuthError as e:
            self._warn(f"weight-broadcast store: a connection from {peer[0]} failed authentication ({e}); dropped")
        except (OSError, StoreError, struct.error):
            pass  # the peer left, or sent something that does not parse: drop it
        finally:
            with self.lock:
                self.connections.discard(sock)
            sock.close()

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self.last_warning > 60:
            self.last_warning = now
            logger.warning(message)

    def _handshake(self, sock: socket.socket) -> Channel:
        server_nonce = os.urandom(NONCE_BYTES)
        sock.sendall(MAGIC + server_nonce)
        answer = recv_exact(sock, NONCE_BYTES + MAC_BYTES)
        client_nonce, tag = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
        if not hmac.compare_digest(tag, sign(self.key, b"client", server_nonce, client_nonce)):
            raise StoreAuthError("wrong run secret")
        sock.sendall(sign(self.key, b"server", server_nonce, client_nonce))
        return Channel(sock, sign(self.key, b"session", server_nonce, client_nonce), b"s")

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
