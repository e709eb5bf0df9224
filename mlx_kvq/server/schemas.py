"""OpenAI request bodies (validated) and response bodies (built as dicts).

Requests are strict pydantic models: a wrong type is a 400 with the field
named in `param`, as OpenAI answers, never a silent coercion. Every field of
OpenAI's two requests and of mlx_lm.server's is declared: honoured, refused
with a 400 naming it, or on the documented list of fields that cannot change
the output (`fields.py` says which); any other field is a 400 naming it.
Responses are plain dicts in OpenAI's shapes.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from mlx_kvq.engine.requests import TokenEvent, Usage
from mlx_kvq.mlx_lm_internals import token_bytes
from mlx_kvq.sampling_params import SamplingParams
from mlx_kvq.speculative import MAX_DRAFT_TOKENS

from .chat_job import sampling_params

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
        "max_length", "messages", "padding", "return_assistant_tokens_mask", "return_dict",
        "return_tensors", "tokenize", "tokenizer_kwargs", "tools", "truncation",
    }
)  # fmt: skip
# The names a chat template's sandbox provides (Jinja's globals and those
# transformers adds): a variable of the same name would replace them.
TEMPLATE_GLOBALS = frozenset(
    {"cycler", "dict", "joiner", "lipsum", "namespace", "range", "raise_exception", "strftime_now"}
)
TEMPLATE_OVERRIDE = "chat_template"  # a template of the client's own: never accepted


def check_template_kwargs(kwargs: dict[str, Any], where: str) -> None:
    """Raise ValueError naming the first key of `kwargs` that is not a plain
    template variable, or a value that is not plain JSON.

    A template variable only fills a name the model's template reads: it may
    not replace the template (`chat_template`: rendering a client's Jinja has
    no bound on time or memory), a rendering argument, a sandbox global, or a
    name that is not an identifier; its value is a string, number, boolean,
    null, or a list or object of those."""
    if TEMPLATE_OVERRIDE in kwargs:
        raise ValueError(
            f"{where} may not set 'chat_template': requests are rendered with the model's "
            "own chat template (a server can be started with --chat-template)"
        )
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise ValueError(
            f"{where} may not set {reserved[0]!r}: the server renders the prompt to "
            "token ids itself (reserved: " + ", ".join(sorted(RESERVED_TEMPLATE_KWARGS)) + ")"
        )
    for key, value in kwargs.items():
        if not isinstance(key, str) or not key.isidentifier() or key.startswith("_"):
            raise ValueError(
                f"{where} may not set {key!r}: a template variable is an identifier "
                "that does not start with '_'"
            )
        if key in TEMPLATE_GLOBALS:
            raise ValueError(
                f"{where} may not set {key!r}: it would replace the template sandbox's own {key!r}"
            )
        if not plain_json(value):
            raise ValueError(
                f"{where}: {key!r} must be a plain JSON value (string, number, boolean, "
                f"null, or a list or object of those), not {type(value).__name__}"
            )


def plain_json(value: Any) -> bool:
    """Whether `value` is made of JSON's types only (no objects with attributes to reach)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if v is None or type(v) in (str, int, float, bool):
            continue
        if type(v) is list:
            stack.extend(v)
        elif type(v) is dict and all(type(k) is str for k in v):
            stack.extend(v.values())
        else:
            return False
    return True


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    include_usage: bool = False
    include_obfuscation: bool | None = None  # cannot change the output: nothing is obfuscated


Finite = Annotated[float, Field(allow_inf_nan=False)]
ContextSize = Annotated[int, Field(ge=0, le=2**31 - 1)]


def refuse_unless(value: Any, allowed: tuple, message: str) -> Any:
    """`value` when it is one of `allowed` (None, the default, ...), else a 400 with `message`."""
    if value is None or any(value == a and type(value) is type(a) for a in allowed):
        return value
    raise ValueError(message)


