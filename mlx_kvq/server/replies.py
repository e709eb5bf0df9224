"""Handler results as HTTP responses, and the client's disconnect as an awaitable.

Each API's handlers (`openai/handlers.py`, `anthropic/handlers.py`,
`responses/handlers.py`) are functions of a parsed body that return a
`Reply`: a JSON body, or the lines of a server-sent event stream. Only the
routes turn them into responses here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

Reply = dict[str, Any] | AsyncIterator[str]


def http_response(reply: Reply) -> Response:
    """A JSON body as JSON, event lines as a `text/event-stream`."""
    if isinstance(reply, dict):
        return JSONResponse(reply)
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
