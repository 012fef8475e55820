"""The weight-broadcast store's wire protocol, shared by its server and its clients: the errors a call can raise, the
size limits, and the framing: a mutual challenge over the run secret opens a connection, then every frame carries an
HMAC under a per-connection key and a counter (`Channel`), so nothing can be injected, replayed or reordered."""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct

MAGIC = b"prime-rl store 1"
NONCE_BYTES = 32
MAC_BYTES = 32
MAX_KEY_BYTES = 512
MAX_VALUE_BYTES = 64 << 10
"""Rendezvous values are a few hundred bytes (a member's addresses); control values a few dozen."""
MAX_FRAME_BYTES = 2 * MAX_VALUE_BYTES + MAX_KEY_BYTES + 256
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


def recv_exact(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
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

    def send(self, fields: list[bytes]) -> None:
        payload = _pack(fields)
        mac = sign(self.key, self.out_label, struct.pack(">Q", self.sent), payload)
        self.sent += 1
        self.sock.sendall(struct.pack(">I", len(payload)) + payload + mac)

    def receive(self) -> list[bytes]:
        (size,) = struct.unpack(">I", recv_exact(self.sock, 4))
        if size > MAX_FRAME_BYTES:
            raise Malformed(f"a frame of {size} bytes exceeds the limit of {MAX_FRAME_BYTES}")
        payload = recv_exact(self.sock, size)
        mac = recv_exact(self.sock, MAC_BYTES)
        if not hmac.compare_digest(mac, sign(self.key, self.in_label, struct.pack(">Q", self.received), payload)):
            raise StoreAuthError("a frame failed authentication")
        self.received += 1
        return _unpack(payload)
