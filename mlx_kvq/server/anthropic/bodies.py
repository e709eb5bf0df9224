"""Anthropic's response bodies and server-sent events, from an answer's parts.

The answer comes back as content blocks in the order the model wrote them
(`thinking`, `text`, `tool_use` with its parsed `input`), with Anthropic's
`stop_reason` and `usage` (`input_tokens` without the prompt tokens read
from the prompt cache, which are `cache_read_input_tokens`), or as
Anthropic's server-sent events.
"""

from __future__ import annotations

import json
from typing import Any

from ..chat.answer import Finished, Part, PartKind, StopReason

STOP_REASONS = {
    StopReason.END: "end_turn",
    StopReason.TOOL_USE: "tool_use",
    StopReason.LENGTH: "max_tokens",
    StopReason.STOP_SEQUENCE: "stop_sequence",
}
SIGNATURE = "mlx-kvq"  # thinking blocks' signature: the server accepts any back


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
