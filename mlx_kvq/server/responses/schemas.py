"""OpenAI Responses request bodies, validated, with every field's treatment.

Every field the `openai` SDK (3.x) and Codex send is declared here and
listed in `server/fields.py` (`RESPONSES`) with its treatment; any other
field is a 400 naming it.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from mlx_kvq.sampling_params import SamplingParams

from ..chat.job import sampling_params

# Tools a hosted service runs itself: left out of the prompt here (logged once, counted)
HOSTED_TOOLS = frozenset(
    {
        "web_search", "web_search_preview", "web_search_2025_08_26",
        "web_search_preview_2025_03_11", "file_search", "code_interpreter",
        "image_generation", "computer_use_preview", "computer_use", "mcp", "local_shell",
        "tool_search",
    }
)  # fmt: skip
ENCRYPTED = "reasoning.encrypted_content"


class _Item(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    id: str | None = None
    status: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["input_text", "output_text", "text", "summary_text", "reasoning_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class RefusalPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["refusal"]
    refusal: str


class MediaPart(BaseModel):
    """An image, file or audio part: refused, the served models take text only."""

    model_config = ConfigDict(extra="allow")

    type: Literal["input_image", "input_file", "input_audio"]

    @field_validator("type")
    @classmethod
    def _refuse(cls, value: str):
        raise ValueError(f"{value} parts cannot be honoured: the served model takes text only")


ContentPart = Annotated[TextPart | RefusalPart | MediaPart, Field(discriminator="type")]


def part_text(content: str | list[Any] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.text if isinstance(p, TextPart) else p.refusal for p in content)


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    phase: str | None = None


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]


class ReasoningItem(_Item):
    type: Literal["reasoning"]
    summary: list[TextPart] = []
    content: list[TextPart] | None = None
    encrypted_content: str | None = None


OPAQUE_PREFIX = "mlx-kvq:"  # encrypted_content this server wrote (base64 JSON of the reasoning)


def opaque(reasoning: str) -> str:
    """The `encrypted_content` of a reasoning item: opaque to the client, read back here."""
    raw = json.dumps({"reasoning": reasoning}).encode()
    return OPAQUE_PREFIX + base64.b64encode(raw).decode()


def reasoning_of(item: ReasoningItem) -> str:
    """A reasoning item's text: this server's opaque value, else its content or summary."""
    value = item.encrypted_content or ""
    if value.startswith(OPAQUE_PREFIX):
        try:
            return json.loads(base64.b64decode(value[len(OPAQUE_PREFIX) :]))["reasoning"]
        except (binascii.Error, ValueError, KeyError, TypeError):
            pass
    parts = item.content or item.summary
    return "\n".join(p.text for p in parts)


def _item_type(value: Any) -> str:
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", "message")


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None


class NamespaceTool(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["namespace"]
    name: str
    description: str | None = None
    tools: list[FunctionTool]


class HostedTool(BaseModel):
    """A tool a hosted service runs (its settings are not read here)."""

    model_config = ConfigDict(extra="allow")

    type: str

    @field_validator("type")
    @classmethod
    def _hosted(cls, value: str):
        if value not in HOSTED_TOOLS:
            raise ValueError(
                f"tools of type {value!r} are not supported (function, namespace, and the "
                "hosted tools left out of the prompt: " + ", ".join(sorted(HOSTED_TOOLS)) + ")"
            )
        return value


def _tool_type(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ("function", "namespace") else "hosted"


ToolSpec = Annotated[
    Annotated[FunctionTool, Tag("function")]
    | Annotated[NamespaceTool, Tag("namespace")]
    | Annotated[HostedTool, Tag("hosted")],
    Discriminator(_tool_type),
]


class Reasoning(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class TextFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    include: list[str] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: Reasoning | None = None
    text: TextConfig | None = None
    # cannot change the output
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    metadata: dict[str, str] | None = None
    client_metadata: dict[str, Any] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    stream_options: dict[str, Any] | None = None
    # refused
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None

    @field_validator("include")
    @classmethod
    def _check_include(cls, value: list[str] | None):
        for name in value or ():
            if name != ENCRYPTED:
                raise ValueError(f"include {name!r} is not supported (only {ENCRYPTED!r})")
        return value

    @field_validator("background")
    @classmethod
    def _no_background(cls, value: bool | None):
        if value:
            raise ValueError("background responses are not supported by this server")
        return value

    @field_validator("conversation", "prompt")
    @classmethod
    def _refused(cls, value: Any, info: Any):
        if value is not None:
            raise ValueError(f"{info.field_name} objects of a hosted service are not supported")
        return value

    def to_sampling_params(self, defaults: SamplingParams) -> SamplingParams:
        """This body's sampling: the server's `defaults` with the fields it sets."""
        return sampling_params(self, defaults, max_tokens=self.max_output_tokens)
