"""Handler results as HTTP responses, and the client's disconnect as an awaitable.

Each API's handlers (`openai/handlers.py`, `anthropic/handlers.py`,
`responses/handlers.py`) are functions of a parsed body that return a
`Reply`: a JSON body, or the lines of a server-sent event stream. Only the
routes turn them into responses here.
"""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

Reply = dict[str, Any] | AsyncIterator[str]


def http_response(reply: Reply, done: Callable[[], None] | None = None) -> Response:
    """A JSON body as JSON, event lines as a `text/event-stream`; `done()` once
    the reply has ended (the stream sent, closed or dropped unstarted)."""
    if isinstance(reply, dict):
        if done is not None:
            done()
        return JSONResponse(reply)
    if done is not None:
        reply = _until_end(reply, done)
        weakref.finalize(reply, done)  # a stream never started runs no `finally`
    return StreamingResponse(
        reply,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def client_gone(request: Request) -> Callable[[], Awaitable[None]]:
    """What returns once the client of `request` has disconnected (its body already read)."""

    async def wait() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return wait


async def answered(reply: Awaitable[Reply], done: Callable[[], None]) -> Response:
    """The reply a handler makes as a response; `done()` once it has ended,
    or at once when the handler raises."""
    try:
        result = await reply
    except BaseException:
        done()
        raise
    return http_response(result, done)


async def _until_end(reply: AsyncIterator[str], done: Callable[[], None]) -> AsyncIterator[str]:
    try:
        async for line in reply:
            yield line
    finally:
        done()
