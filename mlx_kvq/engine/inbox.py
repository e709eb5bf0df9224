"""The engine's inbox: what other threads ask of the engine thread.

HTTP threads submit requests and cancel them; the engine thread takes what
arrived once per step as `StepCommands`. The inbox also keeps the requests
submitted and not yet admitted (for `--max-queued-requests` and the queue
depth, known as soon as a request arrives) and whether new requests are
refused, and why (draining, stopped, failed): all of it under one lock, so
that a request is either refused or reaches the engine, never lost between.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from .coordinator import StepCommands
from .requests import (
    Cancel,
    ErrorEvent,
    EventSink,
    GenerationRequest,
    Message,
    Stop,
    Submit,
)


def unavailable(reason: str) -> ErrorEvent:
    return ErrorEvent(reason, 503, "engine_unavailable")


class Inbox:
    """Messages to the engine thread; see the module docstring."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Message] = queue.Queue()
        self._sinks: dict[int, EventSink] = {}  # submitted requests not yet accepted
        self._queued: set[int] = set()  # ids submitted and not yet admitted or ended
        self._lock = threading.Lock()
        self._closed: str | None = None  # why new requests are refused

    @property
    def waiting(self) -> int:
        """Requests submitted and not yet admitted or ended."""
        return len(self._queued)

    def offer(
        self,
        request: GenerationRequest,
        sink: EventSink,
        refusal: Callable[[GenerationRequest, int], ErrorEvent | None],
    ) -> ErrorEvent | None:
        """Queue `request` unless the inbox is closed or `refusal(request,
        waiting)` refuses it; the refusal, or None once queued."""
        with self._lock:
            if self._closed is not None:
                return unavailable(self._closed)
            refused = refusal(request, len(self._queued))
            if refused is None:
                self._queued.add(request.id)
                self._queue.put(Submit(request, sink))
            return refused

    def post(self, message: Cancel | Stop) -> None:
        self._queue.put(message)

    def close(self, reason: str) -> None:
        """Refuse new requests from now on (the first reason stays)."""
        with self._lock:
            if self._closed is None:
                self._closed = reason

    def admitted(self, request_id: int) -> None:
        """`request_id` left the queue (admitted, refused or ended)."""
        with self._lock:
            self._queued.discard(request_id)

    def sink(self, request_id: int, default: EventSink) -> EventSink:
        """The sink of a submitted request, once, when the engine accepts it."""
        return self._sinks.pop(request_id, default)

    def take(self, block: bool, timeout: float) -> tuple[StepCommands, list[EventSink]]:
        """What arrived since the last call (waiting up to `timeout` seconds for
        something when `block`): the step's commands, and the sinks of requests
        that arrived behind a stop (to be refused)."""
        messages: list[Message] = []
        try:
            messages.append(self._queue.get(timeout=timeout) if block else self._queue.get_nowait())
            while True:
                messages.append(self._queue.get_nowait())
        except queue.Empty:
            pass
        submits: list[GenerationRequest] = []
        cancels: set[int] = set()
        refused: list[EventSink] = []
        stop = False
        for m in messages:
            if isinstance(m, Stop):
                stop = True
            elif isinstance(m, Cancel):
                cancels.add(m.request_id)
            elif stop:  # queued behind the stop: refused, like any later request
                self.admitted(m.request.id)
                refused.append(m.sink)
            else:
                self._sinks[m.request.id] = m.sink
                submits.append(m.request)
        return StepCommands(tuple(submits), frozenset(cancels), stop), refused

    def shut(self, reason: str, also: Callable[[], None] = lambda: None) -> list[EventSink]:
        """Close for good with `reason` (running `also` under the lock) and
        return the sinks of every request submitted and not yet accepted."""
        with self._lock:
            self._closed = reason
            also()
            self._queued.clear()
            sinks, self._sinks = list(self._sinks.values()), {}
            while True:
                try:
                    message = self._queue.get_nowait()
                except queue.Empty:
                    break
                if isinstance(message, Submit):
                    sinks.append(message.sink)
        return sinks


__all__ = ["Inbox", "unavailable"]
