"""OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

What Codex, the OpenAI Agents SDK and the `openai` SDK send is translated
into a `ChatJob` (`chat_job.py`): `instructions` and `input` items
(messages of any role, `function_call`, `function_call_output`,
`reasoning`) become the chat template's messages, function and namespace
tools its functions. Hosted tools (`web_search`, `file_search`, ...) cannot
run here: they are left out of the prompt, logged once per type and counted
in `/metrics` (a 400 would make Codex unusable).

The answer comes back as output items in the order the model wrote them:
`reasoning` (the model's reasoning as its summary text; with `include:
["reasoning.encrypted_content"]` also an opaque value this server reads
back), `message` with `output_text`, and `function_call` items, or as the
Responses events, each with its `sequence_number`. While a long prompt is
read, `response.in_progress` is sent again after each prefill step (and
after 15 s without output): Codex restarts its request when its stream
stays silent, and it does not count SSE comments. `store: true` keeps the
response (`response_store.py`) for `previous_response_id` and `GET`.
Every field's treatment is in `responses_schemas.RESPONSES_FIELDS`.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from . import responses_schemas as S
from .chat_job import (
    ChatJob,
    ChatService,
    Failed,
    Finished,
    Part,
    PartKind,
    Refusal,
    StopReason,
    Waiting,
)
from .errors import APIError
from .request_body import read_model
from .response_store import AgentCounters
from .streams import event_stream

log = logging.getLogger("mlx_kvq.server")

OPAQUE_PREFIX = "mlx-kvq:"  # encrypted_content this server wrote (base64 JSON of the reasoning)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


# -------------------------------------------------------------- request -> job
def opaque(reasoning: str) -> str:
    """The `encrypted_content` of a reasoning item: opaque to the client, read back here."""
    raw = json.dumps({"reasoning": reasoning}).encode()
    return OPAQUE_PREFIX + base64.b64encode(raw).decode()


def reasoning_of(item: S.ReasoningItem) -> str:
    """A reasoning item's text: this server's opaque value, else its content or summary."""
    value = item.encrypted_content or ""
    if value.startswith(OPAQUE_PREFIX):
        try:
            return json.loads(base64.b64decode(value[len(OPAQUE_PREFIX) :]))["reasoning"]
        except (binascii.Error, ValueError, KeyError, TypeError):
            pass
    parts = item.content or item.summary
    return "\n".join(p.text for p in parts)


def input_messages(body: S.ResponsesRequest) -> list[dict[str, Any]]:
    """`input` as chat-template messages (instructions excluded)."""
    if body.input is None:
        return []
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    out: list[dict[str, Any]] = []
    reasoning: list[str] = []  # reasoning items wait for the assistant turn they precede

    def assistant() -> dict[str, Any]:
        if not out or out[-1]["role"] != "assistant" or out[-1].get("closed"):
            out.append({"role": "assistant", "content": ""})
        turn = out[-1]
        if reasoning:
            turn["reasoning"] = "\n".join([turn.get("reasoning", ""), *reasoning]).strip("\n")
            reasoning.clear()
        return turn

    for item in body.input:
        if isinstance(item, S.ReasoningItem):
            reasoning.append(reasoning_of(item))
        elif isinstance(item, S.FunctionCallItem):
            try:
                arguments = json.loads(item.arguments or "{}")
            except json.JSONDecodeError:
                raise Refusal(
                    f"function_call {item.call_id}: arguments are not JSON", "input"
                ) from None
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": arguments}}  # fmt: skip
            assistant().setdefault("tool_calls", []).append(call)
        elif isinstance(item, S.FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id,
                        "content": S.part_text(item.output)})  # fmt: skip
        elif item.role == "assistant":
            turn = assistant()
            if turn.get("tool_calls"):  # text after a call starts a new turn
                turn = {"role": "assistant", "content": ""}
                out.append(turn)
            turn["content"] += S.part_text(item.content)
        else:
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": S.part_text(item.content)})
    return out


def leading_system(instructions: str | None, messages: list[dict[str, Any]]) -> list[dict]:
    """`instructions` and the system/developer messages that open the input, as one
    first system turn (templates render a system prompt only first)."""
    texts = [instructions] if instructions else []
    i = 0
    while i < len(messages) and messages[i]["role"] == "system":
        texts.append(messages[i]["content"])
        i += 1
    head = [{"role": "system", "content": "\n\n".join(texts)}] if texts else []
    return head + messages[i:]


def template_tools(
    tools: list[Any] | None, counters: AgentCounters
) -> tuple[list[dict[str, Any]] | None, dict[str, str]]:
    """Function tools in the template's shape, and the namespace of each member function."""
    out, namespaces = [], {}
    for tool in tools or ():
        if isinstance(tool, S.HostedTool):
            if not counters.hosted_tools[tool.type]:
                log.info("hosted tool %r left out of the prompt: this server cannot run it",
                         tool.type)  # fmt: skip
            counters.hosted_tools[tool.type] += 1
            continue
        members = tool.tools if isinstance(tool, S.NamespaceTool) else [tool]
        for fn in members:
            spec: dict[str, Any] = {"name": fn.name,
                                    "parameters": fn.parameters or {"type": "object"}}  # fmt: skip
            description = fn.description
            if isinstance(tool, S.NamespaceTool):
                namespaces[fn.name] = tool.name
                description = " ".join(x for x in (tool.description, description) if x)
            if description:
                spec["description"] = description
            out.append({"type": "function", "function": spec})
    return out or None, namespaces


