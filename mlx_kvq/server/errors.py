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
