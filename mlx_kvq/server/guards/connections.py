"""Connections: how many are held, and how long one may take to say what it wants.

uvicorn reads headers and bodies without a deadline and accepts connections
without a cap (its `limit_concurrency` answers 503 per request, after the
socket is held), so slow or idle clients can hold sockets until the process
runs out of file descriptors. `guarded_protocol` is uvicorn's h11 protocol
with the missing bounds:

- a connection over `max_connections` is answered 503 and closed at once;
- a request's headers must arrive within `header_timeout` seconds of the
  connection opening or of the first byte of a later request on it (an
  idle connection that never sends a request is closed then too);
- between requests, uvicorn's keep-alive timeout applies as before.

The body deadline (`--body-timeout`) is kept where the body is read
(`body.py`), so that the request gets a 408 instead of a dropped socket.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

_BUSY_TEXT = b"too many open connections\n"
BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\nretry-after: 1\r\ncontent-length: %d\r\n\r\n%s"
    % (len(_BUSY_TEXT), _BUSY_TEXT)
)


@dataclass(frozen=True)
class ConnectionLimits:
    """The connection bounds of one server (`--header-timeout`, `--max-connections`,
    `--keep-alive-timeout`)."""

    header_timeout: float = 10.0
    max_connections: int = 512
    keep_alive_timeout: float = 5.0


def guarded_protocol(limits: ConnectionLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with `limits` (see the module docstring)."""

    class GuardedH11Protocol(H11Protocol):
        header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                transport.write(BUSY)
                transport.close()
                return
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.transport.is_closing():
                self._cancel_header_timer()
            elif self.conn.their_state is h11.IDLE:
                if self.header_timer is None and self.conn.our_state is h11.IDLE and data:
                    self._arm_header_timer()  # the first bytes of a later request
            else:
                self._cancel_header_timer()  # the request line and headers are in

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            self.header_timer = self.loop.call_later(limits.header_timeout, self._header_timeout)

        def _cancel_header_timer(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None

        def _header_timeout(self) -> None:
            self.header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return GuardedH11Protocol