def parse_policy(body: S.ResponsesRequest) -> bool:
    choice = body.tool_choice
    if body.parallel_tool_calls is False:
        raise Refusal("parallel_tool_calls: false cannot be enforced by this server",
                      "parallel_tool_calls")  # fmt: skip
    if choice is None or choice == "auto":
        return True
    if choice == "none":
        return False
    raise Refusal(
        f"tool_choice {json.dumps(choice)[:80]} cannot be enforced by this server (it does "
        "not constrain decoding to a tool call); use 'auto' or 'none'",
        "tool_choice",
    )


def template_args(body: S.ResponsesRequest, service: ChatService) -> dict[str, Any]:
    args: dict[str, Any] = {}
    effort = body.reasoning.effort if body.reasoning else None
    if effort is not None and service.reads("reasoning_effort"):
        args["reasoning_effort"] = effort
    verbosity = body.text.verbosity if body.text else None
    if verbosity is not None and service.reads("verbosity"):
        args["verbosity"] = verbosity
    return args


def to_job(
    body: S.ResponsesRequest, history: list[dict[str, Any]], counters: AgentCounters,
    service: ChatService,
) -> tuple[ChatJob, dict[str, str], list[dict[str, Any]]]:  # fmt: skip
    """The job, the namespaces of member functions, and the conversation to store."""
    parse = parse_policy(body)
    tools, namespaces = template_tools(body.tools, counters)
    conversation = history + input_messages(body)
    if not conversation:
        raise Refusal("input is empty and there is no previous response to continue", "input")
    job = ChatJob(
        messages=leading_system(body.instructions, conversation),
        sampling=body.to_sampling_params(service.settings.sampling),
        tools=tools if parse else None,
        parse_tools=parse,
        template_args=template_args(body, service),
        stream=body.stream,
    )
    return job, namespaces, conversation


