"""OpenAI's Responses routes: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

HTTP only: the body is read and validated (`request_body.py`,
`schemas.py`) and the handler's reply (`handlers.py`) sent as JSON or
server-sent events.
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
from .store import AgentCounters


def responses_router(models: ModelDirectory, auth: Callable, counters: AgentCounters) -> APIRouter:
    """The Responses routes; `auth` is the dependency that checks the API key."""
    router = APIRouter(dependencies=[Depends(auth)])

    async def create(request: Request) -> Response:
        body, routed = await read_routed(request, S.ResponsesRequest, models)
        reply = handlers.create(routed.service, counters, body, client_gone(request))
        return await answered(reply, routed.lease.release)

    async def retrieve(response_id: str) -> dict[str, Any]:
        return handlers.retrieve(counters, response_id)

    async def delete(response_id: str) -> dict[str, Any]:
        return handlers.delete(counters, response_id)

    router.add_api_route("/v1/responses", create, methods=["POST"])
    router.add_api_route("/v1/responses/{response_id}", retrieve, methods=["GET"])
    router.add_api_route("/v1/responses/{response_id}", delete, methods=["DELETE"])
    return router
