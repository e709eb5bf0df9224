"""The API key check on the API routes (a FastAPI dependency)."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Protocol

from fastapi import Request

from mlx_kvq.engine import Outcome

from ..errors import APIError


class Counts(Protocol):
    """Where a refused request is counted (an engine's metrics, the app's models)."""

    def count_request(self, outcome: Outcome) -> None: ...


def api_key_check(api_key: str | None, metrics: Counts) -> Callable[[Request], Awaitable[None]]:
    """A dependency refusing requests without `Authorization: Bearer <api_key>`
    or `x-api-key: <api_key>` (Anthropic's header; constant-time compare); no
    check when `api_key` is None."""

    async def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, bearer = request.headers.get("authorization", "").partition(" ")
        keys = [bearer if scheme.lower() == "bearer" else "", request.headers.get("x-api-key", "")]
        if not any(hmac.compare_digest(k.strip().encode(), api_key.encode()) for k in keys):
            metrics.count_request(Outcome.UNAUTHORIZED)
            raise APIError(
                401,
                "missing or invalid API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                code="invalid_api_key",
            )

    return check