# -------------------------------------------------------------- answer -> items
class Items:
    """The output items of one response, built from its parts."""

    def __init__(self, namespaces: dict[str, str], encrypted: bool):
        self.namespaces = namespaces
        self.encrypted = encrypted
        self.items: list[dict[str, Any]] = []

    def new(self, part: Part) -> dict[str, Any]:
        """The item a part opens (in progress, empty)."""
        if part.kind == PartKind.REASONING:
            item = {"type": "reasoning", "id": new_id("rs"), "summary": []}
        elif part.kind == PartKind.TEXT:
            item = {"type": "message", "id": new_id("msg"), "status": "in_progress",
                    "role": "assistant", "content": []}  # fmt: skip
        else:
            call = part.call
            item = {"type": "function_call", "id": new_id("fc"), "call_id": call.id,
                    "name": call.name, "arguments": "", "status": "in_progress"}  # fmt: skip
            if call.name in self.namespaces:
                item["namespace"] = self.namespaces[call.name]
        self.items.append(item)
        return item

    def done(self, item: dict[str, Any], text: str) -> dict[str, Any]:
        """The item complete with its `text` (reasoning, answer, or call arguments)."""
        if item["type"] == "reasoning":
            item["summary"] = [{"type": "summary_text", "text": text}]
            if self.encrypted:
                item["encrypted_content"] = opaque(text)
        elif item["type"] == "message":
            item["status"] = "completed"
            item["content"] = [output_text(text)]
        else:
            item["status"] = "completed"
            item["arguments"] = text
        return item

    def build(self, parts: list[Part]) -> list[dict[str, Any]]:
        for part in parts:
            text = part.call.arguments if part.call else part.text
            self.done(self.new(part), text)
        return self.items

    def conversation_turn(self) -> dict[str, Any]:
        """The answer as an assistant turn of the chat template."""
        turn: dict[str, Any] = {"role": "assistant", "content": ""}
        for item in self.items:
            if item["type"] == "reasoning":
                turn["reasoning"] = item["summary"][0]["text"] if item["summary"] else ""
            elif item["type"] == "message":
                turn["content"] += item["content"][0]["text"] if item["content"] else ""
            else:
                try:
                    arguments = json.loads(item["arguments"] or "{}")
                except json.JSONDecodeError:
                    arguments = {}
                turn.setdefault("tool_calls", []).append(
                    {"id": item["call_id"], "type": "function",
                     "function": {"name": item["name"], "arguments": arguments}})  # fmt: skip
        return turn


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def usage_body(fin: Finished, reasoning_tokens: int) -> dict[str, Any]:
    u = fin.usage
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": u.total_tokens,
    }


def response_body(
    rid: str, body: S.ResponsesRequest, model: str, stored: bool, status: str = "in_progress",
    output: list | None = None, usage: dict | None = None, incomplete: str | None = None,
    error: dict | None = None,
) -> dict[str, Any]:  # fmt: skip
    reasoning = body.reasoning.model_dump() if body.reasoning else {"effort": None, "summary": None}
    text = body.text.model_dump(by_alias=True, exclude_none=True) if body.text else {}
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "error": error,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": model,
        "output": output or [],
        "parallel_tool_calls": True,
        "previous_response_id": body.previous_response_id,
        "reasoning": reasoning,
        "store": stored,
        "temperature": body.temperature,
        "text": text or {"format": {"type": "text"}},
        "tool_choice": body.tool_choice or "auto",
        "tools": [t.model_dump(by_alias=True, exclude_none=True) for t in body.tools or ()],
        "top_p": body.top_p,
        "truncation": body.truncation or "disabled",
        "usage": usage,
        "metadata": body.metadata or {},
    }


def final_status(fin: Finished) -> tuple[str, str | None]:
    if fin.reason == StopReason.LENGTH:
        return "incomplete", "max_output_tokens"
    return "completed", None


