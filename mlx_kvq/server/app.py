"""The FastAPI app: the routers of this package over the models of one pool.

HTTP only. `openai/` answers OpenAI's chat and completions endpoints,
`anthropic/` Anthropic's Messages, `responses/` OpenAI's Responses (all
three through the one chat model of `chat/`, each request routed to the
model it names by `models.py`), `probes.py` the probes and metrics, `web.py` the page at `/` and `/status`, `api_doc.py`
`/openapi.json`; errors leave in OpenAI's body shape, or Anthropic's on its
routes (`errors.py`); `guards/` refuses what a web page must not send (a
foreign Host or Origin, API bodies that are not JSON) and new requests while
the process drains. Starting, stopping and signals belong to the process
that runs the app (`mlx_kvq.commands`).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mlx_kvq.blas import blas_info
from mlx_kvq.engine import Engine
from mlx_kvq.residency import Loaded, ModelPool

from .anthropic.routes import messages_router
from .api_doc import openapi_document
from .chat.prompting import PromptWork
from .errors import APIError, error_response_for, validation_message
from .guards.auth import api_key_check
from .guards.browser import GuardMiddleware
from .guards.draining import InFlightMiddleware, Lifecycle
from .models import ModelDirectory
from .openai.routes import openai_router
from .probes import probes_router
from .responses.routes import responses_router
from .responses.store import AgentCounters
from .settings import ServerSettings
from .web import web_router

log = logging.getLogger("mlx_kvq.server")

__all__ = ["Lifecycle", "ServerSettings", "create_app"]


def create_app(engine: Engine, settings: ServerSettings, pool: ModelPool | None = None) -> FastAPI:
    """The app serving the models of `pool`, whose default model (resident)
    is `engine` with `settings` (the server's settings too); without a pool,
    `engine` alone. `app.state.lifecycle` is how its process drains it."""
    if pool is None:
        pool = ModelPool.holding(settings.model_id, Loaded(engine, settings))
    app = FastAPI(title="mlx-kvq", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.openapi = lambda: cached_openapi(app)
    app.state.engine = engine
    app.state.settings = settings
    app.state.lifecycle = Lifecycle()
    app.state.agent_counters = AgentCounters(settings.response_store_bytes)
    # one for the app: every endpoint that prepares prompts shares its threads and cap
    app.state.prompts = PromptWork(engine.tokenizer, settings.max_context, settings.prompt_workers)
    models = app.state.models = ModelDirectory(pool, settings, app.state.prompts)
    default = models.resident(pool.default)
    assert default is not None and default.engine is engine, "the default model is `engine`"
    models.service(default)  # made now: it says how the model's answers are split
    app.add_middleware(InFlightMiddleware, lifecycle=app.state.lifecycle)
    app.add_middleware(GuardMiddleware, policy=settings.guard)  # outermost: runs first

    def respond(request: Request, status: int, message: str, param: str | None = None,
                code: str | None = None, headers: dict | None = None) -> JSONResponse:  # fmt: skip
        """An error in the shape of the API the request was for."""
        return error_response_for(request.url.path, status, message, param, code, headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else {}
        if e.retry_after is not None:
            headers["Retry-After"] = str(e.retry_after)
        if e.close:
            headers["Connection"] = "close"
        return respond(request, e.status, e.message, e.param, e.code, headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return respond(request, e.status_code, str(e.detail))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(e.errors()))
        return respond(request, 400, message, param)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return respond(request, 500, f"internal error: {type(e).__name__}")

    app.include_router(probes_router(models, app.state.agent_counters))
    app.include_router(web_router(models, blas=lambda: blas_info().to_dict()))
    auth = api_key_check(settings.api_key, models)
    app.include_router(openai_router(models, auth))
    app.include_router(messages_router(models, auth))
    app.include_router(responses_router(models, auth, app.state.agent_counters))
    return app


def cached_openapi(app: FastAPI) -> dict:
    """The app's OpenAPI document, built on first use."""
    if app.openapi_schema is None:
        app.openapi_schema = openapi_document(app)
    return app.openapi_schema
