"""OpenAI's routes: `/v1/models`, `/v1/chat/completions`, `/v1/completions`.

HTTP only: a body is read and validated (`request_body.py`, `schemas.py`),
its model variant checked (`variants.py`), and the handler's reply
(`handlers.py`) sent as JSON or server-sent events. The two completion
endpoints also answer without `/v1` (`/chat/completions`, `/completions`),
as mlx_lm.server's chat endpoint does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from ..models import ModelDirectory, Routed
from ..replies import answered, client_gone
from ..request_body import read_routed
from . import handlers, schemas
from .variants import VariantError, check_adapter, draft_tokens


def openai_router(models: ModelDirectory, auth: Callable) -> APIRouter:
    """The OpenAI routes; `auth` is the dependency that checks the API key."""
    router = APIRouter(dependencies=[Depends(auth)])

    async def read(request: Request, model_cls: type) -> tuple[Any, Routed, int]:
        """The body, its model, and the tokens to draft per step for it (0: no
        speculative decoding)."""
        body, routed = await read_routed(request, model_cls, models, strict=True)
        service = routed.service
        try:
            check_adapter(body, service.settings)
            return body, routed, draft_tokens(body, service.settings)
        except VariantError as e:
            routed.lease.release()
            raise service.reject(400, e.message, param=e.param) from None

    async def models_list() -> dict[str, Any]:
        return handlers.models(models.settings, models.views())

    async def model(model_id: str) -> dict[str, Any]:
        name = models.pool.known(model_id)
        if name is None:
            raise models.not_found(model_id, counted=False)
        return handlers.model(models.settings, models.pool.view(name))

    async def chat_completions(request: Request) -> Response:
        body, routed, drafts = await read(request, schemas.ChatCompletionRequest)
        reply = handlers.chat_completion(routed.service, body, drafts, client_gone(request))
        return await answered(reply, routed.lease.release)

    async def completions(request: Request) -> Response:
        body, routed, drafts = await read(request, schemas.CompletionRequest)
        reply = handlers.completion(routed.service, body, drafts, client_gone(request))
        return await answered(reply, routed.lease.release)

    router.add_api_route("/v1/models", models_list, methods=["GET"])
    router.add_api_route("/v1/models/{model_id:path}", model, methods=["GET"])
    for prefix in ("/v1", ""):  # mlx_lm.server answers /chat/completions without /v1 too
        router.add_api_route(f"{prefix}/chat/completions", chat_completions, methods=["POST"])
        router.add_api_route(f"{prefix}/completions", completions, methods=["POST"])
    return router
