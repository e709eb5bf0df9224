"""Anthropic's Messages API: `POST /v1/messages` and `/v1/messages/count_tokens`.

What Claude Code and the `anthropic` SDK send (Claude Code adds
`?beta=true`, which changes nothing here) is translated into a `ChatJob`
(`chat_job.py`): the system prompt and `system`-role messages, text,
`tool_use`, `tool_result` and `thinking` blocks become the chat template's
messages (assistant `tool_calls`, `role: "tool"` results, `reasoning`), and
`tools` its functions. Claude Code's first system block,
`x-anthropic-billing-header: ...; cch=<nonce>`, is dropped before rendering:
it would sit before everything else and change on every request, defeating
the prompt cache's prefix reuse.

The answer comes back as content blocks in the order the model wrote them
(`thinking`, `text`, `tool_use` with its parsed `input`), with Anthropic's
`stop_reason` and `usage` (`input_tokens` without the prompt tokens read
from the prompt cache, which are `cache_read_input_tokens`), or as
Anthropic's server-sent events. Every field's treatment is in
`anthropic_schemas.MESSAGES_FIELDS`; errors leave in Anthropic's shape
(`errors.anthropic_error_body`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from . import anthropic_schemas as S
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
from .errors import anthropic_error_body
from .prompting import ChatPrompt
from .request_body import read_model
from .streams import event_stream

STOP_REASONS = {
    StopReason.END: "end_turn",
    StopReason.TOOL_USE: "tool_use",
    StopReason.LENGTH: "max_tokens",
    StopReason.STOP_SEQUENCE: "stop_sequence",
}
SIGNATURE = "mlx-kvq"  # thinking blocks' signature: the server accepts any back


# -------------------------------------------------------------- request -> job
def system_text(system: str | list[S.TextBlock] | None) -> str | None:
    """The system prompt, without Claude Code's billing-header block."""
    if system is None:
        return None
    if isinstance(system, str):
        return system
    kept = [b.text for b in system if not b.text.startswith(S.BILLING_HEADER)]
    return "\n\n".join(kept) if kept else None


