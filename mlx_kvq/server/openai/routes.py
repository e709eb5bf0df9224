"""OpenAI's routes: `/v1/models`, `/v1/chat/completions`, `/v1/completions`.

HTTP only: a body is read and validated (`request_body.py`, `schemas.py`),
its model variant checked (`variants.py`), and the handler's reply
(`handlers.py`) sent as JSON or server-sent events. The two completion
endpoints also answer without `/v1` (`/chat/completions`, `/completions`),
as mlx_lm.server's chat endpoint does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from ..chat.service import ChatService
from ..replies import client_gone, http_response
from ..request_body import read_model
from ..settings import ToolFormat
from . import handlers, schemas
from .variants import VariantError, check_adapter, draft_tokens

log = logging.getLogger("mlx_kvq.server")


def openai_router(service: ChatService, auth: Callable) -> APIRouter:
    """The OpenAI routes; `auth` is the dependency that checks the API key."""
    router = APIRouter(dependencies=[Depends(auth)])
    settings = service.settings
    splitter = service.splitter
    if settings.tool_format == ToolFormat.JSON:
        calls = "in the generic JSON format (--tool-format json)"
    elif splitter.tools:
        calls = "parsed"
    else:
        calls = "not parsed (no parser for this model: tools get 400; see --tool-format json)"
    log.info(
        "chat answers: reasoning %s, tool calls %s",
        "separated" if splitter.thinking else "not marked by this tokenizer", calls,
    )  # fmt: skip

    async def read(request: Request, model_cls: type) -> tuple[Any, int]:
        """The body, and the tokens to draft per step for it (0: no speculative decoding)."""
        body = await read_model(request, model_cls, service, strict=True)
        try:
            check_adapter(body, settings)
            return body, draft_tokens(body, settings)
        except VariantError as e:
            raise service.reject(400, e.message, param=e.param) from None

    async def models() -> dict[str, Any]:
        return handlers.models(settings)

    async def model(model_id: str) -> dict[str, Any]:
        return handlers.model(settings, model_id)

    async def chat_completions(request: Request) -> Response:
        body, drafts = await read(request, schemas.ChatCompletionRequest)
        reply = await handlers.chat_completion(service, body, drafts, client_gone(request))
        return http_response(reply)

    async def completions(request: Request) -> Response:
        body, drafts = await read(request, schemas.CompletionRequest)
        reply = await handlers.completion(service, body, drafts, client_gone(request))
        return http_response(reply)

    router.add_api_route("/v1/models", models, methods=["GET"])
    router.add_api_route("/v1/models/{model_id:path}", model, methods=["GET"])
    for prefix in ("/v1", ""):  # mlx_lm.server answers /chat/completions without /v1 too
        router.add_api_route(f"{prefix}/chat/completions", chat_completions, methods=["POST"])
        router.add_api_route(f"{prefix}/completions", completions, methods=["POST"])
    return router
