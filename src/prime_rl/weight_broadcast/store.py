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
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import threading
import time
from datetime import timedelta

import torch.distributed as dist
from loguru import logger

from prime_rl.utils.net import is_loopback
from prime_rl.utils.secret import derive

MAGIC = b"prime-rl store 1"
NONCE_BYTES = 32
MAC_BYTES = 32
MAX_KEY_BYTES = 512
MAX_VALUE_BYTES = 64 << 10
"""Rendezvous values are a few hundred bytes (a member's addresses); control values a few dozen."""
MAX_KEYS = 4096
MAX_FRAME_BYTES = 2 * MAX_VALUE_BYTES + MAX_KEY_BYTES + 256
MAX_CONNECTIONS = 256
"""Authenticated connections: the orchestrator, and two per inference worker (its server's check and its group)."""
MAX_HANDSHAKES = 32
"""Connections still authenticating; more are closed at once, so a flood can delay a join, never hold the store."""
HANDSHAKE_SECONDS = 5.0
CONNECT_SECONDS = 5.0
MAX_WAIT_SECONDS = 3600.0


class StoreError(RuntimeError):
    """A store call failed; the subclasses say how."""


class StoreUnavailable(StoreError):
    """Nothing listens at the address, or the connection broke: the trainer is gone (or not up yet)."""


class StoreTimeout(StoreError, TimeoutError):
    """The key did not appear, or the store did not answer, within the timeout."""


class StoreAuthError(StoreError):
    """The peer does not hold this run's secret (or a frame was tampered with)."""


class StoreFull(StoreError):
    """A write over the store's bounds (key or value size, number of keys)."""


class _Malformed(StoreError):
    """A frame that does not parse: the connection is dropped."""


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _pack(fields: list[bytes]) -> bytes:
    return b"".join(struct.pack(">I", len(f)) + f for f in fields)


def _unpack(payload: bytes) -> list[bytes]:
    fields, offset = [], 0
    while offset < len(payload):
        if offset + 4 > len(payload):
            raise _Malformed("truncated field length")
        (size,) = struct.unpack_from(">I", payload, offset)
        offset += 4
        if offset + size > len(payload):
            raise _Malformed("truncated field")
        fields.append(payload[offset : offset + size])
        offset += size
    return fields


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        data += chunk
    return bytes(data)


class _Channel:
    """One authenticated connection: frames are `length | fields | HMAC(connection key, direction, counter, fields)`."""

    def __init__(self, sock: socket.socket, key: bytes, side: bytes):
        self.sock, self.key = sock, key
        self.out_label, self.in_label = side, b"s" if side == b"c" else b"c"
        self.sent = self.received = 0

    def send(self, fields: list[bytes]) -> None:
        payload = _pack(fields)
        mac = _mac(self.key, self.out_label, struct.pack(">Q", self.sent), payload)
        self.sent += 1
        self.sock.sendall(struct.pack(">I", len(payload)) + payload + mac)

    def receive(self) -> list[bytes]:
        (size,) = struct.unpack(">I", _recv_exact(self.sock, 4))
        if size > MAX_FRAME_BYTES:
            raise _Malformed(f"a frame of {size} bytes exceeds the limit of {MAX_FRAME_BYTES}")
        payload = _recv_exact(self.sock, size)
        mac = _recv_exact(self.sock, MAC_BYTES)
        if not hmac.compare_digest(mac, _mac(self.key, self.in_label, struct.pack(">Q", self.received), payload)):
            raise StoreAuthError("a frame failed authentication")
        self.received += 1
        return _unpack(payload)


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

    def __init__(self, host: str, port: int, secret: str, table: Table | None = None):
        self.table = table or Table()
        self.key = derive(secret, "weight-broadcast-store")
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

    def _handshake(self, sock: socket.socket) -> _Channel:
        server_nonce = os.urandom(NONCE_BYTES)
        sock.sendall(MAGIC + server_nonce)
        answer = _recv_exact(sock, NONCE_BYTES + MAC_BYTES)
        client_nonce, tag = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
        if not hmac.compare_digest(tag, _mac(self.key, b"client", server_nonce, client_nonce)):
            raise StoreAuthError("wrong run secret")
        sock.sendall(_mac(self.key, b"server", server_nonce, client_nonce))
        return _Channel(sock, _mac(self.key, b"session", server_nonce, client_nonce), b"s")

    def _handle(self, fields: list[bytes]) -> list[bytes]:
        """One request -> its reply: [b"ok", values...], [b"timeout"] or [b"error", message]."""
        if not fields:
            raise _Malformed("empty request")
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


