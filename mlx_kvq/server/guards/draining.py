"""Draining: what the process running the app tells it, and what it counts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import error_response_for

RETRY_AFTER_S = 5  # what a client is told to wait while the server shuts down
BARE_API_PATHS = ("/chat/completions", "/completions")  # the API without /v1, as mlx_lm.server


def is_api_path(path: str) -> bool:
    """Whether `path` is one of the OpenAI routes (under /v1, or bare)."""
    return path.startswith("/v1/") or path in BARE_API_PATHS


@dataclass
class Lifecycle:
    """Shared with the process that runs the app: whether it is draining, and
    how many API requests are still being answered (streams until their end)."""

    draining: bool = False
    in_flight: int = 0


class InFlightMiddleware:
    """ASGI middleware: count API requests until their response ends; refuse
    new ones with 503 and Retry-After once the server is draining."""

    def __init__(self, app: Any, lifecycle: Lifecycle):
        self.app = app
        self.lifecycle = lifecycle

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not is_api_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        if self.lifecycle.draining:
            response = error_response_for(
                scope["path"], 503,
                "the server is shutting down; retry on another instance or later",
                code="shutting_down", headers={"Retry-After": str(RETRY_AFTER_S)},
            )  # fmt: skip
            await response(scope, receive, send)
            return
        self.lifecycle.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.lifecycle.in_flight -= 1
