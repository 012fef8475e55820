"""Who may use a server: the bearer tokens it accepts, whether it may start without any, and `AccessGuard`, the
middleware in front of every route (the security model: docs/architecture.md)."""

from __future__ import annotations

import os
from argparse import Namespace
from typing import Any

from prime_rl.inference.http_io import error_response
from prime_rl.utils.net import is_loopback
from prime_rl.utils.secret import http_token, token_matches

PUBLIC_PATHS = frozenset({"/health", "/ping", "/version"})
"""The only routes that answer without the server's token: a route vLLM adds later is closed until listed here."""


def server_tokens(args: Namespace) -> list[str]:
    """The bearer tokens this server accepts: its API key(s) (`--api-key`, `VLLM_API_KEY`), or without one the run's
    HTTP token (derived from the run secret, never the secret itself); empty: it is open (allowed only on loopback, or
    when its operator said so: `open_access_problem`)."""
    keys = [k for k in (getattr(args, "api_key", None) or [os.environ.get("VLLM_API_KEY")]) if k]
    if keys:
        return keys
    token = http_token()
    return [token] if token else []


def open_access_problem(host: str, tokens: list[str], allow_unauthenticated: bool) -> str | None:
    """Why a server must not start this way: no token while listening beyond loopback, unless explicitly allowed."""
    if tokens or allow_unauthenticated or is_loopback(host):
        return None
    return (
        f"the server would listen on {host!r} with no API key and no run secret: anyone who reaches the port could "
        "swap its weights. Give it a key by environment (PRIME_SERVER__API_KEY, or PRIME_RL_SECRET for a run), or "
        "say --server.allow-unauthenticated to serve openly on a network you trust"
    )


class AccessGuard:
    """Pure-ASGI middleware in front of every route, ours and vLLM's: without the server's token only `PUBLIC_PATHS`
    answer (401 JSON for HTTP, close code 1008 for a websocket). A route vLLM adds in a later version is therefore
    closed by default. The token list is `app.state.prime_tokens` (set once the app state is built; until then only
    public paths answer)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        tokens = getattr(getattr(scope.get("app"), "state", None), "prime_tokens", None)
        if tokens is not None and (not tokens or _bearer_ok(scope, tokens)):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await receive()  # websocket.connect
            await send({"type": "websocket.close", "code": 1008})
            return
        await error_response(401, "missing or wrong API key")(scope, receive, send)


def _bearer_ok(scope: dict, tokens: list[str]) -> bool:
    header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and token_matches(token, tokens)