class StoreClient:
    """A connection to a `StoreServer`, authenticated both ways within `connect_timeout`. One call at a time; each is
    bounded by `timeout` (plus the wait a `get` asks for). After any failure the connection is closed and every later call fails at once: a
    stream that failed midway cannot be trusted to be in step."""

    def __init__(self, host: str, port: int, secret: str, timeout: float, connect_timeout: float = CONNECT_SECONDS):
        self.address, self.timeout = f"{host}:{port}", timeout
        self.lock = threading.Lock()
        key = derive(secret, "weight-broadcast-store")
        connect_timeout = min(timeout, connect_timeout)
        try:
            self.sock = socket.create_connection((host, port), timeout=connect_timeout)
        except OSError as e:
            raise StoreUnavailable(f"no weight-broadcast store at {self.address} ({e})") from None
        try:
            self.sock.settimeout(connect_timeout)
            self.channel: _Channel | None = self._handshake(key)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except BaseException:
            self.sock.close()
            raise

    def _handshake(self, key: bytes) -> _Channel:
        stage = "hello"
        try:
            hello = _recv_exact(self.sock, len(MAGIC) + NONCE_BYTES)
            if not hello.startswith(MAGIC):
                raise StoreAuthError(f"{self.address} is not a prime-rl weight-broadcast store")
            server_nonce, client_nonce = hello[len(MAGIC) :], os.urandom(NONCE_BYTES)
            self.sock.sendall(client_nonce + _mac(key, b"client", server_nonce, client_nonce))
            stage = "proof"
            proof = _recv_exact(self.sock, MAC_BYTES)
        except TimeoutError:
            raise StoreTimeout(
                f"the weight-broadcast store at {self.address} did not authenticate within "
                f"{self.sock.gettimeout():g} s (is this address trainer rank 0's store?)"
            ) from None
        except ConnectionError as e:
            if stage == "proof":  # it read our answer to its challenge and hung up: it holds another secret
                raise StoreAuthError(
                    f"the weight-broadcast store at {self.address} refused our run secret (PRIME_RL_SECRET must be "
                    "the same for trainer, orchestrator and servers)"
                ) from None
            raise StoreUnavailable(
                f"the weight-broadcast store at {self.address} closed the connection ({e})"
            ) from None
        except OSError as e:
            raise StoreUnavailable(f"weight-broadcast store at {self.address}: {e}") from None
        if not hmac.compare_digest(proof, _mac(key, b"server", server_nonce, client_nonce)):
            raise StoreAuthError(f"the server at {self.address} does not hold this run's secret")
        return _Channel(self.sock, _mac(key, b"session", server_nonce, client_nonce), b"c")

    def close(self) -> None:
        with self.lock:
            self._close()

    def _close(self) -> None:
        self.channel = None
        self.sock.close()

    def _call(self, *fields: bytes, wait: float = 0.0) -> list[bytes]:
        with self.lock:
            if self.channel is None:
                raise StoreUnavailable(f"the connection to the weight-broadcast store at {self.address} is closed")
            try:
                self.sock.settimeout(self.timeout + wait)
                self.channel.send(list(fields))
                reply = self.channel.receive()
            except TimeoutError:
                self._close()
                raise StoreTimeout(
                    f"the weight-broadcast store at {self.address} did not answer within {self.timeout + wait:g} s"
                ) from None
            except (OSError, StoreError, struct.error) as e:
                self._close()
                raise StoreUnavailable(
                    f"the weight-broadcast store at {self.address} stopped answering ({e})"
                ) from None
        if reply[:1] == [b"ok"]:
            return reply[1:]
        if reply[:1] == [b"timeout"]:
            raise StoreTimeout(f"{fields[1].decode()!r} was not set within {wait:g} s (store at {self.address})")
        message = reply[1].decode(errors="replace") if len(reply) > 1 else "no reason given"
        raise StoreFull(f"the weight-broadcast store refused {fields[0].decode()}: {message}")

    def set(self, key: str, value: bytes | str) -> None:
        self._call(b"set", key.encode(), value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str, timeout: float) -> bytes:
        """The key's value, waiting up to `timeout` seconds (on the server) for it to be set."""
        timeout = min(max(timeout, 0.0), MAX_WAIT_SECONDS)
        return self._call(b"get", key.encode(), repr(timeout).encode(), wait=timeout)[0]

    def take(self, key: str) -> bytes | None:
        reply = self._call(b"take", key.encode())
        return reply[0] if reply else None

    def check(self, keys: list[str]) -> bool:
        return self._call(b"check", *(k.encode() for k in keys))[0] == b"1"

    def delete(self, key: str) -> bool:
        return self._call(b"delete", key.encode())[0] == b"1"

    def delete_prefix(self, prefix: str) -> int:
        return int(self._call(b"delete_prefix", prefix.encode())[0])

    def add(self, key: str, amount: int) -> int:
        return int(self._call(b"add", key.encode(), str(int(amount)).encode())[0])

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._call(b"compare_set", key.encode(), bytes(expected), bytes(desired))[0]

    def num_keys(self) -> int:
        return int(self._call(b"num_keys")[0])


class GroupStore(dist.Store):
    """One transfer group's rendezvous under `prefix` of a `Table` (trainer rank 0) or a `StoreClient` (a receiver):
    gloo and NCCL exchange their members' addresses through it, calling these methods from C++."""

    def __init__(self, kv: Table | StoreClient, prefix: str, timeout: float):
        super().__init__()
        self.kv, self.prefix, self.seconds = kv, prefix, timeout  # (`timeout` is a read-only property of Store)

    def set(self, key: str, value) -> None:
        self.kv.set(self.prefix + key, value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        return self.kv.get(self.prefix + key, self.seconds)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        deadline = time.monotonic() + (timeout.total_seconds() if timeout else self.seconds)
        for key in keys:
            self.kv.get(self.prefix + key, max(0.0, deadline - time.monotonic()))

    def check(self, keys: list[str]) -> bool:
        return self.kv.check([self.prefix + k for k in keys])

    def add(self, key: str, amount: int) -> int:
        return self.kv.add(self.prefix + key, amount)

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self.kv.compare_set(self.prefix + key, bytes(expected), bytes(desired))

    def delete_key(self, key: str) -> bool:
        return self.kv.delete(self.prefix + key)

    def num_keys(self) -> int:
        return self.kv.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.seconds = timeout.total_seconds()
