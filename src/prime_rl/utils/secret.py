"""The run secret and the keys derived from it: what each process of a run holds, and how it gets there.

One secret per run (`PRIME_RL_SECRET`, hexadecimal, at least 128 bits) and, derived from it, one key per purpose:
- the **store key** authenticates the weight-broadcast store (trainer rank 0's rendezvous, `weight_broadcast/store.py`);
- the **HTTP token** is the inference servers' bearer token when they have no API key of their own.
Neither reveals the secret or the other: a sniffed `Authorization` header opens no store.

No process holds more than it needs, and no key travels by environment. `rl` holds the secret (it makes one for a run
on one host; hosts of one run are given the same value) and hands each process it starts its keys on that process's
stdin, one JSON line (`KEYS_VAR` says so): the trainer gets the store key, the orchestrator and the servers both. A
process calls `take_keys()` first thing, which reads them (or derives them from `PRIME_RL_SECRET` when started by
hand), removes the secret from its environment and wipes it from the block `/proc/<pid>/environ` shows. Rollout
workers get the HTTP token only, by their spawn arguments; the programs environments run (harnesses, tools) inherit
none of them. Threat model and limits: docs/architecture.md, "Security".
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import json
import os
import re
import secrets
import select
import sys
import time
from dataclasses import dataclass

SECRET_VAR = "PRIME_RL_SECRET"
KEYS_VAR = "PRIME_RL_KEYS_ON_STDIN"
"""Set (to "1") by a launcher that wrote this process's keys on its stdin; not itself a secret."""
SECRET_FORMAT = re.compile(r"^[0-9a-fA-F]{32,1024}$")
"""Hexadecimal, at least 32 digits (128 bits): what `rl`, deploy/slurm and the Helm chart generate (64 digits)."""
KEYS_SECONDS = 30.0
"""How long a process waits for its launcher's keys line on stdin."""
STORE_PURPOSE, HTTP_PURPOSE = "weight-broadcast-store", "http-token"
KEY_VARS = frozenset(
    {
        SECRET_VAR,
        KEYS_VAR,
        "PRIME_RL_INFERENCE_API_KEY",
        "INFERENCE_SERVER_API_KEY",
        "PRIME_DEPLOYMENT__INFERENCE_API_KEY",
        "PRIME_SERVER__API_KEY",
        "PRIME_INFERENCE__SERVER__API_KEY",
    }
)
"""Variables that may carry a key into `rl`: none of them passes to a process it starts (they get `RunKeys`)."""


class SecretError(ValueError):
    """The run secret or a key is missing where it is needed, or malformed."""


@dataclass(frozen=True)
class RunKeys:
    """What one process holds. None: this process was not given that key."""

    store: bytes | None = None
    """The weight-broadcast store's key (32 bytes)."""
    http: str | None = None
    """The bearer token of the run's inference servers: derived from the secret, or the operator's API key."""

    def encode(self) -> bytes:
        """The stdin line a launcher writes for a child."""
        fields = {"store": self.store.hex() if self.store else None, "http": self.http}
        return json.dumps(fields).encode() + b"\n"

    @classmethod
    def decode(cls, line: bytes) -> RunKeys:
        try:
            fields = json.loads(line)
            store, http = fields["store"], fields["http"]
            return cls(bytes.fromhex(store) if store else None, http or None)
        except (ValueError, KeyError, TypeError):
            raise SecretError(f"the keys on stdin (${KEYS_VAR}) are malformed") from None


def check_secret(value: str) -> str:
    """`value` if it is a strong enough run secret, else a `SecretError` that states the format."""
    if not SECRET_FORMAT.match(value):
        raise SecretError(
            f"${SECRET_VAR} must be hexadecimal, at least 32 digits (128 bits) and at most 1024, e.g. "
            f"`export {SECRET_VAR}=$(openssl rand -hex 32)`; got {len(value)} characters"
            + ("" if re.fullmatch(r"[0-9a-fA-F]*", value) else " that are not all hex digits")
        )
    return value


def new_secret() -> str:
    return secrets.token_hex(32)


def derive(secret: str, purpose: str) -> bytes:
    """A key for one purpose (HMAC-SHA256 of the purpose under the secret): no key tells the secret or another key."""
    return hmac.new(secret.encode(), f"prime-rl/{purpose}".encode(), hashlib.sha256).digest()


def derive_keys(secret: str) -> RunKeys:
    check_secret(secret)
    return RunKeys(derive(secret, STORE_PURPOSE), derive(secret, HTTP_PURPOSE).hex())


