"""What an OpenAI-compatible endpoint sends besides its results: the error body
``{"error": {"message", "type", "param", "code"}}`` (as JSON or as one SSE event) and SSE
framing. Shared by the API server and the router; imports no engine (the router loads no
model)."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse

SSE_DONE = "[DONE]"  # the last event of every stream


def error_body(
    message: str,
    err_type: str = "invalid_request_error",
    param: str | None = None,
    code: int | str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    err_type: str = "invalid_request_error",
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """An error answer: ``error_body`` with the status as its code."""
    return JSONResponse(
        error_body(message, err_type, param, status), status_code=status, headers=headers
    )


def sse_event(obj: dict[str, Any] | str) -> str:
    """One server-sent event: ``data: <JSON of obj, or obj as it is if text>``."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"
