"""Framing both APIs share: server-sent events, response ids, and each API's shape of an error body."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

ERROR_TYPES = {  # status -> (OpenAI error type, Anthropic error type)
    400: ("invalid_request_error", "invalid_request_error"),
    404: ("not_found_error", "not_found_error"),
    405: ("invalid_request_error", "invalid_request_error"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_error"),
    500: ("server_error", "api_error"),
}


def sse(data: dict[str, Any] | str, event: str | None = None) -> str:
    """One server-sent event: `event: NAME` (Anthropic names its events) and a `data:` line of JSON."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def openai_error(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, ERROR_TYPES[500])[0], "param": param,
                      "code": None}}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, ERROR_TYPES[500])[1], "message": message}}


def internal_error(request_id: str) -> str:
    """What a client learns of an internal error: not its text, but the id that finds it in the server's log."""
    return f"internal error; request id {request_id}"