_taken: RunKeys | None = None


def take_keys() -> RunKeys:
    """This process's keys, read once: from stdin where the launcher put them there (`KEYS_VAR`), and derived from
    `PRIME_RL_SECRET` where it is set (the stdin ones win); none without either. Either variable is removed from the environment, so nothing this process
    starts inherits them. A trainer rank other than global rank 0 reads nothing (the ranks of a node share torchrun's
    stdin; only rank 0 hosts the store)."""
    global _taken
    if _taken is not None:
        return _taken
    keys = RunKeys()
    if os.environ.pop(KEYS_VAR, None) is not None:
        if os.environ.get("RANK", "0") == "0":
            keys = RunKeys.decode(_read_stdin_line(KEYS_SECONDS))
        _detach_stdin()
    secret = os.environ.pop(SECRET_VAR, "")
    if secret:
        wipe_initial_environment(SECRET_VAR)
        derived = derive_keys(secret)  # fills in what the launcher did not give
        keys = RunKeys(keys.store or derived.store, keys.http or derived.http)
    _taken = keys
    return keys


def take_keys_at_start(prog: str) -> RunKeys:
    """`take_keys` as an entry point's first step: a malformed secret or keys line ends it with one line, exit 2."""
    try:
        return take_keys()
    except SecretError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(2)


def adopt_keys(keys: RunKeys) -> RunKeys:
    """Make `keys` this process's (a server with keys of its own: `inference --server.attachable`)."""
    global _taken
    _taken = keys
    return keys


def forget_keys() -> None:
    """Tests only: the next `take_keys` reads again."""
    global _taken
    _taken = None


def store_key(what: str) -> bytes:
    """The store key, or a `SecretError` saying that `what` needs it and how to give it."""
    key = take_keys().store
    if key is None:
        raise SecretError(
            f"{what} needs the run secret: `rl` provides it; a process started by hand needs ${SECRET_VAR}, the same "
            f"value for the trainer, the orchestrator and the inference servers (e.g. "
            f"`export {SECRET_VAR}=$(openssl rand -hex 32)` on every host)"
        )
    return key


def http_token() -> str | None:
    """The run's inference bearer token, if this process was given one."""
    return take_keys().http


def client_token(api_key_var: str) -> str | None:
    """The bearer token a client of the run's servers sends: `api_key_var`'s value where it is set, else the run's
    HTTP token (what `rl` gives its orchestrators)."""
    return os.environ.get(api_key_var) or http_token()


def _read_stdin_line(timeout: float) -> bytes:
    deadline, data = time.monotonic() + timeout, b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([0], [], [], left)[0]:
            raise SecretError(f"waited {timeout:g} s for the launcher's keys on stdin (${KEYS_VAR} is set)")
        chunk = os.read(0, 4096)
        if not chunk or len(data) > 65536:
            raise SecretError(f"stdin ended before the launcher's keys line (${KEYS_VAR} is set)")
        data += chunk
    return data


def _detach_stdin() -> None:
    """Stdin becomes /dev/null: what this process starts must not inherit the keys pipe."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if sys.stdin is not None and not sys.stdin.closed:
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's stdin, never closed


def wipe_initial_environment(name: str) -> bool:
    """Overwrite `name=value` in the environment block the kernel shows as `/proc/<pid>/environ` (Linux), where it
    would stay for this process's life: unsetting a variable only drops it from libc's list. Returns whether it was
    found. Any process of the same user can read that file; after this it reads `name=` and zeros."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[47]), int(fields[48])  # env_start, env_end: fields 50 and 51 of proc(5)
        with open("/proc/self/environ", "rb") as f:
            block = f.read()
    except (OSError, IndexError, ValueError):
        return False
    if len(block) != end - start:
        return False
    found, prefix, offset = False, name.encode() + b"=", 0
    for entry in block.split(b"\0"):
        if entry.startswith(prefix):
            ctypes.memset(start + offset + len(prefix), 0, len(entry) - len(prefix))
            found = True
        offset += len(entry) + 1
    return found


def token_matches(token: str, allowed: list[str]) -> bool:
    """Whether `token` is one of `allowed`, in time that does not depend on how much of it matches."""
    digest = hashlib.sha256(token.encode()).digest()
    found = False
    for value in allowed:
        found |= hmac.compare_digest(digest, hashlib.sha256(value.encode()).digest())
    return found