class EventWriter:
    """The Responses stream's events, numbered."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **data: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"


class ItemStream:
    """Output-item events for a stream of parts."""

    def __init__(self, items: Items, emit: EventWriter):
        self.items = items
        self.emit = emit
        self.item: dict[str, Any] | None = None
        self.kind: PartKind | None = None
        self.text = ""

    @property
    def index(self) -> int:
        return len(self.items.items) - 1

    def feed(self, part: Part) -> list[str]:
        out: list[str] = []
        if part.kind != self.kind or part.kind == PartKind.TOOL_CALL:
            out += self.close()
            self.item, self.kind, self.text = self.items.new(part), part.kind, ""
            out.append(self.emit("response.output_item.added", output_index=self.index,
                                 item=self.item))  # fmt: skip
            where = {"item_id": self.item["id"], "output_index": self.index}
            if part.kind == PartKind.REASONING:
                out.append(self.emit("response.reasoning_summary_part.added", **where,
                                     summary_index=0,
                                     part={"type": "summary_text", "text": ""}))  # fmt: skip
            elif part.kind == PartKind.TEXT:
                out.append(self.emit("response.content_part.added", **where, content_index=0,
                                     part=output_text("")))  # fmt: skip
        where = {"item_id": self.item["id"], "output_index": self.index}
        if part.kind == PartKind.REASONING:
            self.text += part.text
            out.append(self.emit("response.reasoning_summary_text.delta", **where,
                                 summary_index=0, delta=part.text))  # fmt: skip
        elif part.kind == PartKind.TEXT:
            self.text += part.text
            out.append(self.emit("response.output_text.delta", **where, content_index=0,
                                 delta=part.text, logprobs=[]))  # fmt: skip
        else:
            self.text = part.call.arguments
            out.append(self.emit("response.function_call_arguments.delta", **where,
                                 delta=self.text))  # fmt: skip
        return out

    def close(self) -> list[str]:
        if self.item is None:
            return []
        out = []
        item, text = self.item, self.text
        where = {"item_id": item["id"], "output_index": self.index}
        if self.kind == PartKind.REASONING:
            out.append(self.emit("response.reasoning_summary_text.done", **where,
                                 summary_index=0, text=text))  # fmt: skip
            out.append(self.emit("response.reasoning_summary_part.done", **where,
                                 summary_index=0,
                                 part={"type": "summary_text", "text": text}))  # fmt: skip
        elif self.kind == PartKind.TEXT:
            out.append(self.emit("response.output_text.done", **where, content_index=0,
                                 text=text, logprobs=[]))  # fmt: skip
            out.append(self.emit("response.content_part.done", **where, content_index=0,
                                 part=output_text(text)))  # fmt: skip
        else:
            out.append(self.emit("response.function_call_arguments.done", **where,
                                 name=item["name"], arguments=text))  # fmt: skip
        self.items.done(item, text)
        out.append(self.emit("response.output_item.done", output_index=self.index, item=item))
        self.item, self.kind = None, None
        return out


# -------------------------------------------------------------- routes
def responses_router(service: ChatService, auth: Callable, counters: AgentCounters) -> APIRouter:
    """The Responses routes; `auth` is the dependency that checks the API key."""
    router = APIRouter(dependencies=[Depends(auth)])
    settings = service.settings
    store = counters.store

    def unknown(rid: str) -> APIError:
        return APIError(404, f"no stored response with id '{rid}'", param="response_id",
                        code="not_found")  # fmt: skip

    async def create(request: Request) -> Response:
        body = await read_model(request, S.ResponsesRequest, service)
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
        rid, model = new_id("resp"), settings.model_id
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
            parts, fin = await answer.collect(request)
            items.build(parts)
            return JSONResponse(finish(fin))

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

        return event_stream(events())

    async def retrieve(response_id: str) -> dict[str, Any]:
        stored = store.get(response_id)
        if stored is None:
            raise unknown(response_id)
        return stored.body

    async def delete(response_id: str) -> dict[str, Any]:
        if not store.delete(response_id):
            raise unknown(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    router.add_api_route("/v1/responses", create, methods=["POST"])
    router.add_api_route("/v1/responses/{response_id}", retrieve, methods=["GET"])
    router.add_api_route("/v1/responses/{response_id}", delete, methods=["DELETE"])
    return router
