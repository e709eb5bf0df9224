"""The Responses API's output items and events, from an answer's parts.

The answer comes back as output items in the order the model wrote them:
`reasoning` (the model's reasoning as its summary text; with `include:
["reasoning.encrypted_content"]` also an opaque value this server reads
back), `message` with `output_text`, and `function_call` items, or as the
Responses events, each with its `sequence_number`.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from ..chat.answer import Finished, Part, PartKind, StopReason
from . import schemas as S


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


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
                item["encrypted_content"] = S.opaque(text)
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
