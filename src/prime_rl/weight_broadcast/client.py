"""The weight-broadcast store's client side: `StoreClient`, one authenticated connection to trainer rank 0's
`StoreServer` (no torch: the orchestrator uses it; `transfer.GroupStore` is the gloo/NCCL rendezvous on it)."""

from __future__ import annotations

import hmac
import os
import random
import socket
import struct
import threading
import time

from prime_rl.weight_broadcast.wire import (
    BUSY,
    IDLE,
    MAC_BYTES,
    MAGIC,
    MAX_WAIT_SECONDS,
    NONCE_BYTES,
    Channel,
    Malformed,
    StoreAuthError,
    StoreError,
    StoreFull,
    StoreTimeout,
    StoreUnavailable,
    keep_alive,
    recv_exact,
    sign,
    time_left,
)

CONNECT_SECONDS = 5.0
RETRY_BACKOFF = (0.05, 1.0)
"""A refused or reset connection is tried again after 0.05 s, doubling to 1 s (each with jitter: half to all of it),
until the connect deadline."""
CONNECT_ATTEMPT_SECONDS = 0.25
"""How long the first attempt waits for TCP to connect, doubling each time it runs out: a SYN that a full accept
queue dropped is sent again by the kernel only after 1 s (then 3 s), a new attempt's at once."""


class _Retry(Exception):
    """A connection attempt that failed in a way another may not: nothing listening yet, reset, or turned away busy
    (`waited`: it ran out of time connecting, and is tried again at once)."""

    def __init__(self, reason: str, waited: bool = False):
        super().__init__(reason)
        self.waited = waited


