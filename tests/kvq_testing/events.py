"""Sinks for engine events in in-process engine tests."""

from __future__ import annotations

import threading
import time

from mlx_kvq.engine import ErrorEvent, FinishEvent, TokenEvent

WAIT_S = 120  # upper bound for waits, so a broken engine fails instead of hanging


class Collector:
    """A sink that records a request's events and signals its first token and its end."""

    def __init__(self):
        self.events = []
        self.done = threading.Event()
        self.first_token = threading.Event()

    def __call__(self, ev):
        self.events.append(ev)
        if isinstance(ev, TokenEvent):
            self.first_token.set()
        elif isinstance(ev, FinishEvent | ErrorEvent):
            self.done.set()

    def wait(self):
        assert self.done.wait(WAIT_S), "request never finished"
        return self

    @property
    def tokens(self):
        return [e.token for e in self.events if isinstance(e, TokenEvent)]

    @property
    def text(self):
        return "".join(e.text for e in self.events if isinstance(e, TokenEvent))

    @property
    def end(self):
        return self.events[-1]


def wait_until(predicate, what: str) -> None:
    """Poll `predicate` until it holds; AssertionError naming `what` after WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")
