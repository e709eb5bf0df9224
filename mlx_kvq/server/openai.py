"""OpenAI's endpoints: `/v1/models`, `/v1/chat/completions`, `/v1/completions`.

The two completion endpoints also answer without `/v1` (`/chat/completions`,
`/completions`), as mlx_lm.server's chat endpoint does. Requests are
size-checked, parsed (`body.py`), validated (`schemas.py`; every field's
treatment is in `fields.py`), turned into token ids and handed to the
engine as a `Generation`; the answer leaves as JSON or as server-sent events
in OpenAI's shapes, a chat answer split into content, reasoning and tool
calls as mlx_lm.server splits it (`chat_output.py`, `tools.py`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from mlx_kvq.engine import (
    Engine,
    FinishEvent,
    GenerationRequest,
    Outcome,
    PromptProgress,
    SamplingParams,
    TokenEvent,
)
from mlx_kvq.engine.processors import json_grammar
from mlx_kvq.engine.prompts import has_chat_template, template_variables

from . import schemas
from .body import BodyError, BodyNotRead, receive_body
from .chat_output import OutputSplitter
from .errors import APIError, error_body, validation_message
from .lifecycle import RETRY_AFTER_S
from .prompting import PromptTooLong, PromptWork
from .settings import ServerSettings
from .streams import IDLE, SSE_DONE, Generation, event_stream, keepalive, sse
from .tools import ToolChoiceError, tool_policy, tools_refusal
from .variants import DEFAULT_MODEL_ALIAS, VariantError, check_adapter, draft_tokens

log = logging.getLogger("mlx_kvq.server")

# OpenAI fields a chat template may read as variables (gpt-oss's reads reasoning_effort)
TEMPLATE_FIELDS = ("reasoning_effort", "verbosity")


def template_fields(body: Any, variables: frozenset[str]) -> tuple[dict[str, Any], str | None]:
    """The `TEMPLATE_FIELDS` set in `body` as template variables, and the first
    one set that the template (reading `variables`) does not read, or None."""
    fields = {n: getattr(body, n) for n in TEMPLATE_FIELDS if getattr(body, n) is not None}
    unread = next((n for n in fields if n not in variables), None)
    return fields, unread


def openai_router(
    engine: Engine, settings: ServerSettings, auth: Callable, prompts: PromptWork
) -> APIRouter:
    """The OpenAI routes; `auth` is the dependency that checks the API key, `prompts`
    the app's one `PromptWork` (its cap holds across every endpoint)."""
    router = APIRouter(dependencies=[Depends(auth)])
    token_text = schemas.TokenText(engine.tokenizer)
    splitter = OutputSplitter(engine.tokenizer)
    variables = template_variables(engine.tokenizer)
    templated = has_chat_template(engine.tokenizer)
    log.info(
        "chat answers: reasoning %s, tool calls %s",
        "separated" if splitter.thinking else "not marked by this tokenizer",
        "parsed" if splitter.tools else "not parsed (no parser for this model: tools get 400)",
    )

    def reject(status: int, message: str, **kw: Any) -> APIError:
        engine.metrics.count_request(Outcome.REJECTED)
        return APIError(status, message, **kw)

    async def read_body(request: Request, model_cls: type) -> Any:
        limit = settings.max_request_bytes
        lifecycle = request.app.state.lifecycle
        try:
            raw = await receive_body(
                request.receive, limit, settings.body_timeout, lambda: lifecycle.draining,
                request.headers.get("content-length"),
            )  # fmt: skip
            parsed = await prompts.parse(raw, model_cls)
        except BodyNotRead as e:
            retry = RETRY_AFTER_S if e.status == 503 else None
            raise reject(e.status, e.message, code=e.code, retry_after=retry, close=True) from None
        except BodyError as e:
            raise reject(400, e.message, param=e.param) from None
        except PromptTooLong as e:
            raise reject(400, e.message, param=e.param, code="context_length_exceeded") from None
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

    def sampling(body: Any, logprobs: bool, top: int, grammar: str | None = None) -> SamplingParams:
        def pick(value: Any, default: Any) -> Any:
            return default if value is None else value

        vocab = engine.vocab_size
        for token, _ in body.logit_bias_pairs:
            if token >= vocab:
                raise reject(
                    400,
                    f"logit_bias: token id {token} is outside the vocabulary (0..{vocab - 1})",
                    param="logit_bias",
                )
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
            repetition_penalty=pick(body.repetition_penalty, 0.0),
            repetition_context_size=pick(body.repetition_context_size, 20),
            presence_penalty=pick(body.presence_penalty, 0.0),
            presence_context_size=pick(body.presence_context_size, 20),
            frequency_penalty=pick(body.frequency_penalty, 0.0),
            frequency_context_size=pick(body.frequency_context_size, 20),
            logit_bias=body.logit_bias_pairs,
            xtc_probability=pick(body.xtc_probability, 0.0),
            xtc_threshold=pick(body.xtc_threshold, 0.1),
            grammar=grammar,
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

    def template_args(body: schemas.ChatCompletionRequest) -> dict[str, Any]:
        args = {**settings.chat_template_args, **(body.chat_template_kwargs or {})}
        fields, unread = template_fields(body, variables)
        if unread is not None:
            raise reject(
                400,
                f"{unread} cannot be honoured: this model's chat template does not read '{unread}'",
                param=unread,
            )
        args = {**fields, **args}
        if body.role_mapping is not None and templated:
            raise reject(
                400,
                "role_mapping applies only to models without a chat template; this one has one",
                param="role_mapping",
            )
        return args

    async def grammar_of(fmt: schemas.ResponseFormat | None, prompt: list[int]) -> str | None:
        """The llguidance grammar of `response_format` (None for text), or a 400."""
        if fmt is None or fmt.type == "text":
            return None
        if splitter.initial_state(prompt) != "normal":
            raise reject(
                400,
                "response_format cannot constrain an answer that starts inside the model's "
                'reasoning; turn thinking off (chat_template_kwargs: {"enable_thinking": false})',
                param="response_format",
            )
        schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
        try:
            grammar = json_grammar(schema if fmt.type == "json_schema" else None)
        except ValueError as e:
            raise reject(400, f"response_format: {e}", param="response_format") from None
        error = await run_in_threadpool(engine.grammars.check, grammar)
        if error:
            raise reject(400, f"response_format cannot be used: {error}", param="response_format")
        return grammar

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
            policy = tool_policy(body.tool_choice)
        except ToolChoiceError as e:
            raise reject(400, str(e), param="tool_choice") from None
        tools = body.template_tools if policy.render else None
        refusal = tools_refusal(splitter.tools, variables) if tools else None
        if refusal is not None:
            raise reject(400, f"tools cannot be honoured: {refusal}", param="tools")
        args = template_args(body)
        try:
            messages = await prompts.run(lambda: [m.as_template_dict() for m in body.messages])
            chat = await prompts.chat(messages, args, tools, body.role_mapping)
        except Exception as e:  # template errors are the request's fault
            raise reject(400, f"could not apply the chat template: {e}", param="messages") from e
        prompt = chat.tokens
        check_length(prompt)
        grammar = await grammar_of(body.response_format, prompt)
        want_logprobs = body.want_logprobs
        params = sampling(body, want_logprobs, max(body.top_logprobs or 0, 0), grammar)
        job = GenerationRequest(
            prompt, params, progress=body.stream, checkpoints=chat.checkpoints,
            draft_tokens=drafting(body),
        )  # fmt: skip
        generation = Generation(engine, job)
        await generation.start()
        cid, model = schemas.new_id("chatcmpl"), settings.model_id
        output = splitter.start(prompt, policy.parse, body.template_tools, body.stream)

        def logprobs(events: list[TokenEvent]) -> dict | None:
            return schemas.chat_logprobs(events, token_text) if want_logprobs else None

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
        prompt = await prompts.completion(prompt_input)
        check_length(prompt)
        want_logprobs = body.want_logprobs
        params = sampling(body, want_logprobs, body.top_count)
        job = GenerationRequest(prompt, params, progress=body.stream, draft_tokens=drafting(body))
        generation = Generation(engine, job)
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
