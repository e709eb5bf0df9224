"""Request bodies as JSON that everything downstream can take.

JSON allows more than the rest of the server can handle: nesting deep enough
to exhaust Python's recursion, integers too long to convert, and strings
holding lone UTF-16 surrogates (`"\\ud800"`) that can be neither encoded nor
rendered by a chat template. Each is refused here with a 400 naming the
field, so no request reaches the engine carrying one.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import ClientDisconnect

MAX_DEPTH = 64  # JSON nesting accepted; OpenAI request bodies need fewer than ten
DRAIN_POLL_S = 0.1  # how often a body still arriving looks whether the server drains


class BodyError(ValueError):
    """The body cannot be accepted; `param` is the top-level field at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class BodyNotRead(Exception):
    """The body was not read to its end: too large, too slow, or the server drains."""

    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


async def receive_body(
    receive: Callable[[], Awaitable[dict]],
    limit: int,
    timeout: float | None,
    draining: Callable[[], bool],
    declared: str | None = None,
) -> bytes:
    """The request body from ASGI `receive`, within bounds.

    Over `limit` bytes (as declared in `Content-Length` or as counted) is a
    413; a body still arriving `timeout` seconds after reading began is a
    408; once `draining()` says the server drains, a body still arriving is
    a 503 at once, so the drain waits only for requests that have arrived.
    A client that leaves raises starlette's `ClientDisconnect`.
    """
    if declared is not None:
        if not declared.isdigit():
            raise BodyError("invalid Content-Length header")
        if int(declared) > limit:
            raise BodyNotRead(413, f"request body over {limit} bytes", "request_too_large")
    deadline = None if timeout is None else time.monotonic() + timeout
    chunks, size = [], 0
    while True:
        message = await _next_message(receive, deadline, draining)
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyNotRead(413, f"request body over {limit} bytes", "request_too_large")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _next_message(receive, deadline: float | None, draining: Callable[[], bool]) -> dict:
    task = asyncio.ensure_future(receive())
    try:
        while True:
            wait = DRAIN_POLL_S
            if deadline is not None:
                wait = min(wait, max(deadline - time.monotonic(), 0.0))
            done, _ = await asyncio.wait({task}, timeout=wait)
            if done:
                return task.result()
            if draining():
                raise BodyNotRead(
                    503, "the server is shutting down; retry on another instance or later",
                    "shutting_down",
                )  # fmt: skip
            if deadline is not None and time.monotonic() >= deadline:
                raise BodyNotRead(
                    408, "the request body did not arrive within the server's body timeout "
                    "(--body-timeout)", "request_timeout",
                )  # fmt: skip
    finally:
        if not task.done():
            task.cancel()


def parse_body(raw: bytes, first: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """The request body as a JSON object, or `BodyError`; `first` looks at the
    object before the walk over every value (to refuse cheaply what cannot fit)."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise BodyError(f"the request body is nested more than {MAX_DEPTH} levels deep") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BodyError(f"the request body is not valid JSON: {e}") from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise BodyError(f"the request body holds a value that cannot be read: {e}") from None
    if not isinstance(data, dict):
        raise BodyError("the request body must be a JSON object")
    if first is not None:
        first(data)
    check_values(data)
    return data


def check_values(data: dict[str, Any]) -> None:
    """Refuse nesting deeper than MAX_DEPTH and strings that are not valid Unicode."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if len(path) > MAX_DEPTH:
            raise BodyError(
                f"{_dotted(path[:3])}...: the request body is nested more than "
                f"{MAX_DEPTH} levels deep",
                _safe(path[0]),
            )
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, (*path, key))
                stack.append((item, (*path, key)))
        elif isinstance(value, list):
            stack.extend((item, (*path, str(i))) for i, item in enumerate(value))


def _check_text(text: str, path: tuple[str, ...]) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise BodyError(
            f"{_dotted(path)}: the string holds a lone UTF-16 surrogate, which is not "
            "valid Unicode; send the character itself or a valid surrogate pair",
            _safe(path[0]) if path else None,
        ) from None


def _dotted(path: tuple[str, ...]) -> str:
    return ".".join(_safe(p) for p in path) if path else "body"


def _safe(name: str) -> str:
    """A field name that can be written into an error body (surrogates escaped)."""
    return name.encode("utf-8", "backslashreplace").decode("utf-8")
