"""OpenAI's endpoints: `/v1/models`, `/v1/chat/completions`, `/v1/completions`.

The two completion endpoints also answer without `/v1` (`/chat/completions`,
`/completions`), as mlx_lm.server's chat endpoint does. Requests are
read (`request_body.py`), validated (`schemas.py`; every field's treatment
is in `fields.py`), a chat translated into `chat_job.ChatJob`
(`openai_chat.py`), rendered into token ids and handed to the engine
(`chat_job.ChatService`); the answer leaves as JSON or as server-sent
events in OpenAI's shapes, a chat answer split into content, reasoning and
tool calls as mlx_lm.server splits it (`chat_output.py`, `tools.py`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from mlx_kvq.engine import (
    FinishEvent,
    GenerationRequest,
    PromptProgress,
    TokenEvent,
)

from . import schemas
from .chat_job import ChatService, Refusal
from .errors import APIError, error_body
from .openai_chat import chat_job
from .request_body import read_model
from .streams import IDLE, SSE_DONE, event_stream, keepalive, sse
from .variants import DEFAULT_MODEL_ALIAS, VariantError, check_adapter, draft_tokens

log = logging.getLogger("mlx_kvq.server")


def openai_router(service: ChatService, auth: Callable) -> APIRouter:
    """The OpenAI routes; `auth` is the dependency that checks the API key."""
    router = APIRouter(dependencies=[Depends(auth)])
    engine, settings = service.engine, service.settings
    token_text = schemas.TokenText(engine.tokenizer)
    splitter = service.splitter
    log.info(
        "chat answers: reasoning %s, tool calls %s",
        "separated" if splitter.thinking else "not marked by this tokenizer",
        "parsed" if splitter.tools else "not parsed (no parser for this model: tools get 400)",
    )

    reject = service.reject

    async def read_body(request: Request, model_cls: type) -> Any:
        parsed = await read_model(request, model_cls, service, strict=True)
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

    async def models() -> dict[str, Any]:
        return schemas.models_body(settings.model_id, settings.created)

    async def model(model_id: str) -> dict[str, Any]:
        """One model, as OpenAI's `GET /v1/models/{model}` (the client's `models.retrieve`)."""
        if model_id not in (settings.model_id, DEFAULT_MODEL_ALIAS):
            raise APIError(
                404, f"the model '{model_id}' does not exist; this server serves "
                f"'{settings.model_id}'", param="model", code="model_not_found",
            )  # fmt: skip
        return schemas.models_body(settings.model_id, settings.created)["data"][0]

    async def chat_completions(request: Request) -> Response:
        body = await read_body(request, schemas.ChatCompletionRequest)
        try:
            job = await service.prompts.run(chat_job, body, service, drafting(body))
        except Refusal as e:
            raise reject(400, str(e), param=e.param) from None
        prompt = await service.render(job)
        fmt = body.response_format
        if fmt is not None and fmt.type != "text":
            schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
            grammar = await service.grammar(schema, prompt, "response_format")
            job = replace(job, sampling=replace(job.sampling, grammar=grammar))
        answer = await service.start(job, prompt)
        generation, output = answer.generation, answer.output
        cid, model = schemas.new_id("chatcmpl"), settings.model_id

        def logprobs(events: list[TokenEvent]) -> dict | None:
            return schemas.chat_logprobs(events, token_text) if job.sampling.logprobs else None

        if not body.stream:
            tokens, fin = await generation.collect(request)
            answer = output.feed("".join(t.text for t in tokens))
            rest, reason = output.finish(fin.reason.value)
            answer.add(rest)
            message = schemas.chat_message(answer.content, answer.reasoning, answer.tool_calls)
            return JSONResponse(
                schemas.chat_body(cid, model, message, reason, fin.usage, logprobs(tokens))
            )

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def chunks() -> AsyncIterator[str]:
            yield sse(schemas.chat_chunk(cid, model, {"role": "assistant", "content": ""}))
            pending: list[TokenEvent] = []
            async for ev in generation.events():
                if isinstance(ev, TokenEvent):
                    pending.append(ev)
                    delta = output.feed(ev.text)
                    if delta:
                        yield sse(schemas.chat_chunk(cid, model, delta.fields(), None,
                                                     logprobs(pending)))  # fmt: skip
                        pending = []
                elif isinstance(ev, PromptProgress) or ev is IDLE:
                    yield keepalive(ev)
                elif isinstance(ev, FinishEvent):
                    delta, reason = output.finish(ev.reason.value)
                    yield sse(schemas.chat_chunk(cid, model, delta.fields(), reason,
                                                 logprobs(pending)))  # fmt: skip
                    if include_usage:
                        yield sse(schemas.chat_chunk(cid, model, None, usage=ev.usage))
                    yield SSE_DONE
                else:
                    yield sse(error_body(ev.status, ev.message, None, ev.code))

        return event_stream(chunks())

    async def completions(request: Request) -> Response:
        body = await read_body(request, schemas.CompletionRequest)
        prompt_input = body.prompt_input
        if isinstance(prompt_input, list):
            vocab = getattr(engine.tokenizer, "vocab_size", None)
            if vocab and any(t < 0 or t >= vocab for t in prompt_input):
                raise reject(400, "prompt token ids out of the vocabulary range", param="prompt")
        prompt = await service.prompts.completion(prompt_input)
        service.check_length(prompt, "prompt")
        want_logprobs = body.want_logprobs
        try:
            params = body.to_sampling_params(settings.sampling)
        except Refusal as e:
            raise reject(400, str(e), param=e.param) from None
        job = GenerationRequest(prompt, params, progress=body.stream, draft_tokens=drafting(body))
        generation = await service.submit(job)
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
                elif isinstance(ev, PromptProgress) or ev is IDLE:
                    yield keepalive(ev)
                elif isinstance(ev, FinishEvent):
                    lp = logprobs(pending, offset)
                    yield sse(schemas.completion_body(cid, model, "", ev.reason, None, lp))
                    if include_usage:
                        chunk = schemas.completion_body(cid, model, "", None, ev.usage, None)
                        chunk["choices"] = []
                        yield sse(chunk)
                    yield SSE_DONE
                else:
                    yield sse(error_body(ev.status, ev.message, None, ev.code))

        return event_stream(chunks())

    router.add_api_route("/v1/models", models, methods=["GET"])
    router.add_api_route("/v1/models/{model_id:path}", model, methods=["GET"])
    for prefix in ("/v1", ""):  # mlx_lm.server answers /chat/completions without /v1 too
        router.add_api_route(f"{prefix}/chat/completions", chat_completions, methods=["POST"])
        router.add_api_route(f"{prefix}/completions", completions, methods=["POST"])
    return router
