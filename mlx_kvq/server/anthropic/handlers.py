"""Anthropic's Messages and token counting as functions of a validated body.

No HTTP here: the body (`schemas.py`) is translated into a `ChatJob`
(`translate.py`), rendered and run by the app's `ChatService`; the reply is
a message body or Anthropic's server-sent events (`bodies.py`). Errors leave
in Anthropic's shape (`errors.anthropic_error_body`).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from ..chat.answer import Failed, Finished, Part, Waiting
from ..chat.job import ChatJob, Refusal
from ..chat.prompting import ChatPrompt
from ..chat.service import ChatService
from ..errors import anthropic_error_body
from ..replies import Reply
from . import schemas as S
from .bodies import STOP_REASONS, BlockStream, message_body, sse, usage_body
from .translate import to_job


async def prepare(service: ChatService, body: S.CountTokensRequest) -> tuple[ChatJob, ChatPrompt]:
    """The job of a body and its rendered prompt; a 400 names what cannot be honoured."""
    try:
        job = await service.prompts.run(to_job, body, service)
    except Refusal as e:
        raise service.reject(400, str(e), param=e.param) from None
    return job, await service.render(job)


async def count_tokens(service: ChatService, body: S.CountTokensRequest) -> dict[str, Any]:
    _, prompt = await prepare(service, body)
    return {"input_tokens": len(prompt.tokens)}


async def messages(
    service: ChatService, body: S.MessagesRequest, client_gone: Callable[[], Awaitable[None]]
) -> Reply:
    job, prompt = await prepare(service, body)
    show = body.thinking is None or body.thinking.display != "omitted"
    answer = await service.start(job, prompt)
    mid, model = f"msg_{uuid.uuid4().hex[:24]}", service.settings.model_id
    if not body.stream:
        parts, fin = await answer.collect(client_gone)
        return message_body(mid, model, parts, fin, show)

    async def events() -> AsyncIterator[str]:
        start = {"id": mid, "type": "message", "role": "assistant", "model": model,
                 "content": [], "stop_reason": None, "stop_sequence": None,
                 "usage": {"input_tokens": len(prompt.tokens), "cache_creation_input_tokens": 0,
                           "cache_read_input_tokens": 0, "output_tokens": 0}}  # fmt: skip
        yield sse("message_start", {"type": "message_start", "message": start})
        blocks = BlockStream(show)
        async for ev in answer.events():
            if isinstance(ev, Part):
                for line in blocks.feed(ev):
                    yield line
            elif isinstance(ev, Waiting):
                yield sse("ping", {"type": "ping"})
            elif isinstance(ev, Finished):
                for line in blocks.close():
                    yield line
                delta = {"stop_reason": STOP_REASONS[ev.reason],
                         "stop_sequence": ev.stop_sequence}  # fmt: skip
                yield sse("message_delta", {"type": "message_delta", "delta": delta,
                                            "usage": usage_body(ev.usage)})  # fmt: skip
                yield sse("message_stop", {"type": "message_stop"})
            elif isinstance(ev, Failed):
                yield sse("error", anthropic_error_body(ev.status, ev.message, ev.code)[1])

    return events()
