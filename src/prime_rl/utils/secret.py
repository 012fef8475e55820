"""The run secret: one value per run that every process of the run holds, and nothing else does.

It authenticates the weight-broadcast store (trainer rank 0's rendezvous, `weight_broadcast/store.py`) and is the
inference servers' bearer token when they have no API key. It travels only by the environment (`PRIME_RL_SECRET`),
never in a config file, a command line or a log: `rl` generates one for a run on one host; a run over several hosts
(SLURM, Helm) is given the same value on every host.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

SECRET_VAR = "PRIME_RL_SECRET"
MIN_CHARS = 16
"""Shorter values are refused: the secret is the only thing between a co-tenant and the policy's weights."""


class SecretError(ValueError):
    """The run secret is missing where it is needed, or malformed."""


def run_secret() -> str | None:
    """This process's run secret (None when `PRIME_RL_SECRET` is unset or empty)."""
    value = os.environ.get(SECRET_VAR, "")
    if not value:
        return None
    if len(value) < MIN_CHARS or not value.isprintable() or any(c.isspace() for c in value):
        raise SecretError(
            f"${SECRET_VAR} must be at least {MIN_CHARS} printable characters without spaces "
            f"(e.g. `export {SECRET_VAR}=$(openssl rand -hex 32)`)"
        )
    return value


def require_secret(what: str) -> str:
    """The run secret, or a `SecretError` saying that `what` needs it and how to give it."""
    secret = run_secret()
    if secret is None:
        raise SecretError(
            f"{what} needs the run secret in ${SECRET_VAR}: the same value for the trainer, the orchestrator and "
            f"the inference servers (`rl` makes one for a run on one host; otherwise e.g. "
            f"`export {SECRET_VAR}=$(openssl rand -hex 32)` on every host)"
        )
    return secret


def new_secret() -> str:
    return secrets.token_hex(32)


def derive(secret: str, purpose: str) -> bytes:
    """A key for one purpose, so that no message of one use of the secret is valid in another."""
    return hmac.new(secret.encode(), f"prime-rl/{purpose}".encode(), hashlib.sha256).digest()


def token_matches(token: str, allowed: list[str]) -> bool:
    """Whether `token` is one of `allowed`, in time that does not depend on how much of it matches."""
    digest = hashlib.sha256(token.encode()).digest()
    found = False
    for value in allowed:
        found |= hmac.compare_digest(digest, hashlib.sha256(value.encode()).digest())
    return found
