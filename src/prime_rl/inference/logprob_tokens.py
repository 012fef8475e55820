"""The generate route's response fix: vLLM 0.32's `/inference/v1/generate` logprob entries lack the `token` string
OpenAI-style clients require, so `GenerateLogprobTokens` adds it to JSON and streamed (SSE) replies."""

from __future__ import annotations

import json
from typing import Any

GENERATE_PATH = "/inference/v1/generate"


def add_token_strings(payload: Any) -> Any:
    """Give each generate-route logprob entry `"token": "token_id:<id>"`, the form OpenAI-style clients
    (the verifiers train client among them) require; vLLM 0.32 sends only `token_id`."""
    for choice in payload.get("choices") or [] if isinstance(payload, dict) else []:
        content = ((choice or {}).get("logprobs") or {}).get("content") or []
        for entry in content:
            if "token_id" in entry:
                entry.setdefault("token", f"token_id:{entry['token_id']}")
            for top in entry.get("top_logprobs") or []:
                if "token_id" in top:
                    top.setdefault("token", f"token_id:{top['token_id']}")
    return payload


def rewrite_sse(buffer: bytes) -> tuple[bytes, bytes]:
    """Rewrite the complete `data: {...}` events in `buffer`; returns (rewritten, incomplete rest)."""
    *events, rest = buffer.split(b"\n\n")
    out = []
    for event in events:
        lines = []
        for line in event.split(b"\n"):
            if line.startswith(b"data: {"):
                line = b"data: " + json.dumps(add_token_strings(json.loads(line[6:]))).encode()
            lines.append(line)
        out.append(b"\n".join(lines) + b"\n\n")
    return b"".join(out), rest


class GenerateLogprobTokens:
    """Pure-ASGI middleware applying `add_token_strings` to JSON and SSE responses of the generate route."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != GENERATE_PATH:
            await self.app(scope, receive, send)
            return
        start: dict = {}
        body = bytearray()
        mode = "pass"

        async def wrapped_send(message: dict) -> None:
            nonlocal mode
            if message["type"] == "http.response.start":
                content_type = dict(message.get("headers", [])).get(b"content-type", b"")
                if content_type.startswith(b"application/json"):
                    mode = "json"
                    start.update(message)  # sent once the body is complete (its length changes)
                    return
                if content_type.startswith(b"text/event-stream"):
                    mode = "sse"
                await send(message)
                return
            if message["type"] != "http.response.body" or mode == "pass":
                await send(message)
                return
            body.extend(message.get("body", b""))
            more = message.get("more_body", False)
            if mode == "sse":
                done, rest = rewrite_sse(bytes(body))
                body[:] = rest
                if not more and rest:
                    done += rest
                await send({"type": "http.response.body", "body": done, "more_body": more})
                return
            if more:
                return
            try:
                new_body = json.dumps(add_token_strings(json.loads(bytes(body)))).encode()
            except (json.JSONDecodeError, AttributeError):
                new_body = bytes(body)
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(new_body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": new_body, "more_body": False})

        await self.app(scope, receive, wrapped_send)
