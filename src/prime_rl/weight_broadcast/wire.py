"""The weight-broadcast store's wire protocol, shared by its server and its clients: the errors a call can raise, the
size limits, and the framing: a mutual challenge over the run secret opens a connection, then every frame carries an
HMAC under a per-connection key and a counter (`Channel`), so nothing can be injected, replayed or reordered."""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
import time

MAGIC = b"prime-rl store 1"
NONCE_BYTES = 32
MAC_BYTES = 32
MAX_KEY_BYTES = 512
MAX_VALUE_BYTES = 64 << 10
"""Rendezvous values are a few hundred bytes (a member's addresses); control values a few dozen."""
MAX_FRAME_BYTES = 2 * MAX_VALUE_BYTES + MAX_KEY_BYTES + 256
MAX_WAIT_SECONDS = 3600.0
BUSY = b"prime-rl store: busy, try again."
"""What the server sends instead of its proof when it drops a handshake that is not at fault (pushed out by newer
connections, past its deadline, the store full or closing): the client retries. Closing without a word after the
client's answer means a wrong secret, which is never retried."""
IDLE = b"idle"
"""The server's last frame on a connection it closes for idleness; it reads no request after it, so a request that
crossed it was not served and may be sent again on a new connection."""
KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_COUNT = 60, 10, 6
"""TCP keepalive on every store connection: a peer whose host died is noticed within about two minutes."""


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


class Malformed(StoreError):
    """A frame that does not parse: the connection is dropped."""


def sign(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _pack(fields: list[bytes]) -> bytes:
    return b"".join(struct.pack(">I", len(f)) + f for f in fields)


def _unpack(payload: bytes) -> list[bytes]:
    fields, offset = [], 0
    while offset < len(payload):
        if offset + 4 > len(payload):
            raise Malformed("truncated field length")
        (size,) = struct.unpack_from(">I", payload, offset)
        offset += 4
        if offset + size > len(payload):
            raise Malformed("truncated field")
        fields.append(payload[offset : offset + size])
        offset += size
    return fields


def keep_alive(sock: socket.socket) -> None:
    """An authenticated connection's options: frames go out at once (they are small), and a dead peer is found."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL),
        ("TCP_KEEPCNT", KEEPALIVE_COUNT),
    ):
        if hasattr(socket, name):  # Linux; elsewhere the system's defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def time_left(sock: socket.socket, deadline: float | None) -> None:
    """Set `sock`'s timeout to what is left before `deadline` (monotonic; None: no change). A timeout per `recv` let
    a peer sending one byte at a time hold a call for minutes; a deadline does not."""
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        sock.settimeout(left)


def recv_exact(sock: socket.socket, size: int, deadline: float | None = None) -> bytes:
    data = bytearray()
    while len(data) < size:
        time_left(sock, deadline)
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        data += chunk
    return bytes(data)


class Channel:
    """One authenticated connection: frames are `length | fields | HMAC(connection key, direction, counter, fields)`."""

    def __init__(self, sock: socket.socket, key: bytes, side: bytes):
        self.sock, self.key = sock, key
        self.out_label, self.in_label = side, b"s" if side == b"c" else b"c"
        self.sent = self.received = 0

    def send(self, fields: list[bytes], deadline: float | None = None) -> None:
        """One frame, all of it sent by `deadline` (`sendall`'s timeout bounds the whole send)."""
        payload = _pack(fields)
        mac = sign(self.key, self.out_label, struct.pack(">Q", self.sent), payload)
        self.sent += 1
        time_left(self.sock, deadline)
        self.sock.sendall(struct.pack(">I", len(payload)) + payload + mac)

    def receive(self, deadline: float | None = None) -> list[bytes]:
        """One frame, all of it received by `deadline`, however slowly the peer sends it."""
        (size,) = struct.unpack(">I", recv_exact(self.sock, 4, deadline))
        if size > MAX_FRAME_BYTES:
            raise Malformed(f"a frame of {size} bytes exceeds the limit of {MAX_FRAME_BYTES}")
        payload = recv_exact(self.sock, size, deadline)
        mac = recv_exact(self.sock, MAC_BYTES, deadline)
        if not hmac.compare_digest(mac, sign(self.key, self.in_label, struct.pack(">Q", self.received), payload)):
            raise StoreAuthError("a frame failed authentication")
        self.received += 1
        return _unpack(payload)
