"""The FastAPI app: OpenAI endpoints over the engine, plus /health, /live, /metrics.

HTTP only: requests are authenticated, size-checked, parsed and validated
here, turned into token ids, and handed to the engine; engine events come
back through an asyncio queue per request and leave as JSON or server-sent
events. A client that disconnects has its request cancelled in the engine.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from mlx_kvq.engine import (
    Engine,
    ErrorEvent,
    FinishEvent,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
)
from mlx_kvq.engine.prompts import chat_tokens, completion_tokens

from . import schemas
from .errors import APIError, error_body, error_response, validation_message
from .prometheus import make_registry

log = logging.getLogger("mlx_kvq.server")

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks for its client
DEFAULT_MODEL_ALIAS = "default_model"  # what clients written for mlx_lm.server send


@dataclass
class ServerSettings:
    """What the HTTP layer needs besides the engine."""

    model_id: str
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    chat_template_args: dict[str, Any] = field(default_factory=dict)
    max_context: int | None = None
    plan: dict[str, Any] = field(default_factory=dict)
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    created: int = field(default_factory=lambda: int(time.time()))


class _Events:
    """An asyncio queue fed from the engine thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def sink(self, event: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # loop closed: the server is going away
            pass


def create_app(engine: Engine, settings: ServerSettings) -> FastAPI:
    """Build the app serving `engine`."""
    app = FastAPI(title="mlx-kvq", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    app.state.settings = settings
    kinds = set(settings.plan.get("kinds", {}) if isinstance(settings.plan, dict) else ())
    registry = make_registry(engine, kinds or set(getattr(engine.plan, "kinds", ()) or ()))
    token_text = schemas.TokenText(engine.tokenizer)
    app.add_middleware(
        CORSMiddleware,
        allow_origins=settings.allowed_origins,
        allow_methods=["*"],
        allow_headers=["*"],
    )

    def reject(status: int, message: str, **kw: Any) -> APIError:
        engine.metrics.count_request("rejected")
        return APIError(status, message, **kw)

    # ------------------------------------------------------------ errors
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        return error_response(e.status, e.message, e.param, e.code, headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(e.errors()))
        return error_response(400, message, param)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(500, f"internal error: {type(e).__name__}")

    # ------------------------------------------------------------ probes
    @app.get("/live")
    async def live() -> dict[str, str]:
        return {"status": "alive"}

    @app.get("/health")
    async def health() -> JSONResponse:
        state = engine.readiness.get()
        if state.status == "ready" and not engine.alive:
            return JSONResponse({"status": "failed", "reason": "engine thread exited"}, 503)
        if state.status == "warming_up":
            return JSONResponse({"status": "warming_up"}, 503)
        if state.status == "failed":
            return JSONResponse({"status": "failed", "reason": state.reason}, 503)
        return JSONResponse(
            {
                "status": "ok",
                "model": settings.model_id,
                "plan": plan_health(settings.plan),
                "warmup": state.report,
            }
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    # ------------------------------------------------------------ /v1
    async def require_key(request: Request) -> None:
        if settings.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode(), settings.api_key.encode()
        ):
            engine.metrics.count_request("rejected")
            raise APIError(
                401,
                "missing or invalid API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        return schemas.models_body(settings.model_id, settings.created)

    async def read_json(request: Request, model_cls: type) -> Any:
        limit = settings.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise reject(400, "invalid Content-Length header")
            if int(declared) > limit:
                raise reject(413, f"request body over {limit} bytes", code="request_too_large")
        body, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise reject(413, f"request body over {limit} bytes", code="request_too_large")
            body.append(chunk)
        try:
            data = json.loads(b"".join(body))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise reject(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise reject(400, "the request body must be a JSON object")
        try:
            parsed = model_cls.model_validate(data)
        except ValidationError as e:
            message, param = validation_message(e.errors())
            raise reject(400, message, param=param) from None
        if parsed.model not in (settings.model_id, DEFAULT_MODEL_ALIAS):
            raise reject(
                404,
                f"the model '{parsed.model}' does not exist; this server serves "
                f"'{settings.model_id}'",
                param="model",
                code="model_not_found",
            )
        return parsed

    def sampling(body: Any, logprobs: bool, top: int) -> SamplingParams:
        def pick(value: Any, default: Any) -> Any:
            return default if value is None else value

        return SamplingParams(
            max_tokens=pick(body.token_limit, settings.max_tokens),
            temperature=pick(body.temperature, settings.temperature),
            top_p=pick(body.top_p, settings.top_p),
            top_k=pick(body.top_k, settings.top_k),
            min_p=pick(body.min_p, settings.min_p),
            seed=body.seed,
            stop=body.stop_strings,
            logprobs=logprobs,
            top_logprobs=top,
        )

    def check_length(prompt: list[int]) -> None:
        if not prompt:
            raise reject(400, "the prompt is empty", param="messages")
        limit = settings.max_context
        if limit is not None and len(prompt) >= limit:
            raise reject(
                400,
                f"the prompt has {len(prompt)} tokens; this server's KV plan allows a "
                f"context of {limit} tokens",
                code="context_length_exceeded",
            )

    async def start(prompt: list[int], params: SamplingParams) -> tuple[_Events, int]:
        events = _Events(asyncio.get_running_loop())
        req = GenerationRequest(prompt, params)
        engine.submit(req, events.sink)
        await asyncio.sleep(0)  # let an immediate refusal land in the queue
        if not events.queue.empty():
            first = events.queue._queue[0]  # peek: a refusal comes before any token
            if isinstance(first, ErrorEvent):
                raise APIError(first.status, first.message, code=first.code)
        return events, req.id

    async def collect(request: Request, events: _Events, rid: int) -> tuple[list, FinishEvent]:
        """Wait for the whole generation; cancel it if the client goes away."""
        tokens: list[TokenEvent] = []
        while True:
            try:
                ev = await asyncio.wait_for(events.queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    engine.cancel(rid)
                    raise APIError(499, "client disconnected") from None
                continue
            if isinstance(ev, TokenEvent):
                tokens.append(ev)
            elif isinstance(ev, FinishEvent):
                return tokens, ev
            else:
                raise APIError(ev.status, ev.message, code=ev.code)

    def sse(data: Any) -> str:
        return f"data: {json.dumps(data)}\n\n"

    def stream_response(gen: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(
            gen,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def stream_events(events: _Events, rid: int) -> AsyncIterator[Any]:
        """Engine events until the end; cancels the request if the client leaves."""
        done = False
        try:
            while True:
                ev = await events.queue.get()
                yield ev
                if not isinstance(ev, TokenEvent):
                    done = True
                    return
        finally:
            if not done:
                engine.cancel(rid)

    # ------------------------------------------------------------ chat
    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await read_json(request, schemas.ChatCompletionRequest)
        template_args = dict(settings.chat_template_args)
        template_args.update(body.chat_template_kwargs or {})
        try:
            prompt = chat_tokens(
                engine.tokenizer,
                [m.as_template_dict() for m in body.messages],
                template_args,
                body.tools,
            )
        except Exception as e:  # template errors are the request's fault
            raise reject(400, f"could not apply the chat template: {e}", param="messages") from e
        check_length(prompt)
        params = sampling(body, body.logprobs, body.top_logprobs or 0)
        events, rid = await start(prompt, params)
        cid = schemas.new_id("chatcmpl")
        model = settings.model_id

        if not body.stream:
            tokens, fin = await collect(request, events, rid)
            text = "".join(t.text for t in tokens)
            lp = schemas.chat_logprobs(tokens, token_text) if body.logprobs else None
            return JSONResponse(schemas.chat_body(cid, model, text, fin.reason, fin.usage, lp))

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def gen() -> AsyncIterator[str]:
            yield sse(schemas.chat_chunk(cid, model, {"role": "assistant", "content": ""}))
            pending: list[TokenEvent] = []
            async for ev in stream_events(events, rid):
                if isinstance(ev, TokenEvent):
                    pending.append(ev)
                    if ev.text:
                        lp = schemas.chat_logprobs(pending, token_text) if body.logprobs else None
                        yield sse(schemas.chat_chunk(cid, model, {"content": ev.text}, None, lp))
                        pending = []
                elif isinstance(ev, FinishEvent):
                    lp = schemas.chat_logprobs(pending, token_text) if body.logprobs else None
                    usage = None if include_usage else ev.usage
                    yield sse(schemas.chat_chunk(cid, model, {}, ev.reason, lp, usage))
                    if include_usage:
                        yield sse(schemas.chat_chunk(cid, model, None, usage=ev.usage))
                    yield "data: [DONE]\n\n"
                else:
                    yield sse(error_body(ev.status, ev.message, None, ev.code))

        return stream_response(gen())

    # ------------------------------------------------------------ completions
    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        body = await read_json(request, schemas.CompletionRequest)
        prompt_input = body.prompt_input
        if isinstance(prompt_input, list):
            vocab = getattr(engine.tokenizer, "vocab_size", None)
            if vocab and any(t < 0 or t >= vocab for t in prompt_input):
                raise reject(400, "prompt token ids out of the vocabulary range", param="prompt")
        prompt = completion_tokens(engine.tokenizer, prompt_input)
        check_length(prompt)
        logprobs = body.logprobs is not None
        params = sampling(body, logprobs, body.logprobs or 0)
        events, rid = await start(prompt, params)
        cid = schemas.new_id("cmpl")
        model = settings.model_id

        if not body.stream:
            tokens, fin = await collect(request, events, rid)
            text = "".join(t.text for t in tokens)
            lp = schemas.completion_logprobs(tokens, token_text) if logprobs else None
            return JSONResponse(
                schemas.completion_body(cid, model, text, fin.reason, fin.usage, lp)
            )

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def gen() -> AsyncIterator[str]:
            pending: list[TokenEvent] = []
            offset = 0
            async for ev in stream_events(events, rid):
                if isinstance(ev, TokenEvent):
                    pending.append(ev)
                    if ev.text:
                        lp = (
                            schemas.completion_logprobs(pending, token_text, offset)
                            if logprobs
                            else None
                        )
                        yield sse(schemas.completion_body(cid, model, ev.text, None, None, lp))
                        offset += len(ev.text)
                        pending = []
                elif isinstance(ev, FinishEvent):
                    lp = (
                        schemas.completion_logprobs(pending, token_text, offset)
                        if logprobs
                        else None
                    )
                    usage = None if include_usage else ev.usage
                    yield sse(schemas.completion_body(cid, model, "", ev.reason, usage, lp))
                    if include_usage:
                        chunk = schemas.completion_body(cid, model, "", None, ev.usage, None)
                        chunk["choices"] = []
                        yield sse(chunk)
                    yield "data: [DONE]\n\n"
                else:
                    yield sse(error_body(ev.status, ev.message, None, ev.code))

        return stream_response(gen())

    app.include_router(v1)
    return app


def plan_health(plan: dict[str, Any]) -> dict[str, Any]:
    """The plan as /health shows it: layers by kind, bits, KV bytes per token."""
    kinds: dict[str, int] = {}
    for layer in plan.get("layers", []):
        kinds[layer["kind"]] = kinds.get(layer["kind"], 0) + 1
    if plan.get("shared_layers"):
        kinds["shared"] = plan["shared_layers"]
    kv = plan.get("kv_config", {})
    keys = ("summary", "kv_layers", "quantized_layers", "partial", "sinks", "bytes_per_token",
            "fp16_bytes_per_token", "max_window", "max_context")  # fmt: skip
    out = {k: plan.get(k) for k in keys}
    out["layers_by_kind"] = kinds
    out["bits"] = {
        "keys": kv.get("key_bits") if kv.get("key_bits") is not None else kv.get("bits"),
        "values": kv.get("value_bits") if kv.get("value_bits") is not None else kv.get("bits"),
        "windows": kv.get("window_bits"),  # bounded layers' width (None: as keys/values)
        "group_size": kv.get("group_size"),
        "rotation": kv.get("rotation"),
        "quantized_kv_start": kv.get("quantized_start"),
    }
    return out
