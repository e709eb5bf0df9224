"""OpenAI's chat completions and completions as functions of a validated body.

No HTTP here: each handler takes the app's `ChatService`, the parsed body
(`schemas.py`), the tokens to draft per step and what returns once the
client leaves, and returns a `Reply` (a JSON body, or server-sent event
lines) in OpenAI's shapes (`bodies.py`). A chat is translated into a
`ChatJob` (`translate.py`), rendered and handed to the engine
(`chat.service.ChatService`); its answer is split into content, reasoning
and tool calls as mlx_lm.server splits it (`chat/output.py`,
`chat/tools.py`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

from mlx_kvq.engine import FinishEvent, GenerationRequest, PromptProgress, TokenEvent
from mlx_kvq.residency import ModelView

from ..chat.generation import IDLE
from ..chat.job import Refusal
from ..chat.service import ChatService
from ..errors import error_body
from ..replies import Reply
from ..settings import ServerSettings
from . import bodies, schemas
from .translate import chat_job

ClientGone = Callable[[], Awaitable[None]]


def models(settings: ServerSettings, views: list[ModelView]) -> dict[str, Any]:
    """`GET /v1/models`: every model this server knows, the default first,
    with where it is (`status`: loaded or not) and its aliases."""
    return bodies.models_body([model_object(v) for v in views], settings.created)


def model(settings: ServerSettings, view: ModelView) -> dict[str, Any]:
    """One model, as OpenAI's `GET /v1/models/{model}` (the client's `models.retrieve`)."""
    return bodies.models_body([model_object(view)], settings.created)["data"][0]


def model_object(view: ModelView) -> dict[str, Any]:
    """What `/v1/models` says of one model besides OpenAI's fields."""
    return {"id": view.name, "status": view.state.value, "aliases": list(view.aliases)}


async def chat_completion(
    service: ChatService, body: schemas.ChatCompletionRequest, drafts: int, client_gone: ClientGone
) -> Reply:
    try:
        job = await service.prompts.run(chat_job, body, service, drafts)
    except Refusal as e:
        raise service.reject(400, str(e), param=e.param) from None
    prompt = await service.render(job)
    fmt = body.response_format
    if fmt is not None and fmt.type != "text":
        schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
        grammar = await service.grammar(schema, prompt, "response_format")
        job = replace(job, sampling=replace(job.sampling, grammar=grammar))
    answer = await service.start(job, prompt)
    generation, output = answer.generation, answer.output
    cid, model_id = bodies.new_id("chatcmpl"), service.settings.model_id
    token_text = bodies.TokenText(service.tokenizer)

    def logprobs(events: list[TokenEvent]) -> dict | None:
        return bodies.chat_logprobs(events, token_text) if job.sampling.logprobs else None

    if not body.stream:
        tokens, fin = await generation.collect(client_gone)
        delta = output.feed("".join(t.text for t in tokens))
        rest, reason = output.finish(fin.reason.value)
        delta.add(rest)
        message = bodies.chat_message(delta.content, delta.reasoning, delta.tool_calls)
        return bodies.chat_body(cid, model_id, message, reason, fin.usage, logprobs(tokens))

    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def chunks() -> AsyncIterator[str]:
        yield bodies.sse(bodies.chat_chunk(cid, model_id, {"role": "assistant", "content": ""}))
        pending: list[TokenEvent] = []
        async for ev in generation.events():
            if isinstance(ev, TokenEvent):
                pending.append(ev)
                delta = output.feed(ev.text)
                if delta:
                    yield bodies.sse(bodies.chat_chunk(cid, model_id, delta.fields(), None,
                                                       logprobs(pending)))  # fmt: skip
                    pending = []
            elif isinstance(ev, PromptProgress) or ev is IDLE:
                yield bodies.keepalive(ev)
            elif isinstance(ev, FinishEvent):
                delta, reason = output.finish(ev.reason.value)
                yield bodies.sse(bodies.chat_chunk(cid, model_id, delta.fields(), reason,
                                                   logprobs(pending)))  # fmt: skip
                if include_usage:
                    yield bodies.sse(bodies.chat_chunk(cid, model_id, None, usage=ev.usage))
                yield bodies.SSE_DONE
            else:
                yield bodies.sse(error_body(ev.status, ev.message, None, ev.code))

    return chunks()


async def completion(
    service: ChatService, body: schemas.CompletionRequest, drafts: int, client_gone: ClientGone
) -> Reply:
    prompt_input = body.prompt_input
    if isinstance(prompt_input, list):
        vocab = getattr(service.tokenizer, "vocab_size", None)
        if vocab and any(t < 0 or t >= vocab for t in prompt_input):
            raise service.reject(
                400, "prompt token ids out of the vocabulary range", param="prompt"
            )
    prompt = await service.prompts.completion(prompt_input)
    service.check_length(prompt, "prompt")
    want_logprobs = body.want_logprobs
    try:
        params = body.to_sampling_params(service.settings.sampling)
    except Refusal as e:
        raise service.reject(400, str(e), param=e.param) from None
    request = GenerationRequest(prompt, params, progress=body.stream, draft_tokens=drafts)
    generation = await service.submit(request)
    cid, model_id = bodies.new_id("cmpl"), service.settings.model_id
    token_text = bodies.TokenText(service.tokenizer)

    def logprobs(events: list[TokenEvent], offset: int = 0) -> dict | None:
        return bodies.completion_logprobs(events, token_text, offset) if want_logprobs else None

    if not body.stream:
        tokens, fin = await generation.collect(client_gone)
        text = "".join(t.text for t in tokens)
        return bodies.completion_body(cid, model_id, text, fin.reason, fin.usage, logprobs(tokens))

    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def chunks() -> AsyncIterator[str]:
        pending: list[TokenEvent] = []
        offset = 0
        async for ev in generation.events():
            if isinstance(ev, TokenEvent):
                pending.append(ev)
                if ev.text:
                    lp = logprobs(pending, offset)
                    yield bodies.sse(bodies.completion_body(cid, model_id, ev.text, None, None, lp))
                    offset += len(ev.text)
                    pending = []
            elif isinstance(ev, PromptProgress) or ev is IDLE:
                yield bodies.keepalive(ev)
            elif isinstance(ev, FinishEvent):
                lp = logprobs(pending, offset)
                yield bodies.sse(bodies.completion_body(cid, model_id, "", ev.reason, None, lp))
                if include_usage:
                    chunk = bodies.completion_body(cid, model_id, "", None, ev.usage, None)
                    chunk["choices"] = []
                    yield bodies.sse(chunk)
                yield bodies.SSE_DONE
            else:
                yield bodies.sse(error_body(ev.status, ev.message, None, ev.code))

    return chunks()
