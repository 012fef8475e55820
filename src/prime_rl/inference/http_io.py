"""Reading admin request bodies and writing error replies in vLLM's shape: shared by the access guard, the
weights-unknown gate and the admin routes, so every refusal a client sees looks the same."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from prime_rl.inference.weights import clip

MAX_BODY_BYTES = 1 << 20
"""Admin request bodies above 1 MiB are refused (413) before they are parsed."""


def error_response(code: int, message: str, **extra: Any) -> JSONResponse:
    """vLLM's error shape; `extra` adds top-level fields (the 503 `/health` reply's `status`)."""
    return JSONResponse(status_code=code, content={**extra, "error": {"message": clip(message, 2000), "code": code}})


class BodyError(Exception):
    """An admin request body refused before validation (413 too large, 400 not a JSON object)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The request body, refusing more than `limit` bytes (declared or streamed) without buffering them."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise BodyError(413, f"request body exceeds the limit of {limit} bytes")
    return bytes(body)


def parse_json_object(raw: bytes, empty_ok: bool = False) -> dict:
    """The body as a JSON object; `BodyError(400)` for anything that is not one (empty only if `empty_ok`)."""
    if not raw.strip():
        if empty_ok:
            return {}
        raise BodyError(400, "request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except RecursionError:
        raise BodyError(400, "request body is not valid JSON: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, invalid UTF-8, integers over the digit limit
        raise BodyError(400, f"request body is not valid JSON: {clip(e)}") from None
    if not isinstance(body, dict):
        raise BodyError(400, f"request body must be a JSON object, got {type(body).__name__}")
    return body


def validation_message(e: ValidationError, count: int = 5) -> str:
    """Pydantic's problems without the offending input, at most `count` of them, field names clipped."""
    errors = e.errors(include_url=False, include_input=False)
    problems = [f"{clip('.'.join(map(str, x['loc'])) or 'body', 100)}: {x['msg']}" for x in errors[:count]]
    more = f" (+{len(errors) - count} more)" if len(errors) > count else ""
    return f"invalid request: {'; '.join(problems)}{more}"


def check_json_content_type(request: Request) -> None:
    """Admin requests must say `Content-Type: application/json`, even with an empty body: a web page can make a
    browser send a cross-site POST without asking first only with a form's or text's type, so this refuses every
    request a browser was tricked into sending (415)."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        shown = clip(media_type, 60) if media_type else "none"
        raise BodyError(415, f"admin requests need Content-Type: application/json (got {shown})")


async def parse_request(request: Request, model: type[BaseModel], empty_ok: bool = False) -> BaseModel | JSONResponse:
    """Read, parse and validate an admin request (`AccessGuard` has checked the token); a JSONResponse is the error
    reply."""
    try:
        check_json_content_type(request)
        body = parse_json_object(await read_body(request), empty_ok=empty_ok)
    except BodyError as e:
        return error_response(e.status, e.message)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        return error_response(422, validation_message(e))