class _Request(BaseModel):
    """The fields both endpoints take (see `fields.py` for every field's treatment)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str = "default_model"
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=1)] | None = 1
    top_logprobs: Annotated[int, Field(ge=-1, le=20)] | None = None  # -1: none (mlx-lm's)
    repetition_penalty: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] | None = None
    repetition_context_size: ContextSize | None = None
    presence_penalty: Finite | None = None
    presence_context_size: ContextSize | None = None
    frequency_penalty: Finite | None = None
    frequency_context_size: ContextSize | None = None
    logit_bias: dict[str, Finite] | None = None
    xtc_probability: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    xtc_threshold: Annotated[float, Field(ge=0.0, le=0.5)] | None = None
    user: str | None = None
    # mlx_lm.server's model variants (see server/variants.py)
    adapters: str | None = None
    draft_model: str | None = None
    num_draft_tokens: Annotated[int, Field(ge=0, le=MAX_DRAFT_TOKENS)] | None = None

    @property
    def token_limit(self) -> int | None:
        """mlx_lm.server's order: max_completion_tokens, then max_tokens."""
        return self.max_completion_tokens or self.max_tokens

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

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items())

    @property
    def want_logprobs(self) -> bool:
        """mlx_lm.server returns top tokens for top_logprobs > 0 even without logprobs."""
        return bool(self.logprobs) or self.top_count > 0

    @property
    def top_count(self) -> int:
        """Alternatives per token (mlx-lm's `top_logprobs: -1` is none)."""
        return max(self.top_logprobs or 0, 0)

    def to_sampling_params(self, defaults: SamplingParams) -> SamplingParams:
        """This body's sampling: the server's `defaults` with the fields it sets."""
        return sampling_params(
            self, defaults, max_tokens=self.token_limit, seed=self.sampling_seed,
            stop=self.stop_strings or None, logprobs=self.want_logprobs,
            top_logprobs=self.top_count, logit_bias=self.logit_bias_pairs or None,
        )  # fmt: skip

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None):
        if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported")
        return value

    @field_validator("stream_options")
    @classmethod
    def _check_stream_options(cls, value: StreamOptions | None, info: ValidationInfo):
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream: true")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None):
        for key in value or {}:
            if not key.isascii() or not key.isdigit() or len(key) > 18:
                raise ValueError(f"logit_bias keys must be token ids, not {key[:40]!r}")
        return value


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """A message; keys beyond role and content (`name`, `tool_calls`,
    `tool_call_id`, `reasoning`, ...) reach the chat template as sent."""

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


class FunctionSpec(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["function"]
    function: FunctionSpec


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_schema(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given exactly when type is 'json_schema'")
        return self


class ChatCompletionRequest(_Request):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    role_mapping: dict[str, str] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    # cannot change the output
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    prediction: dict[str, Any] | None = None
    # refused
    audio: Any = None
    modalities: Any = None
    web_search_options: Any = None
    moderation: Any = None
    functions: Any = None
    function_call: Any = None

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, value: dict[str, Any] | None):
        check_template_kwargs(value or {}, "chat_template_kwargs")
        return value

    @field_validator("parallel_tool_calls")
    @classmethod
    def _check_parallel(cls, value: bool | None):
        return refuse_unless(
            value, (True,), "parallel_tool_calls: false cannot be enforced by this server"
        )

    @field_validator("modalities")
    @classmethod
    def _check_modalities(cls, value: Any):
        return refuse_unless(value, (["text"],), "only text output is supported (modalities)")

    @field_validator("audio", "web_search_options", "moderation")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo):
        return refuse_unless(value, (), f"{info.field_name} is not supported by this server")

    @field_validator("functions", "function_call")
    @classmethod
    def _deprecated(cls, value: Any, info: ValidationInfo):
        return refuse_unless(
            value, (), f"{info.field_name} is not supported: use tools and tool_choice"
        )


class CompletionRequest(_Request):
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1, max_length=1)]
        | Annotated[list[int], Field(min_length=1)]
    )
    logprobs: bool | Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool | None = False
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None
    suffix: str | None = None

    @property
    def want_logprobs(self) -> bool:
        """`logprobs: true` or N (0 included), or mlx-lm's `top_logprobs` above 0."""
        given = self.logprobs is not None and self.logprobs is not False  # 0 counts
        return given or self.top_count > 0

    @property
    def top_count(self) -> int:
        """Alternatives per token: `logprobs: N`, else mlx-lm's `top_logprobs`."""
        if isinstance(self.logprobs, int) and not isinstance(self.logprobs, bool):
            return self.logprobs
        return max(self.top_logprobs or 0, 0)

    @property
    def prompt_input(self) -> str | list[int]:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            return self.prompt[0]
        return self.prompt

    @field_validator("echo")
    @classmethod
    def _check_echo(cls, value: bool | None):
        return refuse_unless(value, (False,), "echo is not supported by this server")

    @field_validator("suffix")
    @classmethod
    def _check_suffix(cls, value: str | None):
        return refuse_unless(value, ("",), "suffix (fill-in-the-middle) is not supported")

    @field_validator("logprobs")
    @classmethod
    def _check_top(cls, value: bool | int | None, info: ValidationInfo):
        top = info.data.get("top_logprobs")
        if (
            isinstance(value, int) and not isinstance(value, bool)
            and top is not None and top > 0 and top != value
        ):  # fmt: skip
            raise ValueError("logprobs and top_logprobs ask for different numbers of alternatives")
        return value


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


def models_body(model_id: str, created: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": model_id, "object": "model", "created": created, "owned_by": "mlx-kvq"}],
    }