def template_messages(body: S.CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation in the chat template's (OpenAI's) message shape."""
    out: list[dict[str, Any]] = []
    system = system_text(body.system)
    if system:
        out.append({"role": "system", "content": system})
    for message in body.messages:
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        if message.role == "assistant":
            out.append(assistant_message(message.content))
            continue
        text: list[str] = []
        for block in message.content:
            if isinstance(block, S.ToolResultBlock):
                out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": block.text()})  # fmt: skip
            elif isinstance(block, S.TextBlock):
                text.append(block.text)
            else:
                raise Refusal(f"{block.type} blocks are only taken in assistant turns", "messages")
        if text:
            out.append({"role": message.role, "content": "".join(text)})
    return out


def assistant_message(blocks: list[Any]) -> dict[str, Any]:
    """An assistant turn: text, reasoning (thinking blocks), tool calls (arguments as objects)."""
    text, reasoning, calls = [], [], []
    for block in blocks:
        if isinstance(block, S.TextBlock):
            text.append(block.text)
        elif isinstance(block, S.ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, S.ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": block.input}})  # fmt: skip
        elif isinstance(block, S.ToolResultBlock):
            raise Refusal("tool_result blocks belong in user turns", "messages")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if any(reasoning):
        message["reasoning"] = "\n".join(r for r in reasoning if r)
    if calls:
        message["tool_calls"] = calls
    return message


def template_tools(tools: list[S.Tool] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for t in tools:
        fn: dict[str, Any] = {"name": t.name, "parameters": t.input_schema}
        if t.description:
            fn["description"] = t.description
        out.append({"type": "function", "function": fn})
    return out


def tools_parsed(choice: S.ToolChoice | None) -> bool:
    """Whether tools are rendered and calls parsed (`none`: neither)."""
    if choice is None or choice.type == "auto":
        if choice is not None and choice.disable_parallel_tool_use:
            raise Refusal("disable_parallel_tool_use cannot be enforced by this server",
                          "tool_choice")  # fmt: skip
        return True
    if choice.type == "none":
        return False
    raise Refusal(
        f"tool_choice {choice.type!r} cannot be enforced by this server (it does not "
        "constrain decoding to a tool call); use 'auto' or 'none'",
        "tool_choice",
    )


def template_args(body: S.CountTokensRequest, service: ChatService) -> dict[str, Any]:
    args: dict[str, Any] = {}
    if body.thinking is not None and body.thinking.type == "disabled":
        if service.reads("enable_thinking"):
            args["enable_thinking"] = False
    effort = body.output_config.effort if body.output_config else None
    if effort is not None and service.reads("reasoning_effort"):
        args["reasoning_effort"] = effort
    if body.output_config is not None and body.output_config.format is not None:
        raise Refusal("output_config.format (structured output) is not supported", "output_config")
    return args


def to_job(body: S.CountTokensRequest, service: ChatService) -> ChatJob:
    """The internal job; `Refusal` names a field this server cannot honour."""
    if body.messages[-1].role == "assistant":
        raise Refusal(
            "a final assistant message (prefill) is not supported: end with a user turn",
            "messages",
        )
    parse = tools_parsed(body.tool_choice)
    return ChatJob(
        messages=template_messages(body),
        sampling=body.to_sampling_params(service.settings.sampling),
        tools=template_tools(body.tools) if parse else None,
        parse_tools=parse,
        template_args=template_args(body, service),
        stream=isinstance(body, S.MessagesRequest) and body.stream,
    )


# -------------------------------------------------------------- answer -> body
def usage_body(usage: Any, output_tokens: int | None = None) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
        "output_tokens": usage.completion_tokens if output_tokens is None else output_tokens,
    }


def block_of(part: Part, show_thinking: bool) -> dict[str, Any]:
    if part.kind == PartKind.REASONING:
        text = part.text if show_thinking else ""
        return {"type": "thinking", "thinking": text, "signature": SIGNATURE}
    if part.kind == PartKind.TEXT:
        return {"type": "text", "text": part.text}
    call = part.call
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": call.input()}


def message_body(mid: str, model: str, parts: list[Part], fin: Finished, show: bool) -> dict:
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [block_of(p, show) for p in parts],
        "stop_reason": STOP_REASONS[fin.reason],
        "stop_sequence": fin.stop_sequence,
        "usage": usage_body(fin.usage),
    }


def sse(event: str, data: dict[str, Any]) -> str:
    """One Anthropic server-sent event (`event:` line, then its JSON)."""
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


class BlockStream:
    """Anthropic's content-block events for a stream of answer parts."""

    def __init__(self, show_thinking: bool):
        self.show = show_thinking
        self.index = -1
        self.open: PartKind | None = None  # the kind of the open block

    def feed(self, part: Part) -> list[str]:
        out: list[str] = []
        if part.kind != self.open or part.kind == PartKind.TOOL_CALL:
            out += self.close()
            self.index += 1
            self.open = part.kind
            block = block_of(part, self.show)
            if part.kind == PartKind.TOOL_CALL:
                out.append(self._start({**block, "input": {}}))
                out.append(self._delta({"type": "input_json_delta",
                                        "partial_json": json.dumps(block["input"])}))  # fmt: skip
                return out
            if part.kind == PartKind.REASONING:
                out.append(self._start({"type": "thinking", "thinking": "", "signature": ""}))
            else:
                out.append(self._start({"type": "text", "text": ""}))
        if part.kind == PartKind.REASONING:
            if self.show:
                out.append(self._delta({"type": "thinking_delta", "thinking": part.text}))
        else:
            out.append(self._delta({"type": "text_delta", "text": part.text}))
        return out

    def close(self) -> list[str]:
        out = []
        if self.open == PartKind.REASONING:
            out.append(self._delta({"type": "signature_delta", "signature": SIGNATURE}))
        if self.open is not None:
            out.append(sse("content_block_stop", {"type": "content_block_stop",
                                                  "index": self.index}))  # fmt: skip
        self.open = None
        return out

    def _start(self, block: dict[str, Any]) -> str:
        return sse("content_block_start",
                   {"type": "content_block_start", "index": self.index, "content_block": block})  # fmt: skip

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse("content_block_delta",
                   {"type": "content_block_delta", "index": self.index, "delta": delta})  # fmt: skip


# -------------------------------------------------------------- routes
def messages_router(service: ChatService, auth: Callable) -> APIRouter:
    """The Messages routes; `auth` is the dependency that checks the API key."""
    router = APIRouter(dependencies=[Depends(auth)])
    settings = service.settings

    async def read(request: Request, model_cls: type) -> tuple[Any, ChatJob, ChatPrompt]:
        body = await read_model(request, model_cls, service)
        try:
            job = await service.prompts.run(to_job, body, service)
        except Refusal as e:
            raise service.reject(400, str(e), param=e.param) from None
        prompt = await service.render(job)
        return body, job, prompt

    async def count_tokens(request: Request) -> dict[str, Any]:
        _, _, prompt = await read(request, S.CountTokensRequest)
        return {"input_tokens": len(prompt.tokens)}

    async def messages(request: Request) -> Response:
        body, job, prompt = await read(request, S.MessagesRequest)
        show = body.thinking is None or body.thinking.display != "omitted"
        answer = await service.start(job, prompt)
        mid, model = f"msg_{uuid.uuid4().hex[:24]}", settings.model_id
        if not body.stream:
            parts, fin = await answer.collect(request)
            return JSONResponse(message_body(mid, model, parts, fin, show))

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

        return event_stream(events())

    router.add_api_route("/v1/messages", messages, methods=["POST"])
    router.add_api_route("/v1/messages/count_tokens", count_tokens, methods=["POST"])
    return router
