"""Errors in OpenAI's body shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """Raise from a handler to answer with an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
        close: bool = False,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after  # seconds, sent as Retry-After (429)
        self.close = close  # the body was not read to its end: close the connection


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(
                status, "server_error" if status >= 500 else "invalid_request_error"
            ),
            "param": param,
            "code": code,
        }
    }


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status, headers=headers)


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One readable message and the offending field from pydantic errors."""
    loc = errors[0].get("loc", ())
    param = str(loc[0]) if loc else None
    msgs = []
    for e in errors[:3]:
        where = ".".join(str(x) for x in e.get("loc", ()))
        msg = e.get("msg")
        if e.get("type") == "extra_forbidden":
            msg = "this server does not support this field (docs/server.md lists those it takes)"
        msgs.append(f"{where}: {msg}" if where else str(msg))
    return "invalid request: " + "; ".join(msgs), param


# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors)
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
OVERLOADED = 529  # Anthropic's status for a server too busy to take the request


def anthropic_error_body(
    status: int, message: str, code: str | None = None
) -> tuple[int, dict[str, Any]]:
    """(status, body) in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`.
    A full queue is Anthropic's `overloaded_error` (529), which its clients retry."""
    if code == "queue_full":
        status = OVERLOADED
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return status, {"type": "error", "error": {"type": kind, "message": message}}


def is_anthropic_path(path: str) -> bool:
    """Whether `path` is one of Anthropic's routes (answered with its error shape)."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_response_for(
    path: str,
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """An error in the shape of the API `path` belongs to (Anthropic's or OpenAI's)."""
    if is_anthropic_path(path):
        status, body = anthropic_error_body(status, message, code)
        return JSONResponse(body, status, headers=headers)
    return error_response(status, message, param, code, headers)
