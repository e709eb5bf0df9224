"""Anthropic's routes: `POST /v1/messages` and `/v1/messages/count_tokens`.

HTTP only: the body is read and validated (`request_body.py`,
`schemas.py`) and the handler's reply (`handlers.py`) sent as JSON or
server-sent events. Claude Code adds `?beta=true`, which changes nothing
here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from ..models import ModelDirectory
from ..replies import answered, client_gone
from ..request_body import read_routed
from . import handlers
from . import schemas as S


def messages_router(models: ModelDirectory, auth: Callable) -> APIRouter:
    """The Messages routes; `auth` is the dependency that checks the API key."""
    router = APIRouter(dependencies=[Depends(auth)])

    async def count_tokens(request: Request) -> dict[str, Any]:
        body, routed = await read_routed(request, S.CountTokensRequest, models)
        try:
            return await handlers.count_tokens(routed.service, body)
        finally:
            routed.lease.release()

    async def messages(request: Request) -> Response:
        body, routed = await read_routed(request, S.MessagesRequest, models)
        reply = handlers.messages(routed.service, body, client_gone(request))
        return await answered(reply, routed.lease.release)

    router.add_api_route("/v1/messages", messages, methods=["POST"])
    router.add_api_route("/v1/messages/count_tokens", count_tokens, methods=["POST"])
    return router
