"""OpenAI's request bodies, validated: chat completions and completions.

Requests are strict pydantic models: a wrong type is a 400 with the field
named in `param`, as OpenAI answers, never a silent coercion. Every field of
OpenAI's two requests and of mlx_lm.server's is declared: honoured, refused
with a 400 naming it, or on the documented list of fields that cannot change
the output (`server/fields.py` says which); any other field is a 400 naming
it. Each body builds its `SamplingParams` (`to_sampling_params`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from mlx_kvq.sampling_params import SamplingParams
from mlx_kvq.speculative import MAX_DRAFT_TOKENS

from ..chat.job import sampling_params
from ..chat.template_args import check_template_kwargs

MAX_STOP_STRINGS = 16
INT64_MAX = 2**63 - 1
UNSEEDED = -1  # `seed: -1` means "no seed", as llama.cpp and many clients use it

PositiveInt = Annotated[int, Field(ge=1, le=INT64_MAX)]
# Any 64-bit seed a client sends: signed (as OpenAI documents it) or unsigned.
Seed = Annotated[int, Field(ge=-(2**63), lt=2**64)]


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
    # mlx_lm.server's model variants (see variants.py)
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
