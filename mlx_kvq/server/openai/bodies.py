"""OpenAI's response bodies, built as dicts in OpenAI's shapes, and its
server-sent events.

A stream is kept alive with SSE comment lines while no token flows, as
mlx_lm.server does: `: keepalive N/M` after each prefill step of a long
prompt (the engine's `PromptProgress`), and `: keepalive` while a request
waits for a batch slot.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import Any

from mlx_kvq.engine import PromptProgress, TokenEvent, Usage
from mlx_kvq.mlx_lm_internals import token_bytes


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage_body(u: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


MIN_LOGPROB = -9999.0  # what OpenAI reports for a token the model all but rules out


def json_logprob(value: float) -> float | None:
    """A logprob JSON can carry: -inf (a token masked by a grammar or a bias)
    as MIN_LOGPROB, NaN or +inf (logits a penalty drove to infinity) as null."""
    if math.isfinite(value):
        return value
    return MIN_LOGPROB if value == -math.inf else None


class TokenText:
    """Token strings and bytes for logprobs bodies: `bytes` is the token's own
    bytes (part of a character split across tokens, whose string alone is
    U+FFFD), so that a client can join them as OpenAI documents."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.detokenizer = getattr(tokenizer, "detokenizer", None)

    def text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def entry(self, token: int, logprob: float) -> dict[str, Any]:
        text = self.text(token)
        raw = token_bytes(self.detokenizer, token)
        return {
            "token": text,
            "logprob": json_logprob(logprob),
            "bytes": list(raw if raw is not None else text.encode("utf-8")),
        }


def chat_logprobs(events: list[TokenEvent], tt: TokenText) -> dict[str, Any]:
    content = []
    for e in events:
        if e.logprob is None or e.eos:
            continue
        entry = tt.entry(e.token, e.logprob)
        entry["top_logprobs"] = [tt.entry(t, lp) for t, lp in e.top_logprobs]
        content.append(entry)
    return {"content": content}


def completion_logprobs(events: list[TokenEvent], tt: TokenText, offset: int = 0) -> dict:
    tokens, token_logprobs, top, offsets = [], [], [], []
    for e in events:
        start, offset = offset, offset + len(e.text)  # the text released, not the token's string
        if e.logprob is None or e.eos:
            continue
        tokens.append(tt.text(e.token))
        token_logprobs.append(json_logprob(e.logprob))
        top.append({tt.text(t): json_logprob(lp) for t, lp in e.top_logprobs})
        offsets.append(start)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def chat_message(content: str, reasoning: str = "", tool_calls: list | None = None) -> dict:
    """The assistant message as mlx_lm.server returns it: `content` null when
    empty, `reasoning` and `tool_calls` only when there are some."""
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if reasoning:
        message["reasoning"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def chat_body(
    rid: str, model: str, message: dict[str, Any], reason: str, usage: Usage, logprobs: dict | None
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": reason,
            }
        ],
        "usage": usage_body(usage),
    }


def chat_chunk(
    rid: str,
    model: str,
    delta: dict[str, Any] | None,
    reason: str | None = None,
    logprobs: dict | None = None,
    usage: Usage | None = None,
) -> dict[str, Any]:
    choices = []
    if delta is not None:
        choices.append({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason})
    body: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if usage is not None:
        body["usage"] = usage_body(usage)
    return body


def completion_body(
    rid: str,
    model: str,
    text: str,
    reason: str | None,
    usage: Usage | None,
    logprobs: dict | None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}],
    }
    if usage is not None:
        body["usage"] = usage_body(usage)
    return body


def models_body(models: list[dict[str, Any]], created: int) -> dict[str, Any]:
    """OpenAI's model list: each of `models` (its `id` and fields of ours) as a model object."""
    return {
        "object": "list",
        "data": [
            {"id": m["id"], "object": "model", "created": created, "owned_by": "mlx-kvq", **m}
            for m in models
        ],
    }


def sse(data: Any) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(data)}\n\n"


def keepalive(event: PromptProgress | object) -> str:
    """The SSE comment that keeps a stream alive (mlx_lm.server's words)."""
    if isinstance(event, PromptProgress):
        return f": keepalive {event.processed}/{event.total}\n\n"
    return ": keepalive\n\n"


SSE_DONE = "data: [DONE]\n\n"
