"""One request's events, from the engine thread to the handler's event loop.

`Generation` submits a request to the engine and hands its events to the
handler: all at once (`collect`, for a JSON answer) or one by one (`events`,
for a stream). Either way a client that goes away gets its request
cancelled in the engine at once, which frees its memory. `events` yields
`IDLE` after `KEEPALIVE_S` seconds without any event (a request waiting for
a batch slot), so that a stream can tell its client it is still there.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from mlx_kvq.engine import (
    Engine,
    ErrorEvent,
    Event,
    FinishEvent,
    GenerationRequest,
    PromptProgress,
    TokenEvent,
)

from ..errors import APIError

_DISCONNECTED = object()  # queued when the client of a non-streaming request goes away
KEEPALIVE_S = 15.0  # seconds without an event before a stream gets a keep-alive comment
IDLE = object()  # what `events` yields after KEEPALIVE_S seconds without an event


class Generation:
    """See the module docstring."""

    def __init__(self, engine: Engine, request: GenerationRequest):
        self.engine = engine
        self.request = request
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._held: Any = None  # an event taken off the queue early, to be read first

    def _sink(self, event: Event) -> None:
        """Called on the engine thread."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # loop closed: the server is going away
            pass

    async def start(self) -> None:
        """Submit; an immediate refusal (queue full, shutting down) raises `APIError`."""
        self.engine.submit(self.request, self._sink)
        await asyncio.sleep(0)  # let a refusal from submit() land in the queue
        if not self._queue.empty():
            self._held = self._queue.get_nowait()  # a refusal comes before any token
            if isinstance(self._held, ErrorEvent):
                held = self._held
                raise APIError(held.status, held.message, code=held.code,
                               retry_after=held.retry_after)  # fmt: skip

    async def _next(self) -> Any:
        if self._held is not None:
            event, self._held = self._held, None
            return event
        return await self._queue.get()

    async def collect(
        self, client_gone: Callable[[], Awaitable[None]]
    ) -> tuple[list[TokenEvent], FinishEvent]:
        """Every token and the finish; cancels the request as soon as the client
        leaves (when `client_gone()` returns)."""
        watcher = asyncio.create_task(self._watch_disconnect(client_gone))
        tokens: list[TokenEvent] = []
        try:
            while True:
                event = await self._next()
                if event is _DISCONNECTED:
                    self.engine.cancel(self.request.id)
                    raise APIError(499, "client disconnected")
                if isinstance(event, TokenEvent):
                    tokens.append(event)
                elif isinstance(event, PromptProgress):
                    continue
                elif isinstance(event, FinishEvent):
                    return tokens, event
                else:
                    raise APIError(event.status, event.message, code=event.code)
        finally:
            watcher.cancel()

    async def events(self, idle_s: float = KEEPALIVE_S) -> AsyncIterator[Event | object]:
        """Events up to and including the last one (a finish or an error), and
        `IDLE` whenever `idle_s` seconds pass without one.

        A streaming client that leaves closes this iterator early (Starlette
        cancels the response), which cancels the request.
        """
        done = False
        waiting: asyncio.Task | None = None
        try:
            while True:
                if waiting is None:
                    waiting = asyncio.ensure_future(self._next())
                finished, _ = await asyncio.wait({waiting}, timeout=idle_s)
                if not finished:
                    yield IDLE
                    continue
                event, waiting = waiting.result(), None
                yield event
                if isinstance(event, FinishEvent | ErrorEvent):
                    done = True
                    return
        finally:
            if waiting is not None:
                waiting.cancel()
            if not done:
                self.engine.cancel(self.request.id)

    async def _watch_disconnect(self, client_gone: Callable[[], Awaitable[None]]) -> None:
        await client_gone()
        self._queue.put_nowait(_DISCONNECTED)
