"""OpenAI request bodies (validated) and response bodies (built as dicts).

Requests are strict pydantic models: a wrong type is a 400 with the field
named in `param`, as OpenAI answers, never a silent coercion. Unknown
fields are accepted and ignored, so clients sending newer OpenAI fields keep
working. Responses are plain dicts in OpenAI's shapes.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from mlx_kvq.engine.requests import TokenEvent, Usage
from mlx_kvq.speculative import MAX_DRAFT_TOKENS

MAX_STOP_STRINGS = 16
INT64_MAX = 2**63 - 1
UNSEEDED = -1  # `seed: -1` means "no seed", as llama.cpp and many clients use it

PositiveInt = Annotated[int, Field(ge=1, le=INT64_MAX)]
# Any 64-bit seed a client sends: signed (as OpenAI documents it) or unsigned.
Seed = Annotated[int, Field(ge=-(2**63), lt=2**64)]

# chat_template_kwargs keys that would change what rendering returns (a
# tensor, a dict, text instead of token ids) or the roles of the arguments the
# server passes itself: refused with a 400 instead of reaching the template.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "add_generation_prompt", "continue_final_message", "conversation", "documents",
        "max_length", "padding", "return_assistant_tokens_mask", "return_dict",
        "return_tensors", "tokenize", "tokenizer_kwargs", "tools", "truncation",
    }
)  # fmt: skip


def check_template_kwargs(kwargs: dict[str, Any], where: str) -> None:
    """Raise ValueError naming the first reserved key of `kwargs`."""
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise ValueError(
            f"{where} may not set {reserved[0]!r}: the server renders the prompt to "
            "token ids itself (reserved: " + ", ".join(sorted(RESERVED_TEMPLATE_KWARGS)) + ")"
        )


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str = "default_model"
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1
    # mlx_lm.server's model variants (see server/variants.py)
    adapters: str | None = None
    draft_model: str | None = None
    num_draft_tokens: Annotated[int, Field(ge=0, le=MAX_DRAFT_TOKENS)] | None = None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return tuple(s for s in stops if s)

    @property
    def sampling_seed(self) -> int | None:
        """The seed as the sampler takes it: -1 is unseeded, other negative
        seeds are read as the unsigned 64-bit number with the same bits."""
        if self.seed is None or self.seed == UNSEEDED:
            return None
        return self.seed % 2**64

    @model_validator(mode="after")
    def _check_stop(self):
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported")
        return self

    @field_validator("stream_options")
    @classmethod
    def _check_stream_options(cls, value: StreamOptions | None, info: ValidationInfo):
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream: true")
        return value


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def as_template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it (text parts joined)."""
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            out["content"] = "".join(p.text for p in self.content)
        elif self.content is None:
            out["content"] = ""
        return out


class ChatCompletionRequest(_Request):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, value: dict[str, Any] | None):
        check_template_kwargs(value or {}, "chat_template_kwargs")
        return value


class CompletionRequest(_Request):
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1, max_length=1)]
        | Annotated[list[int], Field(min_length=1)]
    )
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: Literal[False] = False

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def prompt_input(self) -> str | list[int]:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            return self.prompt[0]
        return self.prompt


# ---------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage_body(u: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


class TokenText:
    """Token strings and bytes for logprobs bodies."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def entry(self, token: int, logprob: float) -> dict[str, Any]:
        text = self.text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


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
        if e.logprob is None or e.eos:
            continue
        text = tt.text(e.token)
        tokens.append(text)
        token_logprobs.append(e.logprob)
        top.append({tt.text(t): lp for t, lp in e.top_logprobs})
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def chat_body(
    rid: str, model: str, text: str, reason: str, usage: Usage, logprobs: dict | None
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
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


def models_body(model_id: str, created: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": model_id, "object": "model", "created": created, "owned_by": "mlx-kvq"}],
    }
