"""The weight-broadcast store's client side: `StoreClient`, one authenticated connection to trainer rank 0's
`StoreServer` (no torch: the orchestrator uses it; `transfer.GroupStore` is the gloo/NCCL rendezvous on it)."""

from __future__ import annotations

import hmac
import os
import socket
import struct
import threading

from prime_rl.weight_broadcast.wire import (
    MAC_BYTES,
    MAGIC,
    MAX_WAIT_SECONDS,
    NONCE_BYTES,
    Channel,
    StoreAuthError,
    StoreError,
    StoreFull,
    StoreTimeout,
    StoreUnavailable,
    recv_exact,
    sign,
)

CONNECT_SECONDS = 5.0


class StoreClient:
    """A connection to a `StoreServer`, authenticated both ways within `connect_timeout`. One call at a time; each is
    bounded by `timeout` (plus the wait a `get` asks for). After any failure the connection is closed and every later call fails at once: a
    stream that failed midway cannot be trusted to be in step."""

    def __init__(self, host: str, port: int, key: bytes, timeout: float, connect_timeout: float = CONNECT_SECONDS):
        self.address, self.timeout = f"{host}:{port}", timeout
        self.lock = threading.Lock()
        connect_timeout = min(timeout, connect_timeout)
        try:
            self.sock = socket.create_connection((host, port), timeout=connect_timeout)
        except OSError as e:
            raise StoreUnavailable(f"no weight-broadcast store at {self.address} ({e})") from None
        try:
            self.sock.settimeout(connect_timeout)
            self.channel: Channel | None = self._handshake(key)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except BaseException:
            self.sock.close()
            raise

    def _handshake(self, key: bytes) -> Channel:
        stage = "hello"
        try:
            hello = recv_exact(self.sock, len(MAGIC) + NONCE_BYTES)
            if not hello.startswith(MAGIC):
                raise StoreAuthError(f"{self.address} is not a prime-rl weight-broadcast store")
            server_nonce, client_nonce = hello[len(MAGIC) :], os.urandom(NONCE_BYTES)
            self.sock.sendall(client_nonce + sign(key, b"client", server_nonce, client_nonce))
            stage = "proof"
            proof = recv_exact(self.sock, MAC_BYTES)
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
        if not hmac.compare_digest(proof, sign(key, b"server", server_nonce, client_nonce)):
            raise StoreAuthError(f"the server at {self.address} does not hold this run's secret")
        return Channel(self.sock, sign(key, b"session", server_nonce, client_nonce), b"c")

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
