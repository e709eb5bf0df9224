"""OpenAI's endpoints: `/v1/models`, `/v1/chat/completions`, `/v1/completions`.

Requests are size-checked, parsed (`body.py`), validated (`schemas.py`),
turned into token ids and handed to the engine as a `Generation`; the
answer leaves as JSON or as server-sent events in OpenAI's shapes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from mlx_kvq.engine import (
    Engine,
    FinishEvent,
    GenerationRequest,
    Outcome,
    SamplingParams,
    TokenEvent,
)
from mlx_kvq.engine.prompts import chat_tokens, completion_tokens
from mlx_kvq.engine.segments import chat_checkpoints

from . import schemas
from .body import BodyError, parse_body
from .errors import APIError, error_body, validation_message
from .settings import ServerSettings
from .streams import SSE_DONE, Generation, event_stream, sse
from .variants import VariantError, check_adapter, draft_tokens

DEFAULT_MODEL_ALIAS = "default_model"  # what clients written for mlx_lm.server send


def openai_router(engine: Engine, settings: ServerSettings, auth: Callable) -> APIRouter:
    """The `/v1` routes; `auth` is the dependency that checks the API key."""
    from fastapi import Depends

    router = APIRouter(prefix="/v1", dependencies=[Depends(auth)])
    token_text = schemas.TokenText(engine.tokenizer)

    def reject(status: int, message: str, **kw: Any) -> APIError:
        engine.metrics.count_request(Outcome.REJECTED)
        return APIError(status, message, **kw)

    async def read_body(request: Request, model_cls: type) -> Any:
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
            data = parse_body(b"".join(body))
        except BodyError as e:
            raise reject(400, e.message, param=e.param) from None
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
        try:
            check_adapter(parsed, settings)
        except VariantError as e:
            raise reject(400, e.message, param=e.param) from None
        return parsed

    def drafting(body: Any) -> int:
        """Tokens drafted per step for this request (0: no speculative decoding)."""
        try:
            return draft_tokens(body, settings)
        except VariantError as e:
            raise reject(400, e.message, param=e.param) from None

    def sampling(body: Any, logprobs: bool, top: int) -> SamplingParams:
        def pick(value: Any, default: Any) -> Any:
            return default if value is None else value

        return SamplingParams(
            max_tokens=pick(body.token_limit, settings.max_tokens),
            temperature=pick(body.temperature, settings.temperature),
            top_p=pick(body.top_p, settings.top_p),
            top_k=pick(body.top_k, settings.top_k),
            min_p=pick(body.min_p, settings.min_p),
            seed=body.sampling_seed,
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

    @router.get("/models")
    async def models() -> dict[str, Any]:
        return schemas.models_body(settings.model_id, settings.created)

    @router.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await read_body(request, schemas.ChatCompletionRequest)
        template_args = {**settings.chat_template_args, **(body.chat_template_kwargs or {})}
        messages = [m.as_template_dict() for m in body.messages]
        try:
            prompt = chat_tokens(engine.tokenizer, messages, template_args, body.tools)
        except Exception as e:  # template errors are the request's fault
            raise reject(400, f"could not apply the chat template: {e}", param="messages") from e
        check_length(prompt)
        params = sampling(body, body.logprobs, body.top_logprobs or 0)
        checkpoints = chat_checkpoints(
            engine.tokenizer, messages, prompt, template_args, body.tools
        )
        request = GenerationRequest(
            prompt, params, checkpoints=checkpoints, draft_tokens=drafting(body)
        )
        generation = Generation(engine, request)
        await generation.start()
        cid, model = schemas.new_id("chatcmpl"), settings.model_id

        def logprobs(events: list[TokenEvent]) -> dict | None:
            return schemas.chat_logprobs(events, token_text) if body.logprobs else None

        if not body.stream:
            tokens, fin = await generation.collect(request)
            text = "".join(t.text for t in tokens)
            return JSONResponse(
                schemas.chat_body(cid, model, text, fin.reason, fin.usage, logprobs(tokens))
            )

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def chunks() -> AsyncIterator[str]:
            yield sse(schemas.chat_chunk(cid, model, {"role": "assistant", "content": ""}))
            pending: list[TokenEvent] = []
            async for ev in generation.events():
                if isinstance(ev, TokenEvent):
                    pending.append(ev)
                    if ev.text:
                        yield sse(
                            schemas.chat_chunk(
                                cid, model, {"content": ev.text}, None, logprobs(pending)
                            )
                        )
                        pending = []
                elif isinstance(ev, FinishEvent):
                    usage = None if include_usage else ev.usage
                    yield sse(
                        schemas.chat_chunk(cid, model, {}, ev.reason, logprobs(pending), usage)
                    )
                    if include_usage:
                        yield sse(schemas.chat_chunk(cid, model, None, usage=ev.usage))
                    yield SSE_DONE
                else:
                    yield sse(error_body(ev.status, ev.message, None, ev.code))

        return event_stream(chunks())

    @router.post("/completions")
    async def completions(request: Request) -> Response:
        body = await read_body(request, schemas.CompletionRequest)
        prompt_input = body.prompt_input
        if isinstance(prompt_input, list):
            vocab = getattr(engine.tokenizer, "vocab_size", None)
            if vocab and any(t < 0 or t >= vocab for t in prompt_input):
                raise reject(400, "prompt token ids out of the vocabulary range", param="prompt")
        prompt = completion_tokens(engine.tokenizer, prompt_input)
        check_length(prompt)
        want_logprobs = body.logprobs is not None
        params = sampling(body, want_logprobs, body.logprobs or 0)
        generation = Generation(
            engine, GenerationRequest(prompt, params, draft_tokens=drafting(body))
        )
        await generation.start()
        cid, model = schemas.new_id("cmpl"), settings.model_id

        def logprobs(events: list[TokenEvent], offset: int = 0) -> dict | None:
            return (
                schemas.completion_logprobs(events, token_text, offset) if want_logprobs else None
            )

        if not body.stream:
            tokens, fin = await generation.collect(request)
            text = "".join(t.text for t in tokens)
            return JSONResponse(
                schemas.completion_body(cid, model, text, fin.reason, fin.usage, logprobs(tokens))
            )

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def chunks() -> AsyncIterator[str]:
            pending: list[TokenEvent] = []
            offset = 0
            async for ev in generation.events():
                if isinstance(ev, TokenEvent):
                    pending.append(ev)
                    if ev.text:
                        lp = logprobs(pending, offset)
                        yield sse(schemas.completion_body(cid, model, ev.text, None, None, lp))
                        offset += len(ev.text)
                        pending = []
                elif isinstance(ev, FinishEvent):
                    usage = None if include_usage else ev.usage
                    lp = logprobs(pending, offset)
                    yield sse(schemas.completion_body(cid, model, "", ev.reason, usage, lp))
                    if include_usage:
                        chunk = schemas.completion_body(cid, model, "", None, ev.usage, None)
                        chunk["choices"] = []
                        yield sse(chunk)
                    yield SSE_DONE
                else:
                    yield sse(error_body(ev.status, ev.message, None, ev.code))

        return event_stream(chunks())

    return router
