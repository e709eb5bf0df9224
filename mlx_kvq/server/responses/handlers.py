"""OpenAI's Responses API as functions: create, retrieve, delete.

No HTTP here: the body (`schemas.py`) and the stored conversation it
continues become a `ChatJob` (`translate.py`), run by the app's
`ChatService`; the reply is a response object or the Responses events
(`items.py`). While a long prompt is read, `response.in_progress` is sent
again after each prefill step (and after 15 s without output): Codex
restarts its request when its stream stays silent, and it does not count
SSE comments. `store: true` keeps the response (`store.py`) for
`previous_response_id` and `GET`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

from ..chat.answer import Failed, Finished, Part, Waiting
from ..chat.job import Refusal
from ..chat.service import ChatService
from ..errors import APIError
from ..replies import Reply
from . import schemas as S
from .items import EventWriter, Items, ItemStream, final_status, new_id, response_body, usage_body
from .store import AgentCounters
from .translate import to_job


def unknown(rid: str) -> APIError:
    return APIError(404, f"no stored response with id '{rid}'", param="response_id",
                    code="not_found")  # fmt: skip


async def create(
    service: ChatService, counters: AgentCounters, body: S.ResponsesRequest,
    client_gone: Callable[[], Awaitable[None]],
) -> Reply:  # fmt: skip
    store = counters.store
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id)
        if previous is None:
            raise service.reject(
                404, f"no stored response with id '{body.previous_response_id}'",
                param="previous_response_id", code="not_found",
            )  # fmt: skip
        history = [dict(m) for m in previous.messages]
    try:
        job, namespaces, conversation = await service.prompts.run(
            to_job, body, history, counters, service
        )
    except Refusal as e:
        raise service.reject(400, str(e), param=e.param) from None
    prompt = await service.render(job, param="input")
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type != "text":
        schema = fmt.schema_ if fmt.type == "json_schema" else None
        grammar = await service.grammar(schema, prompt, "text")
        job = replace(job, sampling=replace(job.sampling, grammar=grammar))
    answer = await service.start(job, prompt)
    rid, model = new_id("resp"), service.settings.model_id
    items = Items(namespaces, S.ENCRYPTED in (body.include or ()))
    want_store = body.store is not False  # OpenAI's default is to store

    def finish(fin: Finished) -> dict[str, Any]:
        status, reason = final_status(fin)
        usage = usage_body(fin, answer.reasoning_tokens)
        out = response_body(rid, body, model, want_store, status, items.items, usage, reason)
        if want_store:
            turn = items.conversation_turn()
            out["store"] = store.put(rid, out, [*conversation, turn])
        return out

    if not body.stream:
        parts, fin = await answer.collect(client_gone)
        items.build(parts)
        return finish(fin)

    async def events() -> AsyncIterator[str]:
        emit = EventWriter()
        start = response_body(rid, body, model, want_store)
        yield emit("response.created", response=start)
        yield emit("response.in_progress", response=start)
        stream = ItemStream(items, emit)
        async for ev in answer.events():
            if isinstance(ev, Part):
                for line in stream.feed(ev):
                    yield line
            elif isinstance(ev, Waiting):  # an event, so that clients' idle timers restart
                yield emit("response.in_progress", response=start)
            elif isinstance(ev, Finished):
                for line in stream.close():
                    yield line
                out = finish(ev)
                yield emit(f"response.{out['status']}", response=out)
            elif isinstance(ev, Failed):
                error = {"code": ev.code or "server_error", "message": ev.message}
                failed = response_body(rid, body, model, False, "failed", items.items,
                                       error=error)  # fmt: skip
                yield emit("response.failed", response=failed)

    return events()


def retrieve(counters: AgentCounters, response_id: str) -> dict[str, Any]:
    stored = counters.store.get(response_id)
    if stored is None:
        raise unknown(response_id)
    return stored.body


def delete(counters: AgentCounters, response_id: str) -> dict[str, Any]:
    if not counters.store.delete(response_id):
        raise unknown(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}
