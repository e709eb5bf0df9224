"""The API key check on the OpenAI routes (a FastAPI dependency)."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from fastapi import Request

from mlx_kvq.engine import EngineMetrics, Outcome

from .errors import APIError


def api_key_check(
    api_key: str | None, metrics: EngineMetrics
) -> Callable[[Request], Awaitable[None]]:
    """A dependency refusing requests without `Authorization: Bearer <api_key>`
    (constant-time compare); no check when `api_key` is None."""

    async def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode(), api_key.encode()
        ):
            metrics.count_request(Outcome.UNAUTHORIZED)
            raise APIError(
                401,
                "missing or invalid API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )

    return check