class StoreClient:
    """A connection to a `StoreServer`, authenticated both ways within `connect_timeout` (one deadline for every
    attempt: a refused, reset or busy connection is tried again, with backoff, until it; a wrong secret never is).
    One call at a time; each has one deadline, `timeout` (plus the wait a `get` asks for), however slowly the peer
    sends. A connection the server closed for idleness is reopened at the next call, within that call's deadline.
    After any other failure the connection is closed and every later call fails at once: a stream that failed
    midway cannot be trusted to be in step.

    `retry_refused=False`: fail at once when nothing listens (for a caller that polls for the store itself, on an
    event loop that must not block)."""

    def __init__(
        self,
        host: str,
        port: int,
        key: bytes,
        timeout: float,
        connect_timeout: float = CONNECT_SECONDS,
        *,
        retry_refused: bool = True,
    ):
        self.host, self.port, self.address, self.timeout = host, port, f"{host}:{port}", timeout
        self.connect_timeout = min(timeout, connect_timeout)
        self.retry_refused = retry_refused
        self._key = key
        self.lock = threading.Lock()
        self.sock: socket.socket | None = None
        self.channel: Channel | None = None
        self.reconnects = 0
        """Connections reopened after the server closed one for idleness."""
        self._connect(time.monotonic() + self.connect_timeout)

    def _connect(self, deadline: float) -> None:
        """Connect and authenticate by `deadline`, trying again after a refusal, a reset or a busy store."""
        delay, patience, attempts, last = RETRY_BACKOFF[0], CONNECT_ATTEMPT_SECONDS, 0, None
        while True:
            if last is not None and deadline - time.monotonic() <= 0.0:
                raise StoreUnavailable(
                    f"no weight-broadcast store answered at {self.address} within {self.connect_timeout:g} s "
                    f"({attempts} attempt(s); the last: {last})"
                )
            attempts += 1
            try:
                self.sock = self._attempt(deadline, patience)
                return
            except _Retry as e:
                last = e
                if e.waited:
                    patience *= 2
                    continue
                time.sleep(max(0.0, min(deadline - time.monotonic(), delay * random.uniform(0.5, 1.0))))
                delay = min(delay * 2, RETRY_BACKOFF[1])

    def _attempt(self, deadline: float, patience: float) -> socket.socket:
        left = deadline - time.monotonic()
        try:
            if left <= 0.0:
                raise TimeoutError
            sock = socket.create_connection((self.host, self.port), timeout=min(left, patience))
        except ConnectionRefusedError as e:
            if self.retry_refused:
                raise _Retry(f"refused: {e}") from None
            raise StoreUnavailable(f"no weight-broadcast store at {self.address} ({e})") from None
        except (ConnectionResetError, ConnectionAbortedError) as e:
            raise _Retry(f"reset: {e}") from None
        except TimeoutError:
            if deadline - time.monotonic() > 0.0:
                raise _Retry(f"no answer to connecting within {min(left, patience):.2g} s", waited=True) from None
            raise StoreTimeout(
                f"the weight-broadcast store at {self.address} did not authenticate within {self.connect_timeout:g} s "
                "(no answer to connecting)"
            ) from None
        except OSError as e:
            raise StoreUnavailable(f"no weight-broadcast store at {self.address} ({e})") from None
        try:
            self.channel = self._handshake(sock, deadline)
            keep_alive(sock)
            return sock
        except BaseException:
            sock.close()
            raise

    def _handshake(self, sock: socket.socket, deadline: float) -> Channel:
        stage = "hello"
        try:
            hello = recv_exact(sock, len(MAGIC) + NONCE_BYTES, deadline)
            if not hello.startswith(MAGIC):
                raise StoreAuthError(f"{self.address} is not a prime-rl weight-broadcast store")
            server_nonce, client_nonce = hello[len(MAGIC) :], os.urandom(NONCE_BYTES)
            time_left(sock, deadline)
            sock.sendall(client_nonce + sign(self._key, b"client", server_nonce, client_nonce))
            stage = "proof"
            proof = recv_exact(sock, MAC_BYTES, deadline)
        except TimeoutError:
            raise StoreTimeout(
                f"the weight-broadcast store at {self.address} did not authenticate within {self.connect_timeout:g} s "
                "(is this address trainer rank 0's store?)"
            ) from None
        except ConnectionError as e:
            # Only a clean close right after our answer means a wrong secret: a reset (or a close before the
            # greeting) is a store too busy or not quite up, which may well take the next attempt.
            if stage == "proof" and type(e) is ConnectionError:
                raise StoreAuthError(
                    f"the weight-broadcast store at {self.address} refused our run secret (PRIME_RL_SECRET must be "
                    "the same for trainer, orchestrator and servers)"
                ) from None
            raise _Retry(f"closed at the {stage} ({e})") from None
        except OSError as e:
            raise StoreUnavailable(f"weight-broadcast store at {self.address}: {e}") from None
        if proof == BUSY:
            raise _Retry("the store was busy")
        if not hmac.compare_digest(proof, sign(self._key, b"server", server_nonce, client_nonce)):
            raise StoreAuthError(f"the server at {self.address} does not hold this run's secret")
        return Channel(sock, sign(self._key, b"session", server_nonce, client_nonce), b"c")

    def close(self) -> None:
        with self.lock:
            self._close()

    def _close(self) -> None:
        self.channel = None
        if self.sock is not None:
            self.sock.close()

    def _call(self, *fields: bytes, wait: float = 0.0) -> list[bytes]:
        seconds = self.timeout + wait
        with self.lock:
            deadline = time.monotonic() + seconds
            reply = self._exchange(list(fields), deadline, seconds)
            if reply == [IDLE]:  # closed for idleness before it read our request: not served, so sent again
                self._close()
                self.reconnects += 1
                try:
                    self._connect(min(deadline, time.monotonic() + self.connect_timeout))
                except BaseException:
                    self._close()
                    raise
                reply = self._exchange(list(fields), deadline, seconds)
                if reply == [IDLE]:
                    self._close()
                    raise StoreUnavailable(f"the weight-broadcast store at {self.address} keeps closing on us")
        if reply[:1] == [b"ok"]:
            return reply[1:]
        if reply[:1] == [b"timeout"]:
            raise StoreTimeout(f"{fields[1].decode()!r} was not set within {wait:g} s (store at {self.address})")
        message = reply[1].decode(errors="replace") if len(reply) > 1 else "no reason given"
        raise StoreFull(f"the weight-broadcast store refused {fields[0].decode()}: {message}")

    def _exchange(self, fields: list[bytes], deadline: float, seconds: float) -> list[bytes]:
        """Send one request and read its reply by `deadline`; [IDLE] when the server had closed the connection for
        idleness (before sending anything, when its farewell is already there)."""
        if self.channel is None:
            raise StoreUnavailable(f"the connection to the weight-broadcast store at {self.address} is closed")
        try:
            if self._readable():  # the server spoke first: only its idle farewell may come unasked
                reply = self.channel.receive(deadline)
                if reply != [IDLE]:
                    raise Malformed("a frame nobody asked for")
                return reply
            self.channel.send(fields, deadline)
            return self.channel.receive(deadline)
        except TimeoutError:
            self._close()
            raise StoreTimeout(
                f"the weight-broadcast store at {self.address} did not answer within {seconds:g} s"
            ) from None
        except (OSError, StoreError, struct.error) as e:
            self._close()
            raise StoreUnavailable(f"the weight-broadcast store at {self.address} stopped answering ({e})") from None

    def _readable(self) -> bool:
        """Whether anything (a frame, a close, a reset) waits on the connection, without waiting for it."""
        self.sock.settimeout(0.0)
        try:
            self.sock.recv(1, socket.MSG_PEEK)  # a byte, or b"" for a close
            return True
        except BlockingIOError:
            return False
        except OSError:
            return True  # reset: the receive that follows reports it

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
