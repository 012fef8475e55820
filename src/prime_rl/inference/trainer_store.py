"""An inference server's one connection to the trainer's weight-broadcast store, kept from broadcast to broadcast.

Before each broadcast the server checks that the trainer's store names the session the request names. Opening a
connection for each check made every broadcast depend on a fresh handshake, the one thing a stranger flooding the
store's port can delay; a kept connection is already authenticated. Calls run in a worker thread (`asyncio.to_thread`),
one at a time.
"""

from __future__ import annotations

import threading

from prime_rl.weight_broadcast.client import StoreClient
from prime_rl.weight_broadcast.protocol import read_session
from prime_rl.weight_broadcast.wire import StoreAuthError, StoreError

SESSION_SECONDS = 5.0
"""At most this long for the session read itself (the connect is bounded by the broadcast timeout)."""


class TrainerStore:
    def __init__(self, settings: dict):
        self.settings = settings
        """The server's `weight_broadcast` settings: host, port, timeout and the store key (hex)."""
        self.client: StoreClient | None = None
        self.lock = threading.Lock()

    def session(self) -> str:
        """The session id the trainer's store names. A kept connection that fails is replaced once, within the
        broadcast timeout (the trainer may have restarted); a store that refuses our key fails at once."""
        with self.lock:
            for attempt in (1, 2):
                if self.client is None:
                    s = self.settings
                    self.client = StoreClient(s["host"], s["port"], bytes.fromhex(s["key"]), s["timeout"])
                try:
                    return read_session(self.client, min(self.settings["timeout"], SESSION_SECONDS))["id"]
                except StoreAuthError:
                    self._drop()
                    raise
                except StoreError:
                    self._drop()
                    if attempt == 2:
                        raise
        raise AssertionError("unreachable")

    def _drop(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None

    def close(self) -> None:
        with self.lock:
            self._drop()
