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

from ..chat.service import ChatService
from ..replies import client_gone, http_response
from ..request_body import read_model
from . import handlers
from . import schemas as S


def messages_router(service: ChatService, auth: Callable) -> APIRouter:
    """The Messages routes; `auth` is the dependency that checks the API key."""
    router = APIRouter(dependencies=[Depends(auth)])

    async def count_tokens(request: Request) -> dict[str, Any]:
        body = await read_model(request, S.CountTokensRequest, service)
        return await handlers.count_tokens(service, body)

    async def messages(request: Request) -> Response:
        body = await read_model(request, S.MessagesRequest, service)
        return http_response(await handlers.messages(service, body, client_gone(request)))

    router.add_api_route("/v1/messages", messages, methods=["POST"])
    router.add_api_route("/v1/messages/count_tokens", count_tokens, methods=["POST"])
    return router
